"""Process groups for data parallelism (DP) x context parallelism (CP).

A world of ``dp * cp`` processes is cut into CP groups of consecutive ranks; the ranks that hold
the same piece of the sequence in different CP groups form a DP group::

    world 8, cp_size 4:   CP groups [0 1 2 3] [4 5 6 7]     DP groups [0 4] [1 5] [2 6] [3 7]

Consecutive ranks keep a CP group inside one node, where the ring traffic is.

With ``ulysses_size = U > 1`` each CP group of ``P`` ranks is a grid of ``U`` (consecutive ranks:
the all-to-all traffic, kept closest) x ``R = P / U`` (the ring); CP rank ``= ring_pos * U + u``::

    cp_size 4, ulysses_size 2:   Ulysses groups [0 1] [2 3]     ring groups [0 2] [1 3]

``U = 1`` is plain ring attention, ``U = P`` pure DeepSpeed-Ulysses.

This is the one place that holds process-wide defaults: the CP group of the last
``setup_context_parallel``, and the attention backend of ``set_attention_backend`` ("auto" unless a user
pins one). The public ``ring_attention``, ``ulysses_attention``, ``shard`` and ``unshard``
(``hf_ring.ring_attention``, ...) resolve ``group=None`` (and an unspecified ``backend``) to them and call
the ops in ``hf_ring.ops``, which always take their groups and backend as arguments:
``ops.ring.ring_attention`` (the ring over one given group) and ``ops.ulysses.ulysses_ring_attention`` (a
given Ulysses x ring grid); the transformers attention function of ``attn_implementation="ring"`` reads the
backend here too. This module imports only torch.
"""

from __future__ import annotations

import atexit
import os
import sys
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from .ops import kernels as _kernels
from .ops import ring as _ring
from .ops import ulysses as _ulysses
from .ops import zigzag as _zigzag

__all__ = [
    "ContextParallel",
    "setup_context_parallel",
    "default_group",
    "attention_backend",
    "set_attention_backend",
    "ring_attention",
    "ulysses_attention",
    "shard",
    "unshard",
]

_DEFAULT: ContextParallel | None = None
_BACKEND = "auto"
_STARTED: Any = None  # the default process group setup_context_parallel started (None: never; False: ended)


@dataclass(frozen=True)
class ContextParallel:
    """This rank's place in the DP x CP grid (``cp_group``/``dp_group`` are process groups), and in
    its CP group's Ulysses x ring grid: ``ulysses_group`` (``None`` when ``ulysses_size == 1``) and
    ``ring_group`` (the CP group when ``ulysses_size == 1``, ``None`` when ``ulysses_size == cp_size``:
    no ring); ``timeout`` bounds their collectives."""

    cp_group: dist.ProcessGroup
    cp_rank: int
    cp_size: int
    dp_group: dist.ProcessGroup
    dp_rank: int
    dp_size: int
    ulysses_size: int = 1
    ulysses_group: dist.ProcessGroup | None = None
    ring_group: dist.ProcessGroup | None = None
    timeout: timedelta | None = None  # of every group above (None: torch's default)

    @property
    def ring_size(self) -> int:
        """Ranks on the ring: ``cp_size / ulysses_size``."""
        return self.cp_size // self.ulysses_size


def setup_context_parallel(
    cp_size: int,
    *,
    ulysses_size: int = 1,
    backend: str | None = None,
    timeout: timedelta | float | None = None,
) -> ContextParallel:
    """Build the CP and DP groups and make this rank's CP group the default ``group=None``.

    Initialises torch.distributed from the launcher's environment (``accelerate launch``,
    ``torchrun``: ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ...) when that has not happened yet,
    with NCCL when CUDA is available and gloo otherwise (or ``backend``); a process group started here
    is destroyed at interpreter exit (one the user, accelerate or Trainer started stays theirs to end).
    Every rank must call it, with the same ``cp_size`` and ``ulysses_size``.

    ``timeout`` (a ``timedelta`` or seconds) bounds every collective of the groups made here (and
    of the default group when this call initialises it): a rank that stops responding makes the
    others raise after it instead of waiting. ``None``: the default group's timeout when
    torch.distributed is already initialised (``RingTrainer`` passes ``ddp_timeout``), else torch's
    default (30 minutes). The groups are named ``hf_ring_cp``, ``hf_ring_dp``, ``hf_ring_ulysses``
    and ``hf_ring_ring`` (NCCL's timeout messages give that name).

    ``ulysses_size`` (an int dividing ``cp_size``; ``"auto"`` is resolved where the model is known,
    by ``RingTrainer``, with ``hf_ring.planner.choose_ulysses_size``) splits each CP group into
    Ulysses groups of ``ulysses_size`` consecutive ranks that trade sequence for attention heads
    with an all-to-all (DeepSpeed-Ulysses), and rings of ``cp_size / ulysses_size`` ranks across
    them. It must divide the model's query heads (checked when attention runs). ``1``: plain ring
    attention; ``cp_size``: pure Ulysses. ``choose_ulysses_size(Hq, Hkv, cp_size, gpus_per_node)``
    gives 1 inside a node (the ring hides behind compute, an all-to-all cannot) and
    ``gcd(Hkv, cp_size, gpus_per_node)`` across nodes; ``hf-ring plan --ulysses-size ...`` prices
    every layout at a given length.
    """
    global _DEFAULT
    if isinstance(ulysses_size, bool) or not isinstance(ulysses_size, int) or ulysses_size < 1:
        raise ValueError(
            f"setup_context_parallel: ulysses_size must be a positive int dividing cp_size, got {ulysses_size!r}"
        )
    if cp_size >= 1 and cp_size % ulysses_size:
        raise ValueError(
            f"setup_context_parallel: ulysses_size={ulysses_size} does not divide cp_size={cp_size}; the CP "
            f"group is a grid of ulysses_size x ring ranks. Pick a divisor of {cp_size} as ulysses_size "
            "(1 is plain ring attention)."
        )
    if isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        timeout = timedelta(seconds=timeout)
    if timeout is not None and (not isinstance(timeout, timedelta) or timeout.total_seconds() <= 0):
        raise ValueError(f"setup_context_parallel: timeout must be a positive timedelta or seconds, got {timeout!r}")
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
        dist.init_process_group(backend, **({"timeout": timeout} if timeout is not None else {}))
        _started(dist.group.WORLD)
    if timeout is None:
        timeout = _default_timeout()

    def new_group(ranks: list[int], name: str) -> dist.ProcessGroup:
        return dist.new_group(ranks, timeout=timeout, group_desc=f"hf_ring_{name}")

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
        g = new_group(list(range(i * cp_size, (i + 1) * cp_size)), "cp")
        if rank // cp_size == i:
            cp_group = g
    for j in range(cp_size):
        g = new_group(list(range(j, world, cp_size)), "dp")
        if rank % cp_size == j:
            dp_group = g
    assert cp_group is not None and dp_group is not None
    cp_rank, u_size = rank % cp_size, ulysses_size
    ring_size = cp_size // u_size
    ulysses_group, ring_group = None, cp_group
    if u_size > 1:
        ring_group = None
        for i in range(dp_size):
            base = i * cp_size
            for r in range(ring_size):  # Ulysses: consecutive ranks
                g = new_group(list(range(base + r * u_size, base + (r + 1) * u_size)), "ulysses")
                if rank // cp_size == i and cp_rank // u_size == r:
                    ulysses_group = g
            if ring_size > 1:
                for u in range(u_size):  # ring: the same place u in every Ulysses group
                    g = new_group(list(range(base + u, base + cp_size, u_size)), "ring")
                    if rank // cp_size == i and cp_rank % u_size == u:
                        ring_group = g
    _DEFAULT = ContextParallel(
        cp_group, cp_rank, cp_size, dp_group, rank // cp_size, dp_size, u_size, ulysses_group, ring_group, timeout
    )
    return _DEFAULT


def _started(world: Any) -> None:
    """Note that this process started the default process group ``world``, and end it at interpreter exit."""
    global _STARTED
    if _STARTED is None:
        atexit.register(_end_started)
    _STARTED = world


def _end_started() -> None:
    """At interpreter exit: destroy the process group ``setup_context_parallel`` started (and with it every
    group made on it), if it is still the default one; a group that the user or a launcher started is
    theirs to end. Left to the interpreter's teardown, a gloo worker thread that finishes a collective as the
    script ends (gradients averaged as its last step) can drop the last reference to the collective's
    tensors while the interpreter finalizes: it then needs the GIL, the interpreter ends the thread by force,
    and the process aborts after the script's last line (``terminate called without an active exception``,
    SIGABRT; torchrun reports the rank failed and exits with status 1). Destroyed here, the group's threads
    finish while the interpreter is whole."""
    global _STARTED, _DEFAULT
    world, _STARTED = _STARTED, False
    if getattr(sys, "last_value", None) is not None:  # an uncaught exception ends the script: left as before,
        return  # for a peer may still wait in a collective that ending the group would tear mid-transfer
    if world and dist.is_initialized() and dist.group.WORLD is world:
        _DEFAULT = None
        dist.destroy_process_group()


def _default_timeout() -> timedelta | None:
    """The timeout of the default process group (``None``: unknown, torch's default applies)."""
    try:  # no public accessor; the backend's options hold it (gloo and NCCL)
        pg = dist.distributed_c10d._get_default_group()
        device = torch.device("cuda") if dist.get_backend() == "nccl" else torch.device("cpu")
        found = pg._get_backend(device).options._timeout
    except (AttributeError, RuntimeError, ValueError):
        return None
    return found if isinstance(found, timedelta) else None


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


def set_attention_backend(name: str) -> str:
    """Pin the block kernel of every ring attention call in this process that does not name one: the
    transformers models of ``attn_implementation="ring"``, ``hf_ring.ring_attention`` and
    ``ulysses_attention`` without ``backend=``. ``name``: one of ``hf_ring.ops.kernels.BACKENDS``
    (``"auto"``: the fastest kernel that runs each layer on this GPU, ``"cudnn"``, ``"flash_attn_3"``, ...);
    a misspelt name raises ``ValueError`` naming the closest one. A pinned kernel that cannot run a layer
    (its head dim, window or cap) raises at that layer, naming why. Returns the previous name."""
    global _BACKEND
    previous, _BACKEND = _BACKEND, _kernels.check_backend(name)
    return previous


def attention_backend() -> str:
    """The process's attention backend (``set_attention_backend``; ``"auto"`` unless pinned)."""
    return _BACKEND


def _default_ulysses(group: dist.ProcessGroup | None) -> ContextParallel | None:
    """The default CP state when ``group`` means its CP group and that group uses Ulysses."""
    cp = _DEFAULT if dist.is_initialized() else None
    if cp is None or cp.ulysses_size == 1 or not (group is None or group is cp.cp_group):
        return None
    return cp


def ring_attention(
    q: Tensor, k: Tensor, v: Tensor, *, group: dist.ProcessGroup | None = None, **options: Any
) -> Tensor:
    """Exact attention over a sequence sharded across the CP group: ``hf_ring.ops.ring.ring_attention``
    with ``group=None`` meaning the CP group of ``setup_context_parallel`` (else the world group).

    ``q: [B, S_local, Hq, D]``, ``k, v: [B, S_local, Hkv, D]`` (this rank's zigzag shard) ->
    ``[B, S_local, Hq, D]``. Options: ``causal``, ``softmax_scale``, ``backend``, ``order``,
    ``validate``, ``ring``, ``softcap``, ``sinks``; see the op's docstring. When that CP group was set up with
    ``ulysses_size > 1``, this is ``ulysses_attention`` on its Ulysses x ring grid (the pieces
    ``shard`` gives; ``order``, ``ring`` and ``schedule`` do not apply there). Without ``backend``, the
    process's (``set_attention_backend``).
    """
    options.setdefault("backend", _BACKEND)
    if group is None and options.get("ring") is None:
        if _default_ulysses(None) is not None:
            return ulysses_attention(q, k, v, **options)
        group = default_group()
    return _ring.ring_attention(q, k, v, group=group, **options)


def ulysses_attention(q: Tensor, k: Tensor, v: Tensor, **options: Any) -> Tensor:
    """Exact attention over the default CP group's Ulysses x ring grid (``setup_context_parallel``
    with ``ulysses_size``): ``hf_ring.ops.ulysses.ulysses_ring_attention`` with its groups filled in.

    ``q: [B, S_local, Hq, D]``, ``k, v: [B, S_local, Hkv, D]`` (this rank's piece, from ``shard``) ->
    ``[B, S_local, Hq, D]``. Options: ``causal``, ``softmax_scale``, ``backend``, ``validate``, ``softcap``,
    ``sinks``.
    """
    options.setdefault("backend", _BACKEND)
    cp = _DEFAULT if dist.is_initialized() else None
    if cp is None:
        raise ValueError("ulysses_attention: call hf_ring.setup_context_parallel(cp_size, ulysses_size=...) first")
    if cp.ulysses_size == 1:  # no Ulysses: the ring over the whole CP group
        return _ring.ring_attention(q, k, v, group=cp.cp_group, **options)
    groups = {"ulysses_group": cp.ulysses_group, "ring_group": cp.ring_group}
    return _ulysses.ulysses_ring_attention(q, k, v, **groups, **options)


def shard(x: Tensor, *, dim: int = 1, group: dist.ProcessGroup | None = None) -> Tensor:
    """This rank's zigzag shard of the full tensor ``x`` along ``dim`` (``x.shape[dim] / P`` rows):
    ``hf_ring.ops.zigzag.shard`` with ``group=None`` meaning the CP group of
    ``setup_context_parallel``, in its Ulysses x ring layout when it has ``ulysses_size > 1``
    (``hf_ring.ops.zigzag.hybrid``). Raises on every rank when the ranks pass different shapes."""
    cp = _default_ulysses(group)
    u = cp.ulysses_size if cp is not None else 1
    return _zigzag.shard(x, dim=dim, group=default_group() if group is None else group, ulysses_size=u)


def unshard(x: Tensor, *, dim: int = 1, group: dist.ProcessGroup | None = None) -> Tensor:
    """Gather the zigzag shards of the CP group and restore global order along ``dim`` (inverse of
    ``shard``, in the same layout; not differentiable): ``hf_ring.ops.zigzag.unshard`` with the default
    CP group. A packed batch from ``shard_batch`` is laid out per document: gather it with
    ``ring_context.unshard``."""
    cp = _default_ulysses(group)
    u = cp.ulysses_size if cp is not None else 1
    return _zigzag.unshard(x, dim=dim, group=default_group() if group is None else group, ulysses_size=u)
