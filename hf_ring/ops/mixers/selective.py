"""The context-parallel form of Mamba's selective scan (Jamba, Zamba; Mamba, Falcon-Mamba) by state
passing.

Per channel ``d`` the scan keeps a state ``S [N]``; each token decays it elementwise and adds a
vector, and reads it with ``C``::

    dt_t = softplus(dt_t + delta_bias)         a_t = exp(dt_t A_d)      (A [D, N] < 0)
    S_t = a_t * S_{t-1} + dt_t x_t B_t         y_t = (S_t . C_t + D_d x_t) * silu(z_t)

So a run maps its incoming state elementwise, ``S_out = m * S_in + E`` with ``m = exp(A sum_t dt_t)``
(``[D, N]``), and its outputs become ``y = y_E + (sum_n C_t exp(A cumsum_t dt) S_in) * silu(z_t)``.
The installed scan (mamba-ssm's ``selective_scan_fn`` on CUDA, transformers' torch scan otherwise)
runs each run from a zero state, giving ``y_E`` and ``E`` (the kernel takes no initial state and
needs none); ``m`` and the correction are torch ops on the step sizes, ``A`` and ``C``.
``ops.state_passing.incoming_states`` gathers every rank's ``(m, E)`` and composes each run's
``S_in`` over its document in global order. Runs are stacked with padding before them
(``runs.run_plan(left=True)``): a zero row still decays the state, and a zero state decayed stays zero.

Forward and backward are exact; communication is ``O(runs x D x N)`` per layer, whatever the
sequence length. This module imports only torch; the group is passed in.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from ..layout import ShardLayout
from ..state_passing import apply_elementwise, incoming_states
from .runs import RunPlan, run_plan, stack_runs, unstack_runs

__all__ = ["selective_plan", "selective_scan"]

Scan = Callable[..., tuple[Tensor, Tensor]]
# scan(u [N, D, L], delta [N, D, L], A [D, Ns], B [N, Ns, L], C [N, Ns, L], D=[D] | None, z=[N, D, L] | None,
#      delta_bias=[D] | None, delta_softplus=bool, return_last_state=True) -> (y [N, D, L], last state [N, D, Ns])


def selective_plan(layout: ShardLayout, batch: int, rank: int) -> RunPlan:
    """The plan of ``selective_scan`` on CP rank ``rank`` (runs padded before their start)."""
    return run_plan(layout, batch, rank, left=True)


def _stack(x: Tensor, plan: RunPlan) -> Tensor:
    """``[B, F, S_local]`` (channels first, the kernel's layout) -> ``[R, F, length]``."""
    return stack_runs(x.transpose(1, 2), plan).transpose(1, 2).contiguous()


def _block(cum: Tensor, a: Tensor, c: Tensor, s_in: Tensor) -> Tensor:
    """``sum_n C_t exp(A cum_t) S_in``: ``cum [F, D, l]``, ``a [D, N]``, ``c [F, N, l]``, ``s_in [F, D, N]``."""
    return torch.einsum("fnl,fdln,fdn->fdl", c, torch.exp(cum[..., None] * a[:, None, :]), s_in)


def _correction(cum: Tensor, a: Tensor, c: Tensor, s_in: Tensor, budget: int = 1 << 26) -> Tensor:
    """``_block`` over the whole run, in blocks of rows whose ``[F, D, rows, N]`` decay holds at most
    ``budget`` elements, each recomputed in the backward (so the memory does not grow with the run)."""
    f, d, length = cum.shape
    rows = max(1, budget // max(1, f * d * a.shape[1]))
    if rows >= length:
        return _block(cum, a, c, s_in)
    parts = []
    for lo in range(0, length, rows):
        piece = (cum[..., lo : lo + rows], a, c[..., lo : lo + rows], s_in)
        if torch.is_grad_enabled():
            parts.append(checkpoint(_block, *piece, use_reentrant=False))
        else:
            parts.append(_block(*piece))
    return torch.cat(parts, -1)


def selective_scan(
    scan: Scan,
    u: Tensor,
    delta: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    plan: RunPlan,
    group: dist.ProcessGroup | None,
    *,
    D: Tensor | None = None,
    z: Tensor | None = None,
    delta_bias: Tensor | None = None,
    delta_softplus: bool = False,
    **options: object,
) -> Tensor:
    """The selective scan over the whole (sharded) sequence, this rank's rows.

    Args:
        scan: the local kernel (see ``Scan``): transformers' ``mamba_selective_scan`` or mamba-ssm's
            ``selective_scan_fn``.
        u, delta: ``[B, D, S_local]`` (``delta`` before bias and softplus); A: ``[D, N]`` (negative);
        B, C: ``[B, N, S_local]``; D: ``[D]``; z: the gate ``[B, D, S_local]``; delta_bias: ``[D]``.
        plan: ``selective_plan(layout, B, rank)``; group: the layout's CP group.
        options: passed to every scan call (transformers' ``use_mambapy``, ...).

    Returns ``[B, D, S_local]`` in the scan's output dtype: each row's output as the scan over its
    document in global order from a zero state (padding rows: zeros). Collective over ``group``
    (one all-gather forward, one all-reduce backward).
    """
    d, n = A.shape
    us, ds, bs, cs = (_stack(t, plan) for t in (u, delta, B, C))
    zs = None if z is None else _stack(z, plan)
    out, ext = scan(us, ds, A, bs, cs, D=D, z=zs, delta_bias=delta_bias, delta_softplus=delta_softplus,
                    return_last_state=True, **options)  # fmt: skip
    wide = torch.promote_types(u.dtype, torch.float32)
    step = ds.to(wide)
    if delta_bias is not None:
        step = step + delta_bias.to(wide)[:, None]
    if delta_softplus:
        step = F.softplus(step)
    step = step * plan.real.to(u.device)[:, None, :]  # [R, D, L], 0 on padding
    a = A.to(wide)
    runs = len(plan.state.runs)
    maps: list[Tensor | None] = [None] * runs
    if len(plan.cont):
        total = torch.exp(step.sum(-1)[..., None] * a)  # [R, D, N]
        for i in plan.cont.tolist():
            maps[i] = total[i]
    states = incoming_states(
        plan.layout, plan.batch, plan.rank, group, maps, list(ext.unbind(0))[:runs], apply_elementwise,
        map_shape=(d, n), state_shape=(d, n), plan=plan.state, dtype=wide, device=u.device,
    )  # fmt: skip
    fixes = [(i, s) for i, s in enumerate(states) if s is not None]
    if fixes:  # y_t += (sum_n C_t exp(A cumsum dt) S_in) silu(z_t); a zero state on a first run adds zeros
        rows = torch.tensor([i for i, _ in fixes], dtype=torch.long, device=u.device)
        s_in = torch.stack([s for _, s in fixes])  # [F, D, N]
        extra = _correction(step.index_select(0, rows).cumsum(-1), a, cs.index_select(0, rows).to(wide), s_in)
        if zs is not None:
            extra = extra * F.silu(zs.index_select(0, rows).to(wide))
        out = out.index_add(0, rows, extra.to(out.dtype))
    return unstack_runs(out.transpose(1, 2), plan).transpose(1, 2)
