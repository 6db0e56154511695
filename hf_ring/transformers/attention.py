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
import inspect
import sys
import weakref
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from ..errors import RingMaskUsed, RingNotSupported
from ..ops.attention_call import AttentionCall
from ..ops.windows import MaskPlan, mask_plan
from ..parallel import attention_backend
from . import decode
from .carry import ACTIVE
from .context import RingContext
from .support import check_layer
from .temperature import global_temperature

# attention module -> the number of groups its heads run in inside the ring (``layers.enable_head_groups`` and
# ``disable_head_groups``); absent: one group. hf_ring's own record, never an attribute of the module.
HEAD_GROUPS: weakref.WeakKeyDictionary[torch.nn.Module, int] = weakref.WeakKeyDictionary()


def head_groups(module: torch.nn.Module) -> int:
    """The head groups ``module``'s attention runs in inside the ring (``enable_head_groups``; 1: all at once)."""
    return HEAD_GROUPS.get(module, 1)


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
    tokens could not be read). It also keeps the arguments transformers gave the mask function
    (``mask_arguments``), from which ``dense`` builds the mask SDPA or eager attention would get: the
    one-process path of a call without the batch's ``ring_context``. The attention function accepts
    nothing else; any other use of it (as a tensor, sliced, its ``.dtype``) raises ``RingNotSupported``."""

    def __init__(
        self,
        window: int | None = None,
        chunk: int | None = None,
        local_size: int = 0,
        unknown: str | None = None,
        mask_arguments: dict[str, Any] | None = None,
    ) -> None:
        self.window, self.chunk, self.local_size, self.unknown = window, chunk, local_size, unknown
        self.mask_arguments = mask_arguments or {}
        self.built: dict[str, Tensor | None] = {}  # "sdpa" / "eager" -> the dense mask, built once per forward
        self.padding: bool | None = None  # the 2D attention_mask given has padding (read once, under a context)

    def __repr__(self) -> str:
        extra = f", window={self.window}" if self.window else f", chunk={self.chunk}" if self.chunk else ""
        return f"RingMask(causal over global positions{extra})"

    def dense(self, kind: str) -> Tensor | None:
        """The mask transformers' ``kind`` ("sdpa" or "eager") mask function makes from the same
        arguments (``None``: SDPA's plain causal case, or no mask)."""
        if kind not in self.built:
            from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

            self.built[kind] = ALL_MASK_ATTENTION_FUNCTIONS[kind](**self.mask_arguments)
        return self.built[kind]

    def has_padding(self) -> bool:
        """The 2D ``attention_mask`` the model gave its mask function masks a token (one host read per
        forward and mask)."""
        if self.padding is None:
            given = self.mask_arguments.get("attention_mask")
            self.padding = given is not None and not bool(given.all())
        return self.padding

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
    **kwargs: Any,
) -> RingMask:
    """Mask function registered for "ring": never builds an ``O(N^2)`` mask itself.

    Returns a ``RingMask`` that names what the mask applies and keeps the arguments it was given, so
    that a call without the batch's ``ring_context`` computes what one process computes (``RingMask.dense``:
    the mask SDPA would get, padding, packed ``position_ids`` and the model's own mask functions included).
    Under a ``ring_context`` the ring computes the mask from the batch's layout: ``mask_function`` is
    ignored on purpose there (transformers reads zigzag ``position_ids`` as packed documents), and a padding
    mask is refused by the attention function (``shard_batch`` handles right padding and passes no mask).
    ``local_size`` (passed by transformers' sliding-window and chunked mask builders) names the window or
    chunk, told apart by the config field it equals; a local mask with the model's own extra mask functions
    (``use_vmap``), or one that equals both fields or neither, is marked unknown (refused under a
    ``ring_context`` when it is shorter than the sequence), and so is a causal mask with them (refused
    always under a ``ring_context``: the ring does not see what they add).
    """
    given = {**kwargs, "attention_mask": attention_mask, "local_size": local_size, "config": config,
             "use_vmap": use_vmap}  # fmt: skip
    if local_size is None:
        if use_vmap:  # a causal mask the model adds functions of its own to (a bidirectional prefix, image blocks)
            return RingMask(None, None, 0, "the model adds mask functions of its own to its causal mask", given)
        return RingMask(mask_arguments=given)
    window, chunk = getattr(config, "sliding_window", None), getattr(config, "attention_chunk_size", None)
    if use_vmap:
        return RingMask(None, None, local_size, "the model adds mask functions of its own to it", given)
    if local_size == window and local_size != chunk:
        return RingMask(local_size, None, local_size, mask_arguments=given)
    if local_size == chunk and local_size != window:
        return RingMask(None, local_size, local_size, mask_arguments=given)
    return RingMask(
        None, None, local_size, "it is neither config.sliding_window nor config.attention_chunk_size (or both)", given
    )


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
    The CP group and the shard's layout are the batch's (``ring_context``, or the one ``carry.ACTIVE`` holds
    for a decoder layer that drops it: ``install.ATTENTION_CALLERS``). Without one -- a model called without
    ``shard_batch``, as TRL's evaluation or a user's own forward does -- every rank holds the whole batch,
    and the call computes what one process computes on it: transformers' SDPA attention with the mask SDPA
    would get (padding, packed ``position_ids`` and the model's own mask functions included), or the model's
    eager attention where it soft-caps scores or has attention sinks (``one_process_attention``).
    With Ulysses (``setup_context_parallel(..., ulysses_size=U)``) the shard is in the
    hybrid layout and the call runs ``ulysses_ring_attention``, which needs ``U`` to divide ``Hq``
    (``ValueError`` otherwise). Under autocast, q/k/v are cast to the autocast dtype, as SDPA's are. A value head dim
    that differs from the query/key one (multi-head latent attention) is zero-padded, which leaves
    scores and outputs unchanged. ``softcap`` (Gemma 2) caps the scores in every block kernel call;
    attention sinks (``s_aux [Hq]`` of GPT-OSS, MiMo-V2-Flash, Granite SWA; per-token ``sinks
    [B, Hq, S_local, 1]``) join each row's softmax after the ring's merge (``ring_attention``).
    What is decided before computing is ``ring_call``'s.
    """
    if ring_context is None:  # a decoder layer that calls its attention without the batch's keyword arguments
        ring_context = ACTIVE.get()
    if ring_context is None:
        return one_process_attention(
            module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, is_causal=is_causal, **kwargs
        )
    if ring_context.decode is not None and ring_context.decode.decoding:  # new tokens of CP decoding (decode.py)
        return decode.attention(module, query, key, value, attention_mask, ring_context, scaling=scaling,
                                dropout=dropout, is_causal=is_causal, **kwargs)  # fmt: skip
    d_qk, d_v = query.shape[-1], value.shape[-1]
    call, sinks = ring_call(
        module, attention_mask, ring_context, shape=(query.shape[0], query.shape[1], query.shape[2], max(d_qk, d_v)),
        keys=key.shape[2], scaling=scaling if scaling is not None else d_qk**-0.5, dropout=dropout,
        is_causal=is_causal, **kwargs,
    )  # fmt: skip
    if ring_context.decode is not None:  # a prefill for decoding keeps this rank's keys and values (decode.py)
        decode.keep_kv(ring_context, key, value)
    query = global_temperature(module, query, ring_context)  # Llama 4's NoPE temperature from global positions
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
    ring_context: RingContext,
    *,
    shape: tuple[int, int, int, int],
    keys: int,
    scaling: float,
    dropout: float = 0.0,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[AttentionCall, Tensor | None]:
    """What the attention function decides before it computes, for a call of ``module`` on the batch of
    ``ring_context`` with queries of ``shape = (B, Hq, S_local, D)``, ``keys`` keys and the keyword arguments
    transformers passes: the checks (``RingNotSupported`` for what the ring cannot compute exactly), the CP
    group, Ulysses, the batch's document schedule or the layer's window or chunk, soft-cap, kernel and head
    groups (``head_groups``) as an ``AttentionCall``; and the sinks as the op takes them. Counts the call on
    the context. The tiled layer (``layers.py``) asks it the same; a call without a ``ring_context`` is
    ``one_process_attention``'s, and a call of CP decoding ``decode.attention``'s, before this."""
    for name, what in _UNSUPPORTED.items():
        if kwargs.get(name) is not None:
            raise RingNotSupported(f'attn_implementation="ring" does not support {what} (got {name}=...).')
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
    if isinstance(attention_mask, RingMask) and attention_mask.has_padding():
        raise RingNotSupported(
            'attn_implementation="ring" got an attention_mask with padding next to the batch\'s ring_context. '
            "Pass the padded batch, attention_mask included, to hf_ring.shard_batch, which handles right "
            "padding exactly, and give the model only what it returns; left padding is not supported."
        )
    if shape[2] != keys:
        raise RingNotSupported(
            f'attn_implementation="ring" needs as many keys as queries (got {shape[2]} queries, '
            f"{keys} keys): decoding with a KV cache is not supported on a batch from shard_batch. "
            "Pass use_cache=False (shard_batch does); generate without shard_batch (every rank then runs the "
            "whole sequence, as one process)."
        )
    group, size, schedule = ring_context.group, ring_context.size, ring_context.schedule
    ulysses = (ring_context.ulysses_group, ring_context.ring_group) if ring_context.ulysses_size > 1 else None
    n_global = shape[2] * size
    mask = attention_mask if isinstance(attention_mask, RingMask) else None
    check_layer(module, kwargs, n_global, ring_context.labelled, size, ring_context.positions_given, mask=mask)
    causal = module.is_causal if is_causal is None else is_causal
    plan = _mask_plan(mask, n_global, causal, ring_context, shape[0])
    softcap, sinks = kwargs.get("softcap"), _sinks(kwargs, shape[1], shape[2])
    ring_context.cross_rank_calls.attention_ran()  # forward calls only: a checkpoint recompute does not count
    call = AttentionCall(
        group=ulysses[1] if ulysses is not None else group, ulysses_group=ulysses[0] if ulysses else None,
        ulysses=ulysses is not None, causal=causal, scale=scaling, schedule=schedule if plan is None else None,
        plan=plan, softcap=softcap, backend=attention_backend(), head_groups=head_groups(module),
    )  # fmt: skip
    return call, sinks


def _mask_plan(mask: RingMask | None, n_global: int, causal: bool, ctx: RingContext, batch: int) -> MaskPlan | None:
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


# what a layer passes that SDPA does not compute -> the keyword arguments that carry it
_SDPA_LACKS = {"softcap": ("softcap",), "sink": ("s_aux", "sinks")}


@functools.cache
def _reads(function: Any, what: str) -> bool:
    """``function``'s source mentions ``what`` (an eager attention that applies a soft-cap or sinks does)."""
    try:
        return what in inspect.getsource(function)
    except (OSError, TypeError):
        return False


def one_process_attention(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Any,
    **kwargs: Any,
) -> tuple[Tensor, Any]:
    """A "ring" attention call without the batch's ``ring_context``: what one process computes on the
    batch it was given (``query [B, Hq, S, D]``, ``key``/``value [B, Hkv, S_kv, D]`` -> ``[B, S, Hq, D]``).

    Every rank holds the whole batch then, so this is transformers' own attention on it: SDPA with the
    mask SDPA would get (``RingMask.dense``: padding, packed ``position_ids``, windows, chunks, the
    model's own mask functions), or, where the layer soft-caps its scores or has attention sinks, which
    SDPA does not compute, the eager attention of the layer's modeling module with the eager mask. No
    shard semantics are guessed from a shape: sharded batches carry their ``ring_context``."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    special = [w for w, names in _SDPA_LACKS.items() if any(kwargs.get(k) is not None for k in names)]
    kind = "eager" if special else "sdpa"
    mask = attention_mask.dense(kind) if isinstance(attention_mask, RingMask) else attention_mask
    if isinstance(mask, Tensor) and mask.shape[-1] != key.shape[-2]:  # keys the layer adds itself (compressed)
        raise RingNotSupported(
            f'attn_implementation="ring": {type(module).__name__} attends {key.shape[-2]} keys where its mask covers '
            f"{mask.shape[-1]} (keys the layer makes itself, such as compressed ones), which neither the ring nor "
            'its one-process path computes. Load the model with attn_implementation="sdpa" or "eager".'
        )
    if not special:
        return ALL_ATTENTION_FUNCTIONS["sdpa"](module, query, key, value, mask, **kwargs)
    eager = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if eager is None or not all(_reads(eager, what) for what in special):
        raise RingNotSupported(
            f'attn_implementation="ring": {type(module).__name__} passes {" and ".join(special)}, which SDPA does '
            "not compute, and its modeling module has no eager attention that does, to compute this call (made "
            "without hf_ring.shard_batch) as one process would. Pass the batch through hf_ring.shard_batch, or "
            'load the model with attn_implementation="eager" for this use.'
        )
    kwargs.pop("is_causal", None)  # eager attention takes causality from its mask
    return eager(module, query, key, value, mask, **kwargs)
