"""What the attention ops accept: the argument checks shared by ``ring_attention``,
``block_attention``, ``masked_attention`` and ``ulysses_attention``.

Each raises ``ValueError`` with a message that names the op, the arguments and the fix, on this
rank's own view (agreement across ranks is ``comm.check_same_across_ranks``). This module imports
only torch.
"""

from __future__ import annotations

import math

from torch import Tensor

__all__ = ["check_extras", "check_qkv"]


def check_qkv(q: Tensor, k: Tensor, v: Tensor, who: str, *, same_length: bool = True) -> None:
    """``q [B, S, Hq, D]``, ``k, v [B, S, Hkv, D]`` with ``Hq % Hkv == 0``, one dtype and one device
    (``same_length=False``: ``k, v`` may have another number of rows than ``q``)."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(
            f"{who} expects q [B, S, Hq, D] and k, v [B, S, Hkv, D]; got q {tuple(q.shape)}, "
            f"k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if k.shape != v.shape:
        raise ValueError(f"{who}: k {tuple(k.shape)} and v {tuple(v.shape)} must have the same shape")
    if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3] or (same_length and q.shape[1] != k.shape[1]):
        rows = "local sequence length " if same_length else ""
        raise ValueError(
            f"{who}: q {tuple(q.shape)} and k/v {tuple(k.shape)} must agree on batch, {rows}and head_dim"
        )
    if q.shape[2] % k.shape[2]:
        raise ValueError(
            f"{who}: query heads ({q.shape[2]}) must be a multiple of key/value heads ({k.shape[2]}) for "
            "grouped-query attention"
        )
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"{who}: q, k, v dtypes differ ({q.dtype}, {k.dtype}, {v.dtype}); cast them to one dtype")
    if not (q.device == k.device == v.device):
        raise ValueError(f"{who}: q, k, v are on different devices ({q.device}, {k.device}, {v.device})")


def check_extras(q: Tensor, softcap: float | None, sinks: Tensor | None, who: str = "ring_attention") -> float:
    """Logit soft-capping (a positive number, or ``None``) and attention sinks (``[Hq]`` or
    ``[B, S, Hq]`` floats on ``q``'s device); returns the cap as a float (``0.0``: none)."""
    cap = 0.0 if softcap is None else float(softcap)
    if not (math.isfinite(cap) and cap >= 0.0):
        raise ValueError(f"{who}: softcap={softcap} must be a positive number (or None: no capping)")
    if sinks is not None and (sinks.shape not in ((q.shape[2],), q.shape[:3]) or not sinks.is_floating_point()):
        raise ValueError(
            f"{who}: sinks must be a float tensor [Hq] = [{q.shape[2]}] (one logit per query head) or "
            f"[B, S_local, Hq] = {list(q.shape[:3])} (one per row), got {sinks.dtype} {tuple(sinks.shape)}"
        )
    if sinks is not None and sinks.device != q.device:
        raise ValueError(f"{who}: sinks on {sinks.device}, q on {q.device}")
    return cap
