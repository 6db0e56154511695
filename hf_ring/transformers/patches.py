"""Opt-in changes to a transformers causal LM for long sequences: chunked loss, tiled MLP,
activation checkpointing with offload. Each works on plain, PEFT-, DDP- and FSDP-wrapped models,
is idempotent, and has an undo. The computations are the ops in ``hf_ring.ops``; this module only
finds the modules and wires the ops in. Every change to a model (hooks, a module's ``forward``) is a
ledger entry of that model (``hf_ring.ledger``); what hf_ring keeps about a model (its chunked loss,
its MLPs' tiles, its offload) lives in hf_ring's own weak maps, never on the model.
"""

from __future__ import annotations

import contextlib
import types
import weakref
from collections.abc import Iterator
from typing import Any

from torch import Tensor, nn
from transformers import PreTrainedModel

from ..errors import RingNotSupported
from ..ledger import LEDGER
from ..ops.cross_entropy import Transform
from ..ops.offload import OffloadActivations
from ..ops.tiled_mlp import tiled_forward
from .carry import context_of
from .context import RingContext
from .logits import logits_transform
from .loss import CHUNKED, ChunkedLossInput, give_loss

__all__ = [
    "chunked_loss",
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
    """The decoder (``lm.model`` for Llama and most causal LMs): the module before the LM head -- the
    one transformers model that ``lm`` holds as a direct child, else ``get_decoder()``."""
    inner = [m for m in lm.children() if isinstance(m, PreTrainedModel)]
    if len(inner) == 1:
        return inner[0]
    dec = lm.get_decoder() if hasattr(lm, "get_decoder") else None
    if not isinstance(dec, nn.Module):
        dec = getattr(lm, getattr(lm, "base_model_prefix", "model"), None)
    if not isinstance(dec, nn.Module) or dec is lm:
        raise TypeError(f"{caller}: cannot find the decoder of {type(lm).__name__}")
    return dec


# --- chunked loss --------------------------------------------------------------------------------


class ChunkedLoss:
    """The chunked loss of one causal LM: its hooks, and the LM head's input of each labelled call in
    flight, kept here for that call's loss (``take``), keyed weakly by the call's ``RingContext``.

    After the decoder ran with a labelled ``ring_context`` (and no ``full_logits``), the LM head's
    input is kept and the head computes zero positions; the model's ``CausalLMLoss`` takes it.
    The head is looked up at every such forward, so a head wrapped later (LoRA on ``lm_head``) is
    the one hooked."""

    def __init__(self, lm: PreTrainedModel, chunk_size: int | None, transform: Transform | None) -> None:
        self.lm = weakref.ref(lm)
        self.chunk_size, self.transform = chunk_size, transform
        self.pending: RingContext | None = None  # the call whose head call comes next
        self.kept: weakref.WeakKeyDictionary[RingContext, ChunkedLossInput] = weakref.WeakKeyDictionary()
        self.head: nn.Module | None = None
        self.head_entry: Any = None
        dec = decoder(lm, "enable_chunked_loss")
        self.entries = [LEDGER.hook(dec, dec.register_forward_hook(self.after_decoder, with_kwargs=True), why=WHY)]
        self._hook_head(lm)

    def _hook_head(self, lm: PreTrainedModel) -> None:
        head = lm.get_output_embeddings()
        if head is not self.head:
            if self.head_entry is not None:
                LEDGER.undo(self.head_entry)
            self.head = head
            self.head_entry = LEDGER.hook(head, head.register_forward_pre_hook(self.before_head), why=WHY)

    def after_decoder(self, module: nn.Module, args: Any, kwargs: dict, output: Any) -> None:
        ctx = context_of(kwargs)  # its own, or the one its causal LM carries (Mamba)
        self.pending = ctx if ctx is not None and ctx.labelled and not ctx.full_logits else None
        lm = self.lm()
        if self.pending is not None and lm is not None:
            self._hook_head(lm)

    def before_head(self, module: nn.Module, args: tuple) -> tuple | None:
        ctx, self.pending = self.pending, None
        if ctx is None:
            return None
        hidden: Tensor = args[0]
        self.kept[ctx] = ChunkedLossInput(hidden, module, self.chunk_size, self.transform)
        # the model computes logits of zero positions, from a new empty tensor: a view of ``hidden`` would keep
        # all of it (``[tokens, hidden]``) alive through the backward
        return (hidden.new_empty((*hidden.shape[:-2], 0, hidden.shape[-1])), *args[1:])

    def take(self, ctx: RingContext) -> ChunkedLossInput | None:
        """What was kept for the call of ``ctx``, once (the loss's side); ``None`` when that call
        computed full logits."""
        return self.kept.pop(ctx, None)

    def remove(self) -> None:
        for entry in (*self.entries, self.head_entry):
            if entry is not None:
                LEDGER.undo(entry)
        self.kept.clear()


WHY = ("`enable_chunked_loss`: the decoder's forward hook and the LM head's pre-hook keep the head's input of a "
       "labelled call for its loss (`CausalLMLoss`), the head computes zero positions")  # fmt: skip
_TRANSFORMS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # lm -> its logits transform (probed once)


def _transform(lm: PreTrainedModel, caller: str) -> Transform | None:
    if lm not in _TRANSFORMS:
        _TRANSFORMS[lm] = logits_transform(lm, decoder(lm, caller), caller)
    return _TRANSFORMS[lm]


def enable_chunked_loss(model: nn.Module, chunk_size: int | None = None) -> nn.Module:
    """Compute the loss of labelled ``shard_batch`` batches without full logits (idempotent).

    ``model``: a transformers causal LM, possibly wrapped by PEFT, DDP or FSDP (call it before or
    after wrapping). For every call that carries a labelled ``ring_context`` (a batch from
    ``hf_ring.shard_batch`` with labels), the LM head's input ``[B, S_local, H]`` is kept for that
    call's loss (the model's ``loss_function``, ``hf_ring.transformers.loss.CausalLMLoss``, given
    to the model here if it has none), which computes it with ``chunked_causal_lm_loss``; the LM head sees zero
    positions, so ``out.logits`` is ``[B, 0, V]``. Calls without labels, and batches from
    ``shard_batch(..., full_logits=True)``, return the full logits as before. Returns ``model``.

    What the model does between its LM head and its logits (Gemma 2's and RecurrentGemma's
    soft-caps, Falcon-H1's ``lm_head_multiplier``, Cohere's ``logit_scale``, Granite's
    ``logits_scaling``, casts) is found here, once, by probing the model
    (``hf_ring.transformers.logits``), and applied to every chunk; a model whose logits the probe
    cannot reproduce chunk by chunk raises ``RingNotSupported`` (train it without the chunked loss:
    ``RingTrainingArguments(chunked_loss=False)``). Call it again after changing such a setting.
    """
    lm = causal_lm(model, "enable_chunked_loss")
    _TRANSFORMS.pop(lm, None)  # probed again: a setting may have changed
    try:
        transform = _transform(lm, "enable_chunked_loss")
    except RingNotSupported as e:
        raise RingNotSupported(
            f"{e} Train it with the full logits: RingTrainingArguments(chunked_loss=False) (a recipe's "
            "chunked_loss: false), or do not call hf_ring.enable_chunked_loss."
        ) from None
    disable_chunked_loss(model)
    give_loss(lm)
    CHUNKED[lm] = ChunkedLoss(lm, chunk_size, transform)
    return model


def disable_chunked_loss(model: nn.Module) -> nn.Module:
    """Undo ``enable_chunked_loss``: the model computes full logits for every call again."""
    lm = causal_lm(model, "disable_chunked_loss")
    chunked = CHUNKED.pop(lm, None)
    if chunked is not None:
        chunked.remove()
    return model


@contextlib.contextmanager
def chunked_loss(model: nn.Module, caller: str) -> Iterator[ChunkedLoss]:
    """The chunked loss of ``model``'s causal LM for the duration of the block: its own, or one made for the
    block and removed after it (``sequence_logprobs``: no lasting change to the model)."""
    lm = causal_lm(model, caller)
    own = CHUNKED.get(lm)
    if own is not None:
        yield own
        return
    made = ChunkedLoss(lm, None, _transform(lm, caller))
    CHUNKED[lm] = made
    try:
        yield made
    finally:
        CHUNKED.pop(lm, None)
        made.remove()


# --- tiled MLP -----------------------------------------------------------------------------------


def _mlps(model: nn.Module) -> list[nn.Module]:
    return [
        m
        for m in model.modules()
        if all(isinstance(getattr(m, n, None), nn.Module) for n in ("gate_proj", "up_proj", "down_proj"))
        and type(m).__name__.endswith("MLP")
    ]


_TILED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # MLP -> (its own forward function, tile tokens)
TILED_WHY = "`enable_tiled_mlp`: the MLP's `forward` runs over tiles of tokens (`ops.tiled_mlp`), saving only its input"


def _tiled(self: nn.Module, x: Tensor) -> Tensor:
    function, tile = _TILED[self]
    return tiled_forward(self, types.MethodType(function, self), x, tile)


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
        if m not in _TILED:
            function = getattr(m.forward, "__func__", None)
            if function is None:
                raise TypeError(f"enable_tiled_mlp: {type(m).__name__}.forward is not a method of the module")
            LEDGER.set_attr(m, "forward", types.MethodType(_tiled, m), why=TILED_WHY, scope="model")
            _TILED[m] = (function, int(tile_tokens))
        else:
            _TILED[m] = (_TILED[m][0], int(tile_tokens))
    return model


def disable_tiled_mlp(model: nn.Module) -> nn.Module:
    """Undo ``enable_tiled_mlp``."""
    for m in _mlps(model):
        if _TILED.pop(m, None) is not None:
            entry = LEDGER.find(m, "forward")
            if entry is not None:
                LEDGER.undo(entry)
    return model


def tiled(module: nn.Module) -> int | None:
    """The tile size of ``module`` (an MLP) under ``enable_tiled_mlp``, or ``None``."""
    found = _TILED.get(module)
    return found[1] if found is not None else None


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
    hooked = bool(getattr(lm, "_require_grads_hooks", None)) or hasattr(lm, "_require_grads_hook")
    if hasattr(lm, "activation_checkpointing_enable"):  # transformers >= 5.25
        lm.activation_checkpointing_enable(
            activation_checkpointing_kwargs={"use_reentrant": False}, every_n_layers=every_n_layers
        )
        disable = lm.activation_checkpointing_disable
    else:  # the name before (its deprecated alias from 5.25 on)
        lm.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": False}, every_n_layers=every_n_layers
        )
        disable = lm.gradient_checkpointing_disable
    if lm not in _CHECKPOINTED:  # transformers' own switch (its layers' flags, the embeddings' hook), undone by it
        _CHECKPOINTED.add(lm)

        def undo() -> None:
            disable()
            if not hooked:  # the embeddings' hook transformers added with it
                lm.disable_input_require_grads()

        LEDGER.made(lm, undo, why="`enable_activation_checkpointing`: transformers' activation checkpointing on",
                    scope="model")  # fmt: skip
    old = _OFFLOAD.pop(lm, None)
    if old is not None:
        for entry in old[1]:
            LEDGER.undo(entry)
    if offload:
        cls = offload if isinstance(offload, type) else OffloadActivations
        dec = decoder(lm, "enable_activation_checkpointing")
        made = cls(dec)
        _OFFLOAD[lm] = (made, [LEDGER.hook(dec, h, why=OFFLOAD_WHY) for h in made.handles])
    return model


_OFFLOAD: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # lm -> (its OffloadActivations, ledger entries)
_CHECKPOINTED: weakref.WeakSet = weakref.WeakSet()  # causal LMs whose checkpointing hf_ring switched on
OFFLOAD_WHY = "`enable_activation_checkpointing(offload=True)`: decoder hooks keep its saved tensors in host memory"


def offloaded(model: nn.Module) -> OffloadActivations | None:
    """The activation offload of ``model``'s causal LM, or ``None``."""
    found = _OFFLOAD.get(causal_lm(model, "offloaded"))
    return found[0] if found is not None else None


def forget_models() -> None:
    """Forget what hf_ring kept about every model (``uninstall``, after the ledger undid the changes)."""
    for kept in (CHUNKED, _TRANSFORMS, _TILED, _OFFLOAD, _CHECKPOINTED):
        kept.clear()
