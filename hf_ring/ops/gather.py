"""Rows computed on different ranks, gathered in rank order, differentiable: the encoder's share.

``gather_rows(x, counts, group)``: rank ``r`` holds ``x [counts[r], F]``; every rank gets the
``[sum(counts), F]`` concatenation in rank order. Backward sums the incoming gradient over the group
(each rank's gradient is its own share of the loss's) and hands every rank its rows' slice, so the
producer of a row back-propagates the whole group's gradient of it. Torch only.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["gather_rows"]


class _GatherRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, counts: tuple[int, ...], rank: int, group: dist.ProcessGroup | None) -> Tensor:  # type: ignore[override]
        ctx.counts, ctx.rank, ctx.group = counts, rank, group
        top = max(counts)
        padded = torch.cat((x, x.new_zeros((top - x.shape[0], *x.shape[1:])))) if x.shape[0] < top else x
        parts = [torch.empty_like(padded) for _ in counts]
        dist.all_gather(parts, padded.contiguous(), group=group)
        return torch.cat([p[:c] for p, c in zip(parts, counts)])

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None, None]:  # type: ignore[override]
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        start = sum(ctx.counts[: ctx.rank])
        return grad[start : start + ctx.counts[ctx.rank]], None, None, None


def gather_rows(x: Tensor, counts: list[int], group: dist.ProcessGroup | None) -> Tensor:
    """``x [counts[rank], F]`` on each rank of ``group`` -> ``[sum(counts), F]`` on every rank, in rank
    order; gradients of the result summed over the group flow back to each rank's ``x``."""
    rank = dist.get_rank(group)
    if x.shape[0] != counts[rank]:
        raise ValueError(f"gather_rows: rank {rank} holds {x.shape[0]} rows, counts say {counts[rank]}")
    return _GatherRows.apply(x, tuple(counts), rank, group)
