"""Fetch rows of a sharded sequence from the ranks that hold them: the one exchange behind every halo.

A token mixer with a reach of ``w`` tokens (a causal convolution of kernel ``w + 1``, a sliding
window of ``w + 1`` keys) needs, at the start of each run of its local rows (``ShardLayout.runs``),
the ``w`` rows that precede it in global order within the same document -- rows other ranks hold.
``halo_plan`` works out, from the layout alone, which rows each rank wants and which it must send
(every rank derives the same plan, so no sizes are negotiated); ``fetch_rows`` moves them with one
``all_to_all_single`` over the CP group (also when a rank has nothing to send: a collective, never a
one-sided wait) and is differentiable: the backward sends each fetched row's gradient back to the
rank that holds the row, which adds it in. ``plan_rows`` takes any wanted-rows function. This module
imports only torch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from .layout import Run, ShardLayout

__all__ = ["Halo", "RowPlan", "check_device", "fetch_backward", "fetch_forward", "fetch_rows", "halo_plan", "on_device",
           "plan_rows", "tie"]  # fmt: skip

Wanted = Callable[[int], list[tuple[int, int]]]  # CP rank -> (batch row, global position) pairs, in order


def on_device(t: Tensor, device: torch.device | str | None) -> Tensor:
    """A plan's host-made index tensor on ``device`` (once per batch, when the plan is made): on CUDA
    through pinned memory and an asynchronous copy, so that making it never waits for the stream; as
    it is on the CPU or when ``device`` is ``None``."""
    if device is None or t.device == torch.device(device):
        return t
    if torch.device(device).type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def check_device(plan: torch.device, x: Tensor, what: str, maker: str) -> None:
    """Raise unless a plan made for ``plan`` serves an input on ``x.device`` (its index tensors are there)."""
    if plan.type != x.device.type or (plan.index is not None and plan.index != x.device.index):
        raise ValueError(
            f"{what}: the plan's index tensors are on {plan}, the input on {x.device}; make the plan with "
            f"{maker}(..., device=x.device), once per batch (RingContext.cached keys it by device)"
        )


def _on(t: Tensor, device: torch.device) -> Tensor:
    return t if t.device == device else t.to(device)  # a plan made for another device: one copy per call


@dataclass(frozen=True, eq=False)
class RowPlan:
    """One rank's part of a row exchange over a CP group of ``size`` ranks.

    ``send[d]``: flat indices into this rank's ``[B * S_local]`` rows that rank ``d`` wants, in the
    order ``d`` wants them (``send[rank]``: the rows it wants from itself). ``recv[s]``: how many rows
    come from rank ``s``. ``order``: where each received row goes in the output (received rows are
    laid end to end by source rank); ``count``: rows wanted (the output's length). ``sent``: the
    ``send`` lists end to end (the backward's scatter). Index tensors live on the plan's device
    (``to``): the exchange then copies nothing from the host.
    """

    rank: int
    size: int
    send: tuple[Tensor, ...]
    recv: tuple[int, ...]
    order: Tensor
    count: int
    sent: Tensor | None = None

    def __post_init__(self) -> None:
        if self.sent is None:
            sent = torch.cat(self.send) if self.send else torch.zeros(0, dtype=torch.long)
            object.__setattr__(self, "sent", sent)

    def to(self, device: torch.device | str | None) -> RowPlan:
        """This plan with its index tensors on ``device`` (see ``on_device``)."""
        send = tuple(on_device(t, device) for t in self.send)
        order, sent = on_device(self.order, device), on_device(self.sent, device)  # type: ignore[arg-type]
        return RowPlan(self.rank, self.size, send, self.recv, order, self.count, sent)

    @property
    def sent_rows(self) -> int:
        """Rows this rank sends to other ranks (its own rows it keeps are not counted)."""
        return sum(len(s) for d, s in enumerate(self.send) if d != self.rank)


def plan_rows(layout: ShardLayout, batch: int, rank: int, wanted: Wanted) -> RowPlan:
    """The exchange in which every CP rank ``r`` gets the rows ``wanted(r)`` (pairs ``(batch row,
    global position)``; each must be held by some rank) and ``rank`` sends what others want of it."""
    rank_of, local_of = layout.locate(batch)
    size = layout.size
    send: list[list[int]] = [[] for _ in range(size)]
    recv = [0] * size
    order: list[list[int]] = [[] for _ in range(size)]
    count = 0
    for r in range(size):
        for i, (b, g) in enumerate(wanted(r)):
            src = int(rank_of[b, g])
            if src < 0:
                raise ValueError(f"plan_rows: global position {g} of batch row {b} is held by no rank")
            if src == rank:
                send[r].append(b * layout.local + int(local_of[b, g]))
            if r == rank:
                recv[src] += 1
                order[src].append(i)
                count = i + 1
    return RowPlan(
        rank,
        size,
        tuple(torch.tensor(s, dtype=torch.long) for s in send),
        tuple(recv),
        torch.tensor([i for o in order for i in o], dtype=torch.long),
        count,
    )


def _exchange(x: Tensor, plan: RowPlan, group: dist.ProcessGroup | None) -> Tensor:
    """Rows ``x[send[d]]`` to every rank ``d``; returns the received rows, end to end by source."""
    payload = x[_on(plan.sent, x.device)]  # type: ignore[arg-type]  # the send lists end to end
    if plan.size == 1:
        return payload
    out = x.new_empty((sum(plan.recv), *x.shape[1:]))
    dist.all_to_all_single(
        out, payload, output_split_sizes=list(plan.recv), input_split_sizes=[len(s) for s in plan.send], group=group
    )
    return out


def fetch_forward(flat: Tensor, plan: RowPlan, group: dist.ProcessGroup | None) -> Tensor:
    """``fetch_rows`` without autograd: ``flat [B * S_local, *F]`` -> the wanted rows ``[M, *F]``."""
    got = _exchange(flat, plan, group)
    out = flat.new_empty((plan.count, *flat.shape[1:]))
    out[_on(plan.order, flat.device)] = got
    return out


def fetch_backward(grad: Tensor, plan: RowPlan, group: dist.ProcessGroup | None, rows: int) -> Tensor:
    """The gradient of ``fetch_forward``: each fetched row's gradient ``grad [M, *F]`` sent back to the
    rank that holds the row and added there; returns ``[rows, *F]`` (this rank's ``B * S_local`` rows).
    Collective, like the forward."""
    dev = grad.device
    back = grad[_on(plan.order, dev)]  # laid end to end by the rank that holds each row
    sizes = plan.recv
    pieces = back.split(list(sizes))
    # the reverse exchange: what we received from s goes back to s; we get back what we sent
    feat = grad.shape[1:]
    if plan.size == 1:
        got = pieces[0]
    else:
        got = grad.new_empty((sum(len(s) for s in plan.send), *feat))
        dist.all_to_all_single(
            got, back.contiguous(), output_split_sizes=[len(s) for s in plan.send],
            input_split_sizes=list(sizes), group=group,
        )  # fmt: skip
    dx = grad.new_zeros((rows, *feat))
    dx.index_add_(0, _on(plan.sent, dev), got)  # type: ignore[arg-type]
    return dx


class _FetchRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, plan, group):  # type: ignore[override]
        # x: (B * S_local, *F) -- this rank's rows, flattened
        ctx.plan, ctx.group, ctx.rows = plan, group, x.shape[0]
        return fetch_forward(x, plan, group)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return fetch_backward(grad, ctx.plan, ctx.group, ctx.rows), None, None


def fetch_rows(x: Tensor, plan: RowPlan, group: dist.ProcessGroup | None) -> Tensor:
    """The rows ``plan`` wants, from the ranks of ``group`` (the CP group the plan was made for).

    ``x``: ``[B, S_local, *F]``, this rank's rows. Returns ``[M, *F]`` (``M = plan.count``), row ``i``
    the ``i``-th wanted row. Collective: every rank of ``group`` calls it with its own plan of the same
    exchange. Differentiable in ``x``: each fetched row's gradient is added to the rank that holds it.
    The backward is collective too: every rank's loss must depend on the output (``tie``).
    """
    flat = x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])
    return _FetchRows.apply(flat, plan, group)


class _Tie(torch.autograd.Function):
    @staticmethod
    def forward(ctx, out, *used):  # type: ignore[override]
        ctx.like = [(u.shape, u.dtype, u.device) for u in used]
        return out.clone()

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return (grad, *(torch.zeros(s, dtype=d, device=dev) for s, d, dev in ctx.like))


def tie(out: Tensor, *used: Tensor) -> Tensor:
    """A copy of ``out`` that autograd sees as depending on ``used`` (with zero gradient).

    The backward of ``fetch_rows`` (and of any collective) runs on a rank only if that rank's loss
    depends on the collective's output; a rank that sends rows but uses none it receives would skip
    it and leave the group waiting. Pass its output through ``tie(out, fetched)``."""
    return _Tie.apply(out, *used)


@dataclass(frozen=True, eq=False)
class Halo:
    """The rows preceding each run of one rank's local rows: ``plan`` fetches them; run ``i``
    (``runs[i]``) gets rows ``[offsets[i], offsets[i + 1])`` of the fetched tensor, the
    ``offsets[i + 1] - offsets[i] <= width`` global positions before ``runs[i].start`` that belong
    to its document, in global order (fewer than ``width`` near the document's start)."""

    width: int
    runs: tuple[Run, ...]
    offsets: tuple[int, ...]
    plan: RowPlan

    def fetch(self, x: Tensor, group: dist.ProcessGroup | None) -> Tensor:
        """``[M, *F]``: every run's halo rows of ``x [B, S_local, *F]`` (see ``fetch_rows``)."""
        return fetch_rows(x, self.plan, group)


def _halo_rows(layout: ShardLayout, batch: int, width: int, rank: int) -> list[tuple[int, int]]:
    out = []
    for b in range(batch):
        for run in layout.runs(rank, b):
            out.extend((b, g) for g in range(max(run.doc_start, run.start - width), run.start))
    return out


def halo_plan(layout: ShardLayout, batch: int, rank: int, width: int, device: torch.device | str | None = None) -> Halo:
    """The halo of ``width`` rows of every run of ``rank``'s local rows (all ``batch`` rows), its
    index tensors on ``device`` (default: the host)."""
    if width < 0:
        raise ValueError(f"halo_plan: width must be >= 0, got {width}")
    runs = tuple(run for b in range(batch) for run in layout.runs(rank, b))
    offsets = [0]
    for run in runs:
        offsets.append(offsets[-1] + run.start - max(run.doc_start, run.start - width))
    plan = plan_rows(layout, batch, rank, lambda r: _halo_rows(layout, batch, width, r))
    return Halo(width, runs, tuple(offsets), plan.to(device))
