"""Pass a recurrent state along the runs of a sharded sequence: the exchange behind every
context-parallel recurrence (Gated DeltaNet, Mamba2 / SSD, Mamba, lightning attention, RG-LRU).

A recurrence over one run of local rows (``ShardLayout.runs``: consecutive global positions of one
document) turns the state entering the run into the state leaving it by an affine map::

    S_out = M(S_in) + E        M: the run's map of the state (linear), E: the run from a zero state

Each rank computes ``(M, E)`` for its own runs; ``incoming_states`` gathers them from the whole CP
group in one differentiable all-gather and composes, for every run of this rank, the exclusive
prefix over the runs of its document in global order (across all ranks), in float32 or wider::

    document of 4 runs a b c d (any ranks):  S_in(a) = 0,  S_in(b) = E_a,
    S_in(c) = M_b(E_a) + E_b,  S_in(d) = M_c(M_b(E_a) + E_b) + E_c

The state restarts at every document start. The message holds one slot per run whose state a later
run needs, so the communication grows with the runs and the state size, never with the sequence.
The backward sums the gathered slots' gradients over the group (``all_reduce``; gloo has no
reduce-scatter) and keeps this rank's.

Maps come in three kinds, each with its ``apply(M, S) -> M(S)``:

==============  ==========================  ==========================  =====================
kind            ``M`` per run               ``S`` per run               mixers
==============  ==========================  ==========================  =====================
``apply_matrix``  ``[..., H, K, K]``          ``[..., H, K, V]``           delta rules (GDN, KDA)
``apply_scalar``  ``[..., H]``                ``[..., H, *state]``         SSD (Mamba2), lightning
``apply_elementwise`` same shape as ``S``     any                          Mamba, RG-LRU
==============  ==========================  ==========================  =====================

Callers may pass any other ``apply`` built from differentiable torch ops. This module imports only
torch; the group is passed in.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from .exchange import tie
from .layout import Run, ShardLayout

__all__ = [
    "StatePlan",
    "apply_elementwise",
    "apply_matrix",
    "apply_scalar",
    "incoming_states",
    "state_plan",
]

Apply = Callable[[Tensor, Tensor], Tensor]


def apply_matrix(m: Tensor, s: Tensor) -> Tensor:
    """``M @ S``: ``m [..., K, K]`` (per head) on ``s [..., K, V]`` -- the delta rules' map."""
    return m @ s


def apply_scalar(m: Tensor, s: Tensor) -> Tensor:
    """``m [..., H]`` (a decay per head) times ``s [..., H, *state]`` -- SSD's and lightning's map."""
    return m.reshape(*m.shape, *([1] * (s.dim() - m.dim()))) * s


def apply_elementwise(m: Tensor, s: Tensor) -> Tensor:
    """``m * s`` (same shape) -- a diagonal recurrence's map (Mamba, RG-LRU)."""
    return m * s


@dataclass(frozen=True, eq=False)
class StatePlan:
    """One rank's part of a state exchange, derived from the layout alone (every rank derives the
    same plan for every rank, so nothing is negotiated).

    Attributes:
        runs: this rank's runs, ``for b in range(batch): layout.runs(rank, b)`` in that order.
        first: per run, it begins its document (its incoming state is zero; its map is not needed).
        sent: per run, a later run of its document needs its state (its ``E``, and its ``M`` unless
            ``first``, travel in the all-gather).
        slot: per run, its slot in this rank's part of the message (``-1``: not sent).
        slots: slots per rank in the message (the most any rank sends; ranks pad to it).
        chains: per run, the ``(rank, slot, first)`` of every earlier run of its document in global
            order (empty when ``first``).
        incoming: the runs that ``incoming_states`` gives a state (not ``None``): those with a chain,
            or, when ``tied``, the first run alone (a zero state; see ``incoming_states``).
        tied: other ranks need this rank's states but none of its runs has a chain.
    """

    runs: tuple[Run, ...]
    first: tuple[bool, ...]
    sent: tuple[bool, ...]
    slot: tuple[int, ...]
    slots: int
    chains: tuple[tuple[tuple[int, int, bool], ...], ...]
    incoming: tuple[int, ...] = ()
    tied: bool = False


@functools.lru_cache(maxsize=64)
def _global(layout: ShardLayout, batch: int) -> tuple:
    """Per rank: its runs, which are sent and their slots; per (batch row, document start): its runs
    in global order as (start, rank, index)."""
    docs: dict[tuple[int, int], list[tuple[int, int, int]]] = {}
    runs_of = []
    for rank in range(layout.size):
        runs = [run for b in range(batch) for run in layout.runs(rank, b)]
        runs_of.append(runs)
        for i, run in enumerate(runs):
            docs.setdefault((run.row, run.doc_start), []).append((run.start, rank, i))
    for chain in docs.values():
        chain.sort()
    last = {key: chain[-1][:2] for key, chain in docs.items()}  # (start, rank) of each document's last run
    slot_of, counts = [], []
    for rank, runs in enumerate(runs_of):
        slots, n = [], 0
        for run in runs:
            if last[(run.row, run.doc_start)] != (run.start, rank):
                slots.append(n)
                n += 1
            else:
                slots.append(-1)
        slot_of.append(slots)
        counts.append(n)
    return runs_of, slot_of, max(counts, default=0), docs


def state_plan(layout: ShardLayout, batch: int, rank: int) -> StatePlan:
    """The state exchange of CP rank ``rank`` for a batch of ``batch`` rows laid out by ``layout``."""
    runs_of, slot_of, slots, docs = _global(layout, batch)
    runs = runs_of[rank]
    chains = []
    for run in runs:
        chain = []
        for start, r, i in docs[(run.row, run.doc_start)]:
            if start >= run.start:
                break
            other = runs_of[r][i]
            chain.append((r, slot_of[r][i], other.start == other.doc_start))
        chains.append(tuple(chain))
    incoming = tuple(i for i, chain in enumerate(chains) if chain)
    tied = slots > 0 and bool(runs) and not incoming
    return StatePlan(
        runs=tuple(runs),
        first=tuple(run.start == run.doc_start for run in runs),
        sent=tuple(s >= 0 for s in slot_of[rank]),
        slot=tuple(slot_of[rank]),
        slots=slots,
        chains=tuple(chains),
        incoming=(0,) if tied else incoming,
        tied=tied,
    )


class _AllGather(torch.autograd.Function):
    """``[slots, F]`` on every rank -> ``[P, slots, F]``; backward: the gradient summed over the
    group, this rank's part."""

    @staticmethod
    def forward(ctx, x, anchor, group, rank, size):  # type: ignore[override]
        ctx.group, ctx.rank, ctx.size = group, rank, size
        if size == 1:
            return x.unsqueeze(0).clone()
        out = x.new_empty((size, *x.shape))
        dist.all_gather(list(out.unbind(0)), x.contiguous(), group=group)  # views of one buffer
        return out

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        if ctx.size == 1:
            return grad[0], None, None, None, None
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad[ctx.rank], None, None, None, None


def _shape(entries: Sequence[Tensor | None], given: Sequence[int] | None) -> tuple[int, ...] | None:
    if given is not None:
        return tuple(given)
    for e in entries:
        if e is not None:
            return tuple(e.shape)
    return None


def incoming_states(
    layout: ShardLayout,
    batch: int,
    rank: int,
    group: dist.ProcessGroup | None,
    maps: Sequence[Tensor | None],
    exts: Sequence[Tensor | None],
    apply: Apply,
    *,
    map_shape: Sequence[int] | None = None,
    state_shape: Sequence[int] | None = None,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    plan: StatePlan | None = None,
) -> list[Tensor | None]:
    """The state entering each of this rank's runs, composed over the whole CP group.

    Args:
        layout, batch, rank: the batch's ``ShardLayout``, its batch rows, this CP rank.
        group: the CP group (``layout.size`` ranks; ``None``: the default group, or one process).
        maps: per run of ``state_plan(...).runs``, its map ``M`` (any shape ``apply`` takes; the
            same on every run and rank). ``None`` is allowed where it is not needed: a run that
            begins its document (``plan.first``) or whose state no later run needs (``not plan.sent``).
        exts: per run, ``E``, the state leaving the run when it starts from zero (``S_out =
            apply(M, S_in) + E``); ``None`` allowed where ``not plan.sent``.
        apply: ``apply(M, S) -> M(S)``, e.g. ``apply_matrix``; differentiable torch ops.
        map_shape, state_shape, dtype, device: the shapes of ``M`` and ``E``, the dtype the
            states are composed in (float32 or wider) and their device. Omitted, they come from
            this rank's entries (dtype: float32, or the entries' wider dtype); give them whenever a
            rank may hold no entry of one kind (packed documents, Ulysses pieces), since every
            rank of the group must send the same message.
        plan: ``state_plan(layout, batch, rank)`` if the caller has it.

    Returns:
        Per run, its incoming state (shape of ``E``, dtype float32 or the entries' wider dtype), or
        ``None`` for a run that begins its document (a zero state). Differentiable in ``maps`` and
        ``exts``. Collective over ``group`` (every rank calls it, one all-gather; none at P = 1).

    The backward is collective too (an ``all_reduce``), so the caller's output must depend on every
    state returned (use each as the run's initial state). When other ranks need this rank's states
    but all of its own runs begin documents, its first run gets a zero tensor instead of ``None``
    (the one way its backward reaches the collective): use it like any other state.
    """
    plan = plan or state_plan(layout, batch, rank)
    if len(maps) != len(plan.runs) or len(exts) != len(plan.runs):
        raise ValueError(
            f"incoming_states: {len(plan.runs)} runs on rank {rank}, got {len(maps)} maps and {len(exts)} exts"
        )
    if plan.slots == 0:  # every run begins its document and is its document's last: nothing to pass
        return [None] * len(plan.runs)
    m_shape, e_shape = _shape(maps, map_shape), _shape(exts, state_shape)
    if m_shape is None or e_shape is None:
        raise ValueError(
            f"incoming_states: rank {rank} holds no {'map' if m_shape is None else 'state'} to take the "
            "message size from; pass map_shape= and state_shape= (the same on every rank)"
        )
    known = [t for t in (*maps, *exts) if t is not None]
    if dtype is None:
        dtype = functools.reduce(torch.promote_types, [t.dtype for t in known], torch.float32)
    if device is None:
        device = known[0].device if known else torch.device("cpu")
    m_numel, e_numel = math.prod(m_shape), math.prod(e_shape)
    rows: list[Tensor] = []
    zero = torch.zeros(m_numel + e_numel, dtype=dtype, device=device)
    for i in range(len(plan.runs)):
        if not plan.sent[i]:
            continue
        e = exts[i]
        if e is None:
            raise ValueError(f"incoming_states: run {i} of rank {rank} passes its state on; its ext is needed")
        m = maps[i]
        if m is None and not plan.first[i]:
            raise ValueError(f"incoming_states: run {i} of rank {rank} continues a document; its map is needed")
        m_flat = zero[:m_numel] if m is None else m.reshape(-1).to(dtype)
        rows.append(torch.cat((m_flat, e.reshape(-1).to(dtype))))
    rows.extend([zero] * (plan.slots - len(rows)))
    size = layout.size
    # A rank that sends nothing differentiable still takes part in the backward's all_reduce: the
    # anchor makes the message require grad wherever autograd records.
    anchor = torch.empty(0, requires_grad=torch.is_grad_enabled())
    gathered = _AllGather.apply(torch.stack(rows), anchor, group, rank, size)  # [P, slots, m + e]

    def unpack(r: int, s: int) -> tuple[Tensor, Tensor]:
        flat = gathered[r, s]
        return flat[:m_numel].view(m_shape), flat[m_numel:].view(e_shape)

    out: list[Tensor | None] = []
    prefix: dict[tuple[int, int], Tensor] = {}  # (rank, slot) of a run -> the state leaving it
    for chain in plan.chains:
        if not chain:
            out.append(None)
            continue
        state: Tensor | None = None
        for r, s, first in chain:
            if (r, s) in prefix:
                state = prefix[(r, s)]
                continue
            m, e = unpack(r, s)
            state = e if first or state is None else apply(m, state) + e
            prefix[(r, s)] = state
        out.append(state)
    if plan.tied:
        # Other ranks need this rank's states, but none of its own outputs would depend on the
        # message: its backward would skip the all-gather's all_reduce and the group would hang.
        out[0] = tie(gathered.new_zeros(e_shape), gathered)
    return out
