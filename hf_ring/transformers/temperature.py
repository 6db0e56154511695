"""Llama 4's attention temperature tuning from global positions.

Llama 4's NoPE layers (``use_rope`` falsy, from ``config.no_rope_layers``) with
``attn_temperature_tuning`` scale their queries by ``1 + attn_scale * log1p(floor((t + 1) /
floor_scale))``, where transformers takes ``t`` as ``0, 1, 2, ...`` over the rows it is given --
on a CP rank, the rows of its zigzag shard. ``global_temperature`` rescales those queries, inside
the attention function, to the temperature of each row's position in the whole sequence (its
position within its document for packed documents, as each document alone would see it)::

    q_global = q_local * tau(global position) / tau(local row)

``tau`` is computed in float32, as transformers computes it, the factor in float64 (applied in
float32 to queries of lower precision); the product stays in the query's dtype. Nothing is
rebound: the attention function calls this before the ring.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from ..errors import RingNotSupported
from .context import RingContext

__all__ = ["global_temperature", "nope_temperature"]


def nope_temperature(module: nn.Module) -> tuple[float, float] | None:
    """``(floor_scale, attn_scale)`` of an attention layer that scales its queries by a temperature of
    their positions (a Llama 4 NoPE layer with ``attn_temperature_tuning``), else ``None``."""
    config = getattr(module, "config", None)
    tuning = getattr(module, "attn_temperature_tuning", getattr(config, "attn_temperature_tuning", False))
    if not tuning or getattr(module, "use_rope", True):  # transformers: ``not self.use_rope`` (an int)
        return None
    floor = getattr(module, "floor_scale", getattr(config, "floor_scale", None))
    scale = getattr(module, "attn_scale", getattr(config, "attn_scale", None))
    if not isinstance(floor, (int, float)) or not isinstance(scale, (int, float)):
        return None
    return float(floor), float(scale)


def _tau(positions: Tensor, floor: float, scale: float) -> Tensor:
    """Transformers' query temperature of ``positions`` (float32)."""
    return torch.log1p(torch.floor((positions.float() + 1.0) / floor)) * scale + 1.0


def _positions(ctx: RingContext, batch: int) -> Tensor:
    """``[batch, S_local]`` int64: each local row's position in its document (0 for padding rows)."""
    out = torch.zeros(batch, ctx.layout.local, dtype=torch.long)
    for b in range(batch):
        for run in ctx.layout.runs(ctx.rank, b):
            first = run.start - run.doc_start
            out[b, run.local : run.local + run.length] = torch.arange(first, first + run.length)
    return out


def global_temperature(module: nn.Module, query: Tensor, ctx: RingContext) -> Tensor:
    """``query [B, H, S_local, D]`` with transformers' local temperature replaced by the global one;
    ``query`` itself when ``module`` has no temperature tuning or local rows are global positions."""
    params = nope_temperature(module)
    if params is None or (ctx.size == 1 and not ctx.layout.packed):
        return query
    floor, scale = params
    b, s = query.shape[0], query.shape[2]
    if math.isclose(scale, 0.0):
        return query  # a temperature of 1 everywhere
    if s != ctx.layout.local:
        raise RingNotSupported(
            f"Llama 4 temperature tuning: got {s} query rows under a ring_context whose shard holds "
            f"{ctx.layout.local}; the rows must be the whole local shard (no cache, no decoding)."
        )

    def factor() -> Tensor:
        local = _tau(torch.arange(s), floor, scale)
        return _tau(_positions(ctx, b), floor, scale).double() / local.double()

    ratio = ctx.cached(("temperature", b, floor, scale), factor)  # (B, S) float64
    ratio = ratio.to(query.device, torch.float64 if query.dtype == torch.float64 else torch.float32)
    return (query * ratio[:, None, :, None]).to(query.dtype)
