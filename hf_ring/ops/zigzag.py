"""Zigzag sharding of a full tensor along its sequence axis, and its inverse.

With ``P`` ranks the sequence is cut into ``2P`` equal chunks and rank ``r`` keeps chunks ``r`` and
``2P-1-r``, in that order::

    P = 2:  [c0 c1 c2 c3]  ->  rank 0: [c0 c3]   rank 1: [c1 c2]

With Ulysses (``ulysses_size = U > 1``, ``P = R * U``, rank ``= r * U + u``) the zigzag runs over
the ``R`` ring positions and each ring position's shard is cut into ``U`` contiguous pieces
(``hybrid``)::

    P = 4 = R 2 x U 2:  ring position 0 holds [c0 c3]: rank 0 its first half, rank 1 its second
                        ring position 1 holds [c1 c2]: rank 2 its first half, rank 3 its second

This module imports only torch.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import Tensor

from .comm import check_same_across_ranks, group_size_rank

__all__ = ["shard", "unshard", "hybrid", "hybrid_multiple"]


def shard(x: Tensor, *, dim: int = 1, group: dist.ProcessGroup | None = None, ulysses_size: int = 1) -> Tensor:
    """This rank's zigzag shard of the full tensor ``x`` along ``dim``.

    ``x`` must be the same full tensor on every rank of ``group`` (``None``: the world group), with
    ``x.shape[dim]`` a multiple of ``2P`` (of ``hybrid_multiple(P, U)`` with ``ulysses_size=U``: the
    ``hybrid`` layout). Returns a tensor with ``x.shape[dim] / P`` rows along ``dim``. Checks once
    per call, with one all-gather of 16 integers, that every rank passes the same shape, and raises
    ``ValueError`` otherwise (instead of a later deadlock in the ring).
    """
    size, rank = group_size_rank(group)
    dim = dim % x.dim()
    check_same_across_ranks([dim, *x.shape], group, "the shape of the tensor to shard [dim, *shape]")
    _check_ulysses_size(size, ulysses_size)
    if size == 1:
        return x
    n, m = x.shape[dim], hybrid_multiple(size, ulysses_size)
    if n % m:
        what = f"2 * P = {m}" if ulysses_size == 1 else f"R * lcm(2, U) = {m} (P = {size}, U = {ulysses_size})"
        raise ValueError(
            f"shard: length {n} along dim {dim} is not a multiple of {what}; pad it to "
            f"a multiple of {m} first (hf_ring.shard_batch pads batches and masks the padding)."
        )
    return hybrid(x, dim, size, rank, ulysses_size)


def _check_ulysses_size(size: int, ulysses_size: int) -> None:
    if ulysses_size < 1 or size % ulysses_size:
        raise ValueError(
            f"ulysses_size={ulysses_size} does not divide the context-parallel size {size}; pick a divisor "
            f"of {size} (ulysses_size=1 is plain ring attention)"
        )


def zigzag(x: Tensor, dim: int, size: int, rank: int) -> Tensor:
    """Chunks ``rank`` and ``2 * size - 1 - rank`` of ``2 * size`` along ``dim`` (no checks)."""
    chunks = x.chunk(2 * size, dim=dim)
    return torch.cat((chunks[rank], chunks[2 * size - 1 - rank]), dim=dim)


def hybrid_multiple(size: int, ulysses_size: int = 1) -> int:
    """The sequence lengths the hybrid layout of ``size`` ranks takes are multiples of this:
    ``R * lcm(2, U)`` (``R = size / U``): the zigzag over ``R`` ring positions needs ``2R`` equal
    chunks, and each ring position's ``N / R`` rows are cut into ``U`` pieces. ``2P`` for ``U = 1``."""
    ring = size // ulysses_size
    return ring * math.lcm(2, ulysses_size)


def hybrid(x: Tensor, dim: int, size: int, rank: int, ulysses_size: int = 1) -> Tensor:
    """This rank's piece of the full tensor ``x`` along ``dim`` in the Ulysses x ring layout (no checks).

    Rank ``rank = r * U + u`` of ``size = R * U`` holds piece ``u`` of ``U`` contiguous pieces of
    ring position ``r``'s zigzag shard (chunks ``r`` and ``2R-1-r`` of ``2R``). ``U = 1`` is the
    plain zigzag over ``size`` ranks; ``U = size`` cuts the sequence (in its own order) into ``size``
    contiguous pieces.
    """
    ring_pos, u = divmod(rank, ulysses_size)
    shard = zigzag(x, dim, size // ulysses_size, ring_pos)
    return shard if ulysses_size == 1 else shard.chunk(ulysses_size, dim=dim)[u]


def unshard(x: Tensor, *, dim: int = 1, group: dist.ProcessGroup | None = None, ulysses_size: int = 1) -> Tensor:
    """Gather the zigzag shards of ``group`` and restore global order along ``dim``.

    Inverse of ``shard`` (with the same ``ulysses_size``): ``unshard(shard(x)) == x`` on every rank.
    The result is not differentiable (the gather is a plain collective); use it for logits, outputs
    and checks.
    """
    size, _ = group_size_rank(group)
    _check_ulysses_size(size, ulysses_size)
    if size == 1:
        return x
    dim = dim % x.dim()
    x = x.detach().contiguous()
    parts = [torch.empty_like(x) for _ in range(size)]
    dist.all_gather(parts, x, group=group)
    ring = size // ulysses_size
    # ring position r's zigzag shard is the U pieces of ranks r * U ... r * U + U - 1, end to end
    shards = [torch.cat(parts[r * ulysses_size : (r + 1) * ulysses_size], dim=dim) for r in range(ring)]
    chunks: list[Tensor] = [x] * (2 * ring)
    for r, part in enumerate(shards):
        first, second = part.chunk(2, dim=dim)
        chunks[r], chunks[2 * ring - 1 - r] = first, second
    return torch.cat(chunks, dim=dim)
