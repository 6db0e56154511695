"""A rank's runs stacked as a batch of sequences for a recurrence's kernel (shared by the mixers that
pass their state: ``delta``, ``ssd``, ...).

Each run (``ShardLayout.runs``: consecutive global positions of one document) becomes one row of
``[R, length]`` (``length``: the longest run). Shorter runs get zero rows after their end (the
default: for rules whose zero rows leave the state alone, e.g. the delta rules with ``g = beta =
0``) or before their start (``left=True``: for rules whose zero rows still decay the state, e.g. an
SSM whose step is ``softplus(0 + bias) > 0``; a zero state decayed stays zero, so the final state
and the real rows' outputs are those of the run alone).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..exchange import check_device, on_device
from ..layout import ShardLayout
from ..state_passing import StatePlan, state_plan

__all__ = ["RunPlan", "run_plan", "stack_runs", "unstack_runs"]


@dataclass(frozen=True, eq=False)
class RunPlan:
    """One rank's runs stacked for a kernel (made once per batch from the layout).

    ``state``: the state exchange (``StatePlan``); ``length``: the kernel's sequence length (the
    longest run); ``index``: ``[R, length]`` flat local rows (``b * S_local + t``) of each run,
    ``B * S_local`` (a zero row) on padding; ``real``: ``[R, length]`` bool, the rows of a token;
    ``left``: padding before each run (else after); ``reshape``: the runs tile the local rows in
    order with one length, so ``[B, S_local] -> [R, length]`` is a view (no gather, no scatter);
    ``cont``: the runs that do not begin their document (their incoming state is passed);
    ``sent``: the runs whose state a later run needs; ``fixed``: the runs that get an incoming state
    (``state.incoming``), ``fixed_in_cont`` their places in ``cont`` (when not ``state.tied``). Each
    list of runs comes as a tuple of ints (``*_runs``) and as an index tensor on ``device``, so a
    layer neither reads from nor copies to the device.
    """

    state: StatePlan
    layout: ShardLayout
    rank: int
    batch: int
    local: int
    length: int
    index: Tensor
    real: Tensor
    left: bool
    reshape: bool
    cont: Tensor
    cont_runs: tuple[int, ...]
    sent: Tensor
    sent_runs: tuple[int, ...]
    fixed: Tensor
    fixed_runs: tuple[int, ...]
    fixed_in_cont: Tensor
    device: torch.device


def run_plan(
    layout: ShardLayout, batch: int, rank: int, left: bool = False, device: torch.device | str | None = None
) -> RunPlan:
    """The runs of CP rank ``rank`` for a batch of ``batch`` rows (padding before them if ``left``),
    index tensors on ``device`` (default: the host; make it once per batch, ``RingContext.cached``)."""
    plan = state_plan(layout, batch, rank)
    runs = plan.runs
    length = max((r.length for r in runs), default=1)
    pad = batch * layout.local
    index = torch.full((max(len(runs), 1), length), pad, dtype=torch.long)
    for i, run in enumerate(runs):
        at = length - run.length if left else 0
        index[i, at : at + run.length] = torch.arange(run.length) + run.row * layout.local + run.local
    tiles = len(runs) * length == pad and all(
        r.length == length and r.row * layout.local + r.local == i * length for i, r in enumerate(runs)
    )
    cont = tuple(i for i, first in enumerate(plan.first) if not first)
    sent = tuple(i for i, s in enumerate(plan.sent) if s)
    fixed = plan.incoming
    where = {r: j for j, r in enumerate(cont)}
    in_cont = () if plan.tied else tuple(where[i] for i in fixed)

    def t(v: Tensor | tuple[int, ...]) -> Tensor:
        return on_device(torch.as_tensor(v, dtype=torch.long) if isinstance(v, tuple) else v, device)

    return RunPlan(
        plan, layout, rank, batch, layout.local, length, t(index), t(index < pad), left, tiles, t(cont), cont,
        t(sent), sent, t(fixed), fixed, t(in_cont), torch.device(device or "cpu"),
    )  # fmt: skip


def stack_runs(x: Tensor, plan: RunPlan) -> Tensor:
    """``[B, S_local, *F]`` -> ``[R, length, *F]`` (zeros on padding)."""
    check_device(plan.device, x, "stack_runs", "run_plan")
    flat = x.reshape(plan.batch * plan.local, *x.shape[2:])
    if plan.reshape:
        return flat.view(-1, plan.length, *x.shape[2:])
    flat = torch.cat((flat, flat.new_zeros((1, *x.shape[2:]))))
    return flat[plan.index]


def unstack_runs(y: Tensor, plan: RunPlan) -> Tensor:
    """``[R, length, *F]`` -> ``[B, S_local, *F]`` (zeros on padding rows)."""
    feat = y.shape[2:]
    if plan.reshape:
        return y.reshape(plan.batch, plan.local, *feat)
    rows = plan.batch * plan.local
    out = y.new_zeros((rows + 1, *feat))
    out = out.index_put((plan.index.reshape(-1),), y.reshape(-1, *feat), accumulate=True)
    return out[:rows].view(plan.batch, plan.local, *feat)
