"""``attn_implementation="ring"`` for transformers: the attention function and its mask function.

The attention function follows transformers' ``AttentionInterface`` contract: it receives
``query [B, Hq, S, D]`` and ``key``/``value [B, Hkv, S, D]`` (RoPE applied, K/V heads not expanded)
and returns ``(out [B, S, Hq, D], None)``. It is a function of its arguments: the batch's
``RingContext`` (keyword ``ring_context``, from ``hf_ring.shard_batch``) says which CP group to
run on -- with Ulysses (``ulysses_size > 1``), its Ulysses and ring groups, and the call goes to
``hf_ring.ops.ulysses.ulysses_ring_attention`` --, and the call is counted on it
(``RingContext.cross_rank_calls``, for the "ring attention never ran" guard). Everything it
cannot compute exactly raises ``RingNotSupported`` (``support.py`` says what and why).

Sliding windows and chunked attention come from the model's own mask: transformers builds each
layer's mask through the mask function registered for "ring" (``ring_mask``), and its
``create_sliding_window_causal_mask`` / ``create_chunked_causal_mask`` pass the window or chunk
they apply as ``local_size`` (read against ``config.sliding_window`` / ``attention_chunk_size``);
``create_causal_mask`` passes none. The ``RingMask`` handed to the layer carries it, and the call
runs ``hf_ring.ops.windows.masked_attention`` with the batch's plan for it (``mask_plan``, once per
batch and mask). A config field the mask ignores is ignored, as SDPA ignores it.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from ..errors import RingMaskUsed, RingNotSupported
from ..ops.attention_call import AttentionCall
from ..ops.layout import sequence_layout
from ..ops.windows import MaskPlan, mask_plan
from ..parallel import attention_backend, context_parallel_state, default_group
from .carry import ACTIVE
from .context import RingContext
from .support import check_layer
from .temperature import global_temperature

# the attribute of an attention module that holds its head groups (``layers.enable_head_groups``: its ledger
# lists and removes it); absent: one group
HEAD_GROUPS = "_hf_ring_head_groups"

_MASK_USED = (
    'attn_implementation="ring": this model uses the attention mask itself, outside transformers\' '
    "attention functions (it computes attention itself, or selects keys with the mask, as a "
    "sparse-attention indexer does), so ring attention cannot run it exactly. Supported: models that "
    "leave attention to the registry (AttentionInterface), such as Llama, Qwen, Mistral and Gemma."
)


class RingMask:
    """What the ring mask function hands the model instead of an ``[N, N]`` mask: "causal over
    global positions, no padding", with the model's sliding ``window`` (keys ``i - W < j <= i``) or
    attention ``chunk`` when its mask applies one (``unknown``: why a local mask of ``local_size``
    tokens could not be read). The attention function accepts nothing else; any other use of it
    (as a tensor, sliced, its ``.dtype``) raises ``RingNotSupported``."""

    def __init__(
        self, window: int | None = None, chunk: int | None = None, local_size: int = 0, unknown: str | None = None
    ) -> None:
        self.window, self.chunk, self.local_size, self.unknown = window, chunk, local_size, unknown

    def __repr__(self) -> str:
        extra = f", window={self.window}" if self.window else f", chunk={self.chunk}" if self.chunk else ""
        return f"RingMask(causal over global positions{extra})"

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        raise RingMaskUsed(_MASK_USED)

    def _unsupported(self, *_: Any) -> Any:
        raise RingMaskUsed(_MASK_USED)

    __add__ = __radd__ = __mul__ = __rmul__ = __and__ = __rand__ = __getitem__ = __bool__ = _unsupported

    def __getattr__(self, name: str) -> Any:  # .to, .size, .dtype, .shape, ...
        if name.startswith("__"):
            raise AttributeError(name)
        raise RingMaskUsed(_MASK_USED)


RING_MASK = RingMask()


def ring_mask(
    *,
    attention_mask: Tensor | None = None,
    local_size: int | None = None,
    config: Any = None,
    use_vmap: bool = False,
    **_: Any,
) -> RingMask:
    """Mask function registered for "ring": never builds an ``O(N^2)`` mask.

    Raises on a padding mask: a 2D mask must reach the model through ``hf_ring.shard_batch``, which
    handles right padding exactly (and passes no mask). ``mask_function`` is ignored on purpose:
    transformers reads zigzag ``position_ids`` as packed documents. ``local_size`` (passed by
    transformers' sliding-window and chunked mask builders) names the window or chunk, told apart
    by the config field it equals; a local mask with the model's own extra mask functions
    (``use_vmap``), or one that equals both fields or neither, is marked unknown (refused by the
    attention function when it is shorter than the sequence), and so is a causal mask with them
    (refused always: the ring does not see what they add).
    """
    if attention_mask is not None and not bool(attention_mask.all()):
        raise RingNotSupported(
            'attn_implementation="ring" got an attention_mask with padding. Pass the full batch '
            "through hf_ring.shard_batch, which handles right padding exactly and drops the mask; "
            "left padding is not supported."
        )
    if local_size is None:
        if use_vmap:  # a causal mask the model adds functions of its own to (a bidirectional prefix, image blocks)
            return _local_mask(None, None, 0, "the model adds mask functions of its own to its causal mask")
        return RING_MASK
    window, chunk = getattr(config, "sliding_window", None), getattr(config, "attention_chunk_size", None)
    if use_vmap:
        return _local_mask(None, None, local_size, "the model adds mask functions of its own to it")
    if local_size == window and local_size != chunk:
        return _local_mask(local_size, None, local_size)
    if local_size == chunk and local_size != window:
        return _local_mask(None, local_size, local_size)
    return _local_mask(
        None, None, local_size, "it is neither config.sliding_window nor config.attention_chunk_size (or both)"
    )


@functools.cache
def _local_mask(window: int | None, chunk: int | None, local_size: int, unknown: str | None = None) -> RingMask:
    return RingMask(window, chunk, local_size, unknown)


_UNSUPPORTED = {
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
    is_causal: bool | None = None,
    ring_context: RingContext | None = None,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """transformers attention function for ``attn_implementation="ring"``.

    ``query: [B, Hq, S_local, Dqk]``, ``key: [B, Hkv, S_local, Dqk]``, ``value: [B, Hkv, S_local, Dv]``,
    this rank's zigzag shard (see ``hf_ring.shard_batch``). Returns ``([B, S_local, Hq, Dv], None)``.
    The CP group is the batch's (``ring_context``, or the one ``carry.ACTIVE`` holds for a decoder layer
    that drops it: ``install.ATTENTION_CALLERS``); without one (a shard made by hand), the default CP group.
    With Ulysses (``setup_context_parallel(..., ulysses_size=U)``) the shard is in the
    hybrid layout and the call runs ``ulysses_ring_attention``, which needs ``U`` to divide ``Hq``
    (``ValueError`` otherwise). Under autocast, q/k/v are cast to the autocast dtype, as SDPA's are. A value head dim
    that differs from the query/key one (multi-head latent attention) is zero-padded, which leaves
    scores and outputs unchanged. ``softcap`` (Gemma 2) caps the scores in every block kernel call;
    attention sinks (``s_aux [Hq]`` of GPT-OSS, MiMo-V2-Flash, Granite SWA; per-token ``sinks
    [B, Hq, S_local, 1]``) join each row's softmax after the ring's merge (``ring_attention``).
    What is decided before computing is ``ring_call``'s.
    """
    d_qk, d_v = query.shape[-1], value.shape[-1]
    call, sinks, ring_context = ring_call(
        module, attention_mask, shape=(query.shape[0], query.shape[1], query.shape[2], max(d_qk, d_v)),
        keys=key.shape[2], scaling=scaling if scaling is not None else d_qk**-0.5, dropout=dropout,
        is_causal=is_causal, ring_context=ring_context, **kwargs,
    )  # fmt: skip
    if ring_context is not None:  # Llama 4's NoPE temperature from global positions
        query = global_temperature(module, query, ring_context)
    device = query.device.type
    if torch.is_autocast_enabled(device):  # as SDPA under autocast: all three in the autocast dtype
        dtype = torch.get_autocast_dtype(device)
        query, key, value = query.to(dtype), key.to(dtype), value.to(dtype)
    if d_v != d_qk:  # zero columns add nothing to a score and give outputs that are cut off below
        d = max(d_qk, d_v)
        query, key, value = (F.pad(t, (0, d - t.shape[-1])) for t in (query, key, value))
    q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)  # (B, S, H, D)
    with torch.autocast(device, enabled=False):
        out = call(q, k, v, sinks)
    return (out[..., :d_v] if d_v != d_qk else out), None


def ring_call(
    module: torch.nn.Module,
    attention_mask: Any,
    *,
    shape: tuple[int, int, int, int],
    keys: int,
    scaling: float,
    dropout: float = 0.0,
    is_causal: bool | None = None,
    ring_context: RingContext | None = None,
    **kwargs: Any,
) -> tuple[AttentionCall, Tensor | None, RingContext | None]:
    """What the attention function decides before it computes, for a call of ``module`` with queries of
    ``shape = (B, Hq, S_local, D)``, ``keys`` keys and the keyword arguments transformers passes: the
    checks (``RingNotSupported`` for what the ring cannot compute exactly), the CP group, Ulysses, the
    batch's document schedule or the layer's window or chunk, soft-cap, kernel and head groups as an
    ``AttentionCall``; the sinks as the op takes them; the batch's context (``ACTIVE``'s when the call
    has none). Counts the call on the context. The tiled layer (``layers.py``) asks it the same."""
    for name, what in _UNSUPPORTED.items():
        if kwargs.get(name) is not None:
            raise RingNotSupported(f'attn_implementation="ring" does not support {what} (got {name}=...).')
    if ring_context is None:  # a decoder layer that calls its attention without the batch's keyword arguments
        ring_context = ACTIVE.get()
    if dropout:
        raise RingNotSupported(
            f'attn_implementation="ring" does not support attention dropout (dropout={dropout} while '
            "training); set config.attention_dropout = 0.0."
        )
    if attention_mask is not None and not isinstance(attention_mask, RingMask):
        raise RingNotSupported(
            f'attn_implementation="ring" got an attention mask it did not prepare ({type(attention_mask).__name__}); '
            "it applies the causal mask over global positions itself. Pass the batch through "
            "hf_ring.shard_batch (right padding is handled there) instead of a custom mask."
        )
    if shape[2] != keys:
        raise RingNotSupported(
            f'attn_implementation="ring" needs as many keys as queries (got {shape[2]} queries, '
            f"{keys} keys): decoding with a KV cache is not supported. Pass use_cache=False "
            "(shard_batch does) and generate with another attn_implementation."
        )
    if ring_context is not None:
        group, size, schedule = ring_context.group, ring_context.size, ring_context.schedule
        ulysses = (ring_context.ulysses_group, ring_context.ring_group) if ring_context.ulysses_size > 1 else None
    else:
        group, schedule = default_group(), None
        size = torch.distributed.get_world_size(group) if torch.distributed.is_initialized() else 1
        _refuse_packed_positions(kwargs.get("position_ids"))
        cp = context_parallel_state() if size > 1 else None
        ulysses = (cp.ulysses_group, cp.ring_group) if cp is not None and cp.ulysses_size > 1 else None
    labelled = ring_context.labelled if ring_context is not None else False
    given = ring_context.positions_given if ring_context is not None else True
    n_global = shape[2] * size
    mask = attention_mask if isinstance(attention_mask, RingMask) else None
    check_layer(module, kwargs, n_global, labelled, size, given, ring_context is not None, mask=mask)
    causal = module.is_causal if is_causal is None else is_causal
    plan = _mask_plan(mask, n_global, causal, ring_context, shape[0], shape[2], size)
    softcap, sinks = kwargs.get("softcap"), _sinks(kwargs, shape[1], shape[2])
    if ring_context is not None:
        ring_context.cross_rank_calls.attention_ran()  # forward calls only: a checkpoint recompute does not count
    call = AttentionCall(
        group=ulysses[1] if ulysses is not None else group, ulysses_group=ulysses[0] if ulysses else None,
        ulysses=ulysses is not None, causal=causal, scale=scaling, schedule=schedule if plan is None else None,
        plan=plan, softcap=softcap, backend=attention_backend(), head_groups=getattr(module, HEAD_GROUPS, 1),
    )  # fmt: skip
    return call, sinks, ring_context


def _mask_plan(
    mask: RingMask | None, n_global: int, causal: bool, ctx: RingContext | None, batch: int, s_local: int, size: int
) -> MaskPlan | None:
    """The batch's plan for the window or chunk of ``mask`` (``None``: plain causal attention, also for
    windows and chunks no shorter than the sequence)."""
    window = mask.window if mask is not None and mask.window and mask.window < n_global else None
    chunk = mask.chunk if mask is not None and mask.chunk and mask.chunk < n_global else None
    if window is None and chunk is None:
        return None
    if not causal:
        raise RingNotSupported(
            'attn_implementation="ring" computes sliding windows and chunks of causal attention only; this layer '
            "is bidirectional."
        )
    if ctx is None:
        if size > 1:  # without the layout the documents and the shard's positions are unknown
            raise RingNotSupported(
                f'attn_implementation="ring": this layer slides over {window or chunk} tokens; at CP > 1 the ring '
                "computes that from the batch's layout. Pass the batch through hf_ring.shard_batch."
            )
        return mask_plan(sequence_layout(s_local, 1), batch, 0, window=window, chunk=chunk)
    ring_pos = ctx.rank // ctx.ulysses_size
    return ctx.cached(
        ("mask", window, chunk, batch),
        lambda: mask_plan(ctx.layout, batch, ring_pos, window=window, chunk=chunk),
    )


def _sinks(kwargs: dict[str, Any], heads: int, rows: int) -> Tensor | None:
    """The attention sinks a model passes, as ``ring_attention`` takes them: ``s_aux``/``sinks [Hq]``
    (one logit per head) as given; per-token ``sinks [B, Hq, S, 1]`` (Inkling 2) as ``[B, S, Hq]``."""
    sinks = kwargs.get("s_aux")
    if sinks is None:
        sinks = kwargs.get("sinks")
    if sinks is None:
        return None
    if isinstance(sinks, Tensor) and sinks.shape == (heads,):
        return sinks
    if isinstance(sinks, Tensor) and sinks.dim() == 4 and sinks.shape[1:] == (heads, rows, 1):
        return sinks.squeeze(-1).transpose(1, 2)
    raise RingNotSupported(
        f'attn_implementation="ring" takes attention sinks of one logit per head [{heads}] or per token '
        f"[B, {heads}, {rows}, 1]; got {getattr(sinks, 'shape', type(sinks).__name__)}."
    )


def _refuse_packed_positions(position_ids: Tensor | None) -> None:
    """Without a ``RingContext`` the document boundaries are unknown: refuse positions that go back
    (packed documents) rather than attend across documents. Zigzag shards only jump forward."""
    if position_ids is not None and position_ids.shape[-1] > 1 and bool((position_ids.diff(dim=-1) <= 0).any()):
        raise RingNotSupported(
            'attn_implementation="ring" got position_ids that restart (packed documents) without the '
            "document boundaries. Pass the full batch through hf_ring.shard_batch, which computes them "
            "once per batch; it accepts position_ids that restart at 0 per document, or cu_seq_lens."
        )
