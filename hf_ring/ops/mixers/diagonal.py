"""The context-parallel form of a diagonal linear recurrence ``h_t = a_t * h_{t-1} + x_t`` (RG-LRU:
RecurrentGemma's Griffin / Hawk blocks) by state passing.

A run maps its incoming state elementwise, ``h_out = m * h_in + E`` with ``m = prod_t a_t``, and its
outputs become ``h_t = h^E_t + (prod_{s <= t} a_s) * h_in``. Each rank scans its runs from a zero
state (token by token in float32 or wider, as transformers' RG-LRU scan accumulates), gathers every
rank's ``(m, E)`` and composes each run's ``h_in`` over its document in global order
(``ops.state_passing``). Runs are stacked with padding before them (``a = x = 0`` keeps a zero state
zero). Forward and backward are exact; communication is ``O(runs x D)`` per layer. This module
imports only torch; the group is passed in.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from ..layout import ShardLayout
from ..state_passing import apply_elementwise, incoming_states
from .runs import RunPlan, run_plan, stack_runs, unstack_runs

__all__ = ["diagonal_plan", "diagonal_recurrence"]


def diagonal_plan(layout: ShardLayout, batch: int, rank: int, device: torch.device | str | None = None) -> RunPlan:
    """The plan of ``diagonal_recurrence`` on CP rank ``rank`` (runs padded before their start), on ``device``."""
    return run_plan(layout, batch, rank, left=True, device=device)


def diagonal_recurrence(a: Tensor, x: Tensor, plan: RunPlan, group: dist.ProcessGroup | None) -> Tensor:
    """``h_t = a_t * h_{t-1} + x_t`` over the whole (sharded) sequence from a zero state at every
    document start, this rank's rows.

    Args:
        a, x: ``[B, S_local, D]`` (``a``: the decay, 0 where the state resets).
        plan: ``diagonal_plan(layout, B, rank)``; group: the layout's CP group.

    Returns ``[B, S_local, D]`` in float32 or ``x``'s wider dtype (padding rows: zeros). Collective
    over ``group`` (one all-gather forward, one all-reduce backward).
    """
    wide = torch.promote_types(x.dtype, torch.float32)
    a_s, x_s = stack_runs(a.to(wide), plan), stack_runs(x.to(wide), plan)  # [R, L, D]
    h = x_s.new_zeros((a_s.shape[0], a_s.shape[2]))
    outs = []
    for t in range(a_s.shape[1]):
        h = a_s[:, t] * h + x_s[:, t]
        outs.append(h)
    out = torch.stack(outs, 1)
    runs = len(plan.state.runs)
    maps: list[Tensor | None] = [None] * runs
    if plan.cont_runs:
        total = torch.where(plan.real[..., None], a_s, 1.0).prod(1)  # [R, D], padding left out
        for i in plan.cont_runs:
            maps[i] = total[i]
    states = incoming_states(
        plan.layout, plan.batch, plan.rank, group, maps, list(h.unbind(0))[:runs], apply_elementwise,
        map_shape=(a.shape[2],), state_shape=(a.shape[2],), plan=plan.state, dtype=wide, device=x.device,
    )  # fmt: skip
    if plan.fixed_runs:  # h_t += (prod_{s <= t} a_s) h_in; a zero state on a first run adds zeros
        real = plan.real.index_select(0, plan.fixed)[..., None]
        decay = torch.where(real, a_s.index_select(0, plan.fixed), 1.0).cumprod(1)  # [F, L, D]
        s_in = torch.stack([states[i] for i in plan.fixed_runs])  # type: ignore[misc]
        out = out.index_add(0, plan.fixed, decay * s_in[:, None])
    return unstack_runs(out, plan)
