"""Opt-in changes to a transformers causal LM for long sequences: chunked loss, tiled MLP,
activation checkpointing with offload. Each works on plain, PEFT-, DDP- and FSDP-wrapped models,
is idempotent, and has an undo where one makes sense. The computations are the ops in
``hf_ring.ops``; this module only finds the modules and wires the ops in.
"""

from __future__ import annotations

import types
from typing import Any

from torch import Tensor, nn
from transformers import PreTrainedModel

from ..ops.offload import OffloadActivations
from ..ops.tiled_mlp import tiled_forward
from .context import KEY, RingContext

__all__ = [
    "enable_chunked_loss",
    "disable_chunked_loss",
    "enable_tiled_mlp",
    "disable_tiled_mlp",
    "enable_activation_checkpointing",
]


def causal_lm(model: nn.Module, caller: str) -> PreTrainedModel:
    """The outermost transformers model inside ``model`` (plain, PEFT-, DDP- or FSDP-wrapped)."""
    for m in model.modules():
        if isinstance(m, PreTrainedModel):
            return m
    raise TypeError(f"{caller}: found no transformers model inside {type(model).__name__}")


def decoder(lm: PreTrainedModel, caller: str) -> nn.Module:
    """The decoder (``lm.model`` for Llama and most causal LMs): the module before the LM head."""
    dec = lm.get_decoder() if hasattr(lm, "get_decoder") else None
    if not isinstance(dec, nn.Module):
        dec = getattr(lm, getattr(lm, "base_model_prefix", "model"), None)
    if not isinstance(dec, nn.Module) or dec is lm:
        raise TypeError(f"{caller}: cannot find the decoder of {type(lm).__name__}")
    return dec


# --- chunked loss --------------------------------------------------------------------------------

# Config fields of models whose logits are not plain ``lm_head(hidden)``: the chunked path would
# give a different loss, so enable_chunked_loss refuses them.
_LOGIT_POSTPROCESSING = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")


def logit_postprocessing(lm: PreTrainedModel) -> str | None:
    """``"name=value"`` of the config field by which ``lm``'s logits differ from ``lm_head(hidden)``,
    or ``None`` when they do not (then computing the head in chunks reproduces them)."""
    for name in _LOGIT_POSTPROCESSING:
        value = getattr(lm.config, name, None)
        if value not in (None, 1, 1.0):
            return f"{name}={value}"
    return None


class _SetAsideHiddenStates:
    """Decoder forward hook: for a labelled batch with a ``RingContext``, put the last hidden states
    on the context (the loss takes them from there) and hand the LM head zero positions."""

    def __init__(self, lm: PreTrainedModel, chunk_size: int | None) -> None:
        self.head = lm.get_output_embeddings()
        self.chunk_size = chunk_size
        self.handle = decoder(lm, "enable_chunked_loss").register_forward_hook(self, with_kwargs=True)

    def __call__(self, module: nn.Module, args: Any, kwargs: dict, output: Any) -> Any:
        ctx: RingContext | None = kwargs.get(KEY)
        if ctx is None or not ctx.labelled or ctx.full_logits:
            return None
        if isinstance(output, tuple):
            hidden: Tensor = output[0]
            ctx.set_aside(hidden, self.head, self.chunk_size)
            return (hidden[..., :0, :], *output[1:])
        hidden = output.last_hidden_state
        ctx.set_aside(hidden, self.head, self.chunk_size)
        output.last_hidden_state = hidden[..., :0, :]  # the model computes logits of zero positions
        return output

    def remove(self) -> None:
        self.handle.remove()


def enable_chunked_loss(model: nn.Module, chunk_size: int | None = None) -> nn.Module:
    """Compute the loss of labelled ``shard_batch`` batches without full logits (idempotent).

    ``model``: a transformers causal LM, possibly wrapped by PEFT, DDP or FSDP (call it before or
    after wrapping). For every call that carries a labelled ``ring_context`` (a batch from
    ``hf_ring.shard_batch`` with labels), the decoder's last hidden states ``[B, S_local, H]`` go
    to the loss through the context, which computes it with ``chunked_causal_lm_loss``; the LM head
    sees zero positions, so ``out.logits`` is ``[B, 0, V]``. Calls without labels, and batches from
    ``shard_batch(..., full_logits=True)``, return the full logits as before. Returns ``model``.
    """
    lm = causal_lm(model, "enable_chunked_loss")
    if not isinstance(lm.get_output_embeddings(), nn.Module):
        raise TypeError(f"enable_chunked_loss: {type(lm).__name__} has no output embedding (lm_head)")
    post = logit_postprocessing(lm)
    if post is not None:
        raise ValueError(
            f"enable_chunked_loss: {type(lm).__name__} post-processes its logits ({post}), "
            "which the chunked loss does not reproduce"
        )
    disable_chunked_loss(model)
    lm._hf_ring_chunked = _SetAsideHiddenStates(lm, chunk_size)
    return model


def disable_chunked_loss(model: nn.Module) -> nn.Module:
    """Undo ``enable_chunked_loss``: the model computes full logits for every call again."""
    lm = causal_lm(model, "disable_chunked_loss")
    hook = lm.__dict__.pop("_hf_ring_chunked", None)
    if hook is not None:
        hook.remove()
    return model


# --- tiled MLP -----------------------------------------------------------------------------------


def _mlps(model: nn.Module) -> list[nn.Module]:
    return [
        m
        for m in model.modules()
        if all(isinstance(getattr(m, n, None), nn.Module) for n in ("gate_proj", "up_proj", "down_proj"))
        and type(m).__name__.endswith("MLP")
    ]


def _tiled(self: nn.Module, x: Tensor) -> Tensor:
    forward, tile = self._hf_ring_tiled
    return tiled_forward(self, forward, x, tile)


def enable_tiled_mlp(model: nn.Module, tile_tokens: int = 8192) -> nn.Module:
    """Run every gated MLP (``...MLP`` modules with ``gate_proj``/``up_proj``/``down_proj``: Llama,
    Qwen2/3, Mistral) of ``model`` over tiles of ``tile_tokens`` tokens, saving only its input
    (``hf_ring.ops.tiled_mlp``). Works on plain, PEFT- and DDP-wrapped models, with activation
    checkpointing; idempotent (a second call changes the tile size). Returns ``model``."""
    if tile_tokens < 1:
        raise ValueError(f"tile_tokens must be positive, not {tile_tokens}")
    mlps = _mlps(model)
    if not mlps:
        raise TypeError(f"enable_tiled_mlp: no gated MLP (gate_proj, up_proj, down_proj) in {type(model).__name__}")
    for m in mlps:
        forward = m._hf_ring_tiled[0] if hasattr(m, "_hf_ring_tiled") else m.forward
        m._hf_ring_tiled = (forward, int(tile_tokens))
        m.forward = types.MethodType(_tiled, m)
    return model


def disable_tiled_mlp(model: nn.Module) -> nn.Module:
    """Undo ``enable_tiled_mlp``."""
    for m in _mlps(model):
        if hasattr(m, "_hf_ring_tiled"):
            del m.forward, m._hf_ring_tiled
    return model


# --- activation checkpointing --------------------------------------------------------------------


def enable_activation_checkpointing(
    model: nn.Module, *, offload: bool | type[OffloadActivations] = False, every_n_layers: int = 1
) -> nn.Module:
    """Checkpoint every ``every_n_layers``-th decoder layer of a transformers model (plain, PEFT- or
    DDP-wrapped; non-reentrant ``torch.utils.checkpoint``); with ``offload``, keep what the decoder
    saves for backward in host memory (``hf_ring.ops.offload``; a subclass of
    ``OffloadActivations`` may be passed instead of ``True``). Idempotent; returns ``model``.

    Why not ``model.activation_checkpointing_enable(offload=True)``: transformers 5 asks
    ``save_on_cpu`` for pinned memory, which raises on machines without an accelerator.
    """
    lm = causal_lm(model, "enable_activation_checkpointing")
    lm.activation_checkpointing_enable(
        activation_checkpointing_kwargs={"use_reentrant": False}, every_n_layers=every_n_layers
    )
    old = lm.__dict__.pop("_hf_ring_offload", None)
    if old is not None:
        old.remove()
    if offload:
        cls = offload if isinstance(offload, type) else OffloadActivations
        lm._hf_ring_offload = cls(decoder(lm, "enable_activation_checkpointing"))
    return model
