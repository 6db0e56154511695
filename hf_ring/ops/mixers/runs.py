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
    ``cont``: the runs that do not begin their document (their incoming state is passed).
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


def run_plan(layout: ShardLayout, batch: int, rank: int, left: bool = False) -> RunPlan:
    """The runs of CP rank ``rank`` for a batch of ``batch`` rows (padding before them if ``left``)."""
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
    cont = torch.tensor([i for i, first in enumerate(plan.first) if not first], dtype=torch.long)
    return RunPlan(plan, layout, rank, batch, layout.local, length, index, index < pad, left, tiles, cont)


def stack_runs(x: Tensor, plan: RunPlan) -> Tensor:
    """``[B, S_local, *F]`` -> ``[R, length, *F]`` (zeros on padding)."""
    flat = x.reshape(plan.batch * plan.local, *x.shape[2:])
    if plan.reshape:
        return flat.view(-1, plan.length, *x.shape[2:])
    flat = torch.cat((flat, flat.new_zeros((1, *x.shape[2:]))))
    return flat[plan.index.to(x.device)]


def unstack_runs(y: Tensor, plan: RunPlan) -> Tensor:
    """``[R, length, *F]`` -> ``[B, S_local, *F]`` (zeros on padding rows)."""
    feat = y.shape[2:]
    if plan.reshape:
        return y.reshape(plan.batch, plan.local, *feat)
    rows = plan.batch * plan.local
    out = y.new_zeros((rows + 1, *feat))
    out = out.index_put((plan.index.to(y.device).reshape(-1),), y.reshape(-1, *feat), accumulate=True)
    return out[:rows].view(plan.batch, plan.local, *feat)
