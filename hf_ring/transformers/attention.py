"""``attn_implementation="ring"`` for transformers: the attention function, its mask function,
and the loss hook that sums each rank's share of the loss over the CP group.

The attention function follows transformers' ``AttentionInterface`` contract: it receives
``query [B, Hq, S, D]`` and ``key``/``value [B, Hkv, S, D]`` (RoPE applied, K/V heads not expanded)
and returns ``(out [B, S, Hq, D], None)``. Everything it cannot compute exactly raises.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ..ops.comm import group_size_rank
from ..ops.cross_entropy import take_pending
from ..ops.reduce import CPLoss, reduce_loss
from ..ops.ring import ring_attention
from ..parallel import default_group

NAME = "ring"


class RingMask:
    """What the ring mask function hands the model instead of an ``[N, N]`` mask: "causal over
    global positions, no padding". The attention function accepts nothing else."""

    def __repr__(self) -> str:
        return "RingMask(causal over global positions)"

    # Reached only when a model computes attention itself with the mask meant for the ring.
    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        raise TypeError(_NO_REGISTRY)

    def _unsupported(self, *_: Any) -> Any:
        raise TypeError(_NO_REGISTRY)

    __add__ = __radd__ = __mul__ = __rmul__ = __and__ = __rand__ = __getitem__ = _unsupported


_NO_REGISTRY = (
    'attn_implementation="ring": this model computes attention itself instead of calling '
    "transformers' attention registry (AttentionInterface), so it cannot run ring attention. "
    "Supported: models that use the registry, such as Llama, Qwen2, Qwen3 and Mistral."
)


RING_MASK = RingMask()


def ring_mask(*, attention_mask: Tensor | None = None, **_: Any) -> RingMask:
    """Mask function registered for "ring": never builds an ``O(N^2)`` mask.

    Raises on a padding mask: a 2D mask must reach the model through ``hf_ring.shard_batch``, which
    handles right padding exactly (and passes no mask). ``mask_function`` is ignored on purpose:
    transformers reads zigzag ``position_ids`` as packed documents.
    """
    if attention_mask is not None and not bool(attention_mask.all()):
        raise ValueError(
            'attn_implementation="ring" got an attention_mask with padding. Pass the full batch '
            "through hf_ring.shard_batch, which handles right padding exactly and drops the mask; "
            "left padding is not supported."
        )
    return RING_MASK


_UNSUPPORTED = {
    "softcap": "attention logit soft-capping",
    "s_aux": "attention sinks",
    "sinks": "attention sinks",
    "position_bias": "additive position bias",
    "cu_seq_lens_q": "packed sequences (cu_seq_lens)",
    "cu_seq_lens_k": "packed sequences (cu_seq_lens)",
}


def ring_attention_forward(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Any,
    *,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    is_causal: bool | None = None,
    hf_ring_cp: CPLoss | None = None,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """transformers attention function for ``attn_implementation="ring"``.

    ``query: [B, Hq, S_local, D]``, ``key``/``value: [B, Hkv, S_local, D]``, this rank's zigzag
    shard (see ``hf_ring.shard_batch``). Returns ``([B, S_local, Hq, D], None)``.
    """
    for name, what in _UNSUPPORTED.items():
        if kwargs.get(name) is not None:
            raise ValueError(f'attn_implementation="ring" does not support {what} (got {name}=...).')
    if dropout:
        raise ValueError(
            f'attn_implementation="ring" does not support attention dropout (dropout={dropout} while '
            "training); set config.attention_dropout = 0.0."
        )
    if attention_mask is not None and attention_mask is not RING_MASK:
        raise ValueError(
            f'attn_implementation="ring" got an attention mask it did not prepare ({type(attention_mask).__name__}); '
            "it applies the causal mask over global positions itself. Pass the batch through "
            "hf_ring.shard_batch (right padding is handled there) instead of a custom mask."
        )
    if query.shape[2] != key.shape[2]:
        raise ValueError(
            f'attn_implementation="ring" needs as many keys as queries (got {query.shape[2]} queries, '
            f"{key.shape[2]} keys): decoding with a KV cache is not supported. Pass use_cache=False "
            "(shard_batch does) and generate with another attn_implementation."
        )
    group = hf_ring_cp.group if hf_ring_cp is not None else default_group()
    size, _ = group_size_rank(group)
    n_global = query.shape[2] * size
    if sliding_window is not None and sliding_window < n_global:
        raise ValueError(
            f'attn_implementation="ring" computes full causal attention, but this layer has a sliding '
            f"window of {sliding_window} tokens, shorter than the sequence ({n_global}). Set "
            "config.sliding_window = None (Mistral) or config.use_sliding_window = False (Qwen2/Qwen3) "
            "to train with full attention, or keep sequences within the window."
        )
    rope = getattr(module.config, "rope_parameters", None) or {}
    if isinstance(rope, dict) and rope.get("rope_type") in ("dynamic", "longrope"):
        raise ValueError(
            f"attn_implementation=\"ring\": rope_type={rope['rope_type']!r} rescales RoPE from the largest "
            "position each rank sees, which differs between ranks; use 'default', 'linear', 'llama3' or 'yarn'."
        )
    causal = module.is_causal if is_causal is None else is_causal
    _calls[0] += 1
    out = ring_attention(
        query.transpose(1, 2),  # (B, S, Hq, D)
        key.transpose(1, 2),  # (B, S, Hkv, D)
        value.transpose(1, 2),
        group=group,
        causal=causal,
        softmax_scale=scaling,
    )
    return out, None


_calls = [0]  # ring attention calls since the last loss of a sharded batch


def _ring_causal_lm_loss(original: Any) -> Any:
    def loss(*args: Any, hf_ring_cp: CPLoss | None = None, **kwargs: Any) -> Tensor:
        pending = take_pending(hf_ring_cp)  # set aside by enable_chunked_loss's LM-head hook
        local = original(*args, **kwargs) if pending is None else pending.loss(**kwargs)
        if hf_ring_cp is None:
            return local
        if _calls[0] == 0 and group_size_rank(hf_ring_cp.group)[0] > 1:
            raise RuntimeError(
                "a batch sharded by hf_ring.shard_batch went through a model that never called ring "
                'attention, so its tokens attended only their own shard. Load the model with '
                'attn_implementation="ring" (or call model.set_attn_implementation("ring")); models '
                "that do not use transformers' attention registry are not supported."
            )
        _calls[0] = 0
        return reduce_loss(local, hf_ring_cp)

    loss.hf_ring_original = original  # type: ignore[attr-defined]
    return loss


def register() -> None:
    """Make ``attn_implementation="ring"`` available to transformers (idempotent).

    Registers the attention function and the mask function under "ring", and wraps the causal-LM
    loss so that batches from ``shard_batch`` (which carry ``hf_ring_cp``) get their loss summed
    over the CP group; every other call of that loss is unchanged. Runs at ``import hf_ring``.
    """
    from transformers import AttentionInterface
    from transformers.loss.loss_utils import LOSS_MAPPING
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(NAME, ring_attention_forward)
    AttentionMaskInterface.register(NAME, ring_mask)
    if not hasattr(LOSS_MAPPING["ForCausalLM"], "hf_ring_original"):
        LOSS_MAPPING["ForCausalLM"] = _ring_causal_lm_loss(LOSS_MAPPING["ForCausalLM"])
