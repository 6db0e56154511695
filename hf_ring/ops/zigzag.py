"""Zigzag sharding of a full tensor along its sequence axis, and its inverse.

With ``P`` ranks the sequence is cut into ``2P`` equal chunks and rank ``r`` keeps chunks ``r`` and
``2P-1-r``, in that order::

    P = 2:  [c0 c1 c2 c3]  ->  rank 0: [c0 c3]   rank 1: [c1 c2]

This module imports only torch.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from .comm import check_same_across_ranks, group_size_rank

__all__ = ["shard", "unshard"]


def shard(x: Tensor, *, dim: int = 1, group: dist.ProcessGroup | None = None) -> Tensor:
    """This rank's zigzag shard of the full tensor ``x`` along ``dim``.

    ``x`` must be the same full tensor on every rank of ``group`` (``None``: the world group), with
    ``x.shape[dim]`` a multiple of ``2P``. Returns a tensor with ``x.shape[dim] / P`` rows along
    ``dim``. Checks once per call, with one all-gather of 16 integers, that every rank passes the
    same shape, and raises ``ValueError`` otherwise (instead of a later deadlock in the ring).
    """
    size, rank = group_size_rank(group)
    dim = dim % x.dim()
    check_same_across_ranks([dim, *x.shape], group, "the shape of the tensor to shard [dim, *shape]")
    if size == 1:
        return x
    n = x.shape[dim]
    if n % (2 * size):
        raise ValueError(
            f"shard: length {n} along dim {dim} is not a multiple of 2 * P = {2 * size}; pad it to "
            f"a multiple of {2 * size} first (hf_ring.shard_batch pads batches and masks the padding)."
        )
    return zigzag(x, dim, size, rank)


def zigzag(x: Tensor, dim: int, size: int, rank: int) -> Tensor:
    """Chunks ``rank`` and ``2 * size - 1 - rank`` of ``2 * size`` along ``dim`` (no checks)."""
    chunks = x.chunk(2 * size, dim=dim)
    return torch.cat((chunks[rank], chunks[2 * size - 1 - rank]), dim=dim)


def unshard(x: Tensor, *, dim: int = 1, group: dist.ProcessGroup | None = None) -> Tensor:
    """Gather the zigzag shards of ``group`` and restore global order along ``dim``.

    Inverse of ``shard``: ``unshard(shard(x)) == x`` on every rank. The result is not
    differentiable (the gather is a plain collective); use it for logits, outputs and checks.
    """
    size, _ = group_size_rank(group)
    if size == 1:
        return x
    dim = dim % x.dim()
    x = x.detach().contiguous()
    parts = [torch.empty_like(x) for _ in range(size)]
    dist.all_gather(parts, x, group=group)
    chunks: list[Tensor] = [x] * (2 * size)
    for r, part in enumerate(parts):
        first, second = part.chunk(2, dim=dim)
        chunks[r], chunks[2 * size - 1 - r] = first, second
    return torch.cat(chunks, dim=dim)
