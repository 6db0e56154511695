"""Process groups for data parallelism (DP) x context parallelism (CP).

A world of ``dp * cp`` processes is cut into CP groups of consecutive ranks; the ranks that hold
the same piece of the sequence in different CP groups form a DP group::

    world 8, cp_size 4:   CP groups [0 1 2 3] [4 5 6 7]     DP groups [0 4] [1 5] [2 6] [3 7]

Consecutive ranks keep a CP group inside one node, where the ring traffic is.

This is the one place that holds a process-wide default: the CP group of the last
``setup_context_parallel``. The public ``ring_attention``, ``shard`` and ``unshard`` resolve
``group=None`` to it and call the ops in ``hf_ring.ops``, which always take their group as an
argument. This module imports only torch.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from .ops import ring as _ring
from .ops import zigzag as _zigzag

__all__ = ["ContextParallel", "setup_context_parallel", "default_group", "ring_attention", "shard", "unshard"]

_DEFAULT: ContextParallel | None = None


@dataclass(frozen=True)
class ContextParallel:
    """This rank's place in the DP x CP grid (``cp_group``/``dp_group`` are process groups)."""

    cp_group: dist.ProcessGroup
    cp_rank: int
    cp_size: int
    dp_group: dist.ProcessGroup
    dp_rank: int
    dp_size: int


def setup_context_parallel(cp_size: int, *, backend: str | None = None) -> ContextParallel:
    """Build the CP and DP groups and make this rank's CP group the default ``group=None``.

    Initialises torch.distributed from the launcher's environment (``accelerate launch``,
    ``torchrun``: ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ...) when that has not happened yet,
    with NCCL when CUDA is available and gloo otherwise (or ``backend``). Every rank must call it,
    with the same ``cp_size``.
    """
    global _DEFAULT
    if not dist.is_initialized():
        if "RANK" not in os.environ and "WORLD_SIZE" not in os.environ:
            raise RuntimeError(
                "setup_context_parallel: torch.distributed is not initialised and no launcher "
                "environment (RANK, WORLD_SIZE) was found; start the script with `accelerate launch` "
                "or `torchrun`, or call torch.distributed.init_process_group first."
            )
        if backend is None:
            backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend)
    world, rank = dist.get_world_size(), dist.get_rank()
    if cp_size < 1 or world % cp_size:
        raise ValueError(
            f"setup_context_parallel: world size {world} is not divisible by cp_size={cp_size}; "
            f"launch a multiple of {cp_size} processes or pick a cp_size that divides {world}."
        )
    dp_size = world // cp_size
    cp_group = dp_group = None
    # new_group must be called by every rank for every group, in the same order.
    for i in range(dp_size):
        g = dist.new_group(list(range(i * cp_size, (i + 1) * cp_size)))
        if rank // cp_size == i:
            cp_group = g
    for j in range(cp_size):
        g = dist.new_group(list(range(j, world, cp_size)))
        if rank % cp_size == j:
            dp_group = g
    assert cp_group is not None and dp_group is not None
    _DEFAULT = ContextParallel(cp_group, rank % cp_size, cp_size, dp_group, rank // cp_size, dp_size)
    return _DEFAULT


def default_group() -> dist.ProcessGroup | None:
    """The CP group for ``group=None``: the one from ``setup_context_parallel``, else the world
    group (``None`` also when torch.distributed is not initialised)."""
    if _DEFAULT is not None and dist.is_initialized():
        return _DEFAULT.cp_group
    return None


def context_parallel_state() -> ContextParallel | None:
    """What ``setup_context_parallel`` returned last in this process, or ``None``."""
    return _DEFAULT


def reset_context_parallel() -> None:
    """Forget the default CP group (tests; after ``destroy_process_group``)."""
    global _DEFAULT
    _DEFAULT = None


def ring_attention(
    q: Tensor, k: Tensor, v: Tensor, *, group: dist.ProcessGroup | None = None, **options: Any
) -> Tensor:
    """Exact attention over a sequence sharded across the CP group: ``hf_ring.ops.ring.ring_attention``
    with ``group=None`` meaning the CP group of ``setup_context_parallel`` (else the world group).

    ``q: [B, S_local, Hq, D]``, ``k, v: [B, S_local, Hkv, D]`` (this rank's zigzag shard) ->
    ``[B, S_local, Hq, D]``. Options: ``causal``, ``softmax_scale``, ``backend``, ``layout``,
    ``validate``, ``ring``; see the op's docstring.
    """
    if group is None and options.get("ring") is None:
        group = default_group()
    return _ring.ring_attention(q, k, v, group=group, **options)


def shard(x: Tensor, *, dim: int = 1, group: dist.ProcessGroup | None = None) -> Tensor:
    """This rank's zigzag shard of the full tensor ``x`` along ``dim`` (``x.shape[dim] / P`` rows):
    ``hf_ring.ops.zigzag.shard`` with ``group=None`` meaning the CP group of
    ``setup_context_parallel``. Raises on every rank when the ranks pass different shapes."""
    return _zigzag.shard(x, dim=dim, group=default_group() if group is None else group)


def unshard(x: Tensor, *, dim: int = 1, group: dist.ProcessGroup | None = None) -> Tensor:
    """Gather the zigzag shards of the CP group and restore global order along ``dim`` (inverse of
    ``shard``; not differentiable): ``hf_ring.ops.zigzag.unshard`` with the default CP group. A packed
    batch from ``shard_batch`` is laid out per document: gather it with ``ring_context.unshard``."""
    return _zigzag.unshard(x, dim=dim, group=default_group() if group is None else group)
