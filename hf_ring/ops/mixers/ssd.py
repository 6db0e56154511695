"""The context-parallel form of Mamba2's state space duality (SSD) scan (Nemotron-H, Granite 4 hybrid,
Bamba, Falcon-H1, Zamba2, Mamba2) by state passing.

Per head ``h`` the scan keeps a state ``S [P, N]`` (head dim x state size); each token decays it by a
scalar and adds an outer product, and reads it with ``C``::

    dt_t = clamp(softplus(dt_t + dt_bias))         a_t = exp(dt_t A_h)       (A_h < 0)
    S_t = a_t S_{t-1} + dt_t x_t B_t^T             y_t = S_t C_t + D_h x_t

So a run of tokens maps its incoming state by one scalar per head, ``S_out = m S_in + E`` with
``m = prod_t a_t``, and its outputs become ``y = y_E + exp(cumsum_t log a_t) (S_in C_t)``. The
installed scan (mamba-ssm's ``mamba_chunk_scan_combined`` on CUDA, transformers' torch chunk scan
otherwise) runs each run from a zero state, giving ``y_E`` and ``E``; ``m`` and the outputs'
correction are a few torch ops on the step sizes and ``C``. ``ops.state_passing.incoming_states``
gathers every rank's ``(m, E)`` and composes each run's ``S_in`` over its document in global order.
Runs are stacked with padding before them (``runs.run_plan(left=True)``): a zero row still decays
the state, and a zero state decayed stays zero.

Forward and backward are exact (torch autograd through the scan, the all-gather and the
correction); communication is ``O(runs x H x P x N)`` per layer, whatever the sequence length. This
module imports only torch; the group is passed in.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from ..layout import ShardLayout
from ..state_passing import apply_scalar, incoming_states
from .runs import RunPlan, run_plan, stack_runs, unstack_runs

__all__ = ["ssd_plan", "ssd_scan", "step_sizes", "torch_ssd_scan"]

Scan = Callable[..., tuple[Tensor, Tensor]]
# scan(x [N, L, H, P], dt [N, L, H], A [H], B [N, L, G, Nst], C [N, L, G, Nst], chunk_size, D=[H] | None,
#      dt_bias=[H] | None, initial_states=None, dt_softplus=bool, dt_limit=(lo, hi),
#      return_final_states=True) -> (y [N, L, H, P], final state [N, H, P, Nst])


def ssd_plan(layout: ShardLayout, batch: int, rank: int, device: torch.device | str | None = None) -> RunPlan:
    """The plan of ``ssd_scan`` on CP rank ``rank`` (runs padded before their start), on ``device``."""
    return run_plan(layout, batch, rank, left=True, device=device)


def step_sizes(dt: Tensor, dt_bias: Tensor | None, softplus: bool, limit: tuple[float, float]) -> Tensor:
    """The scan's step sizes ``clamp(softplus(dt + dt_bias), *limit)`` (``[..., H]``) in float32 or
    wider, as the kernels and transformers' fallback compute them."""
    dt = dt.to(torch.promote_types(dt.dtype, torch.float32))
    if dt_bias is not None:
        dt = dt + dt_bias.to(dt.dtype)
    if softplus:
        dt = F.softplus(dt)
    return torch.clamp(dt, min=limit[0], max=limit[1])


def torch_ssd_scan(
    x: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    chunk_size: int,
    D: Tensor | None = None,
    dt_bias: Tensor | None = None,
    initial_states: Tensor | None = None,
    dt_softplus: bool = False,
    dt_limit: tuple[float, float] = (0.0, math.inf),
    return_final_states: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """The SSD scan in torch, chunk by chunk, in float32 or the inputs' wider dtype (the ``Scan``
    contract; for mixers whose model has no scan function of its own, e.g. lightning attention).

    Within a chunk ``y_i = sum_{j <= i} exp(l_i - l_j) (C_i . B_j) dt_j x_j + exp(l_i) S C_i``
    (``l``: the cumulative log decay in the chunk, ``S``: the state entering it). Returns ``y [N, L,
    H, P]`` in the wide dtype, and the final state ``[N, H, P, Nst]`` if ``return_final_states``."""
    wide = torch.promote_types(x.dtype, torch.float32)
    batch, length, h, p = x.shape
    step = step_sizes(dt, dt_bias, dt_softplus, dt_limit)  # [N, L, H]
    log_a = step * A.to(wide)
    xs = x.to(wide) * step[..., None]
    b_ = B.to(wide).repeat_interleave(h // B.shape[2], dim=2)
    c_ = C.to(wide).repeat_interleave(h // C.shape[2], dim=2)
    state = (x.new_zeros((batch, h, p, B.shape[3]), dtype=wide) if initial_states is None
             else initial_states.to(wide))  # fmt: skip
    outs = []
    for lo in range(0, length, chunk_size):
        part = slice(lo, lo + chunk_size)
        cum = log_a[:, part].cumsum(1)  # [N, l, H]
        n = cum.shape[1]
        causal = torch.ones(n, n, dtype=torch.bool, device=x.device).tril()[None, :, :, None]
        weight = torch.exp((cum[:, :, None] - cum[:, None, :]).masked_fill(~causal, -math.inf))  # [N, i, j, H]
        weight = weight * torch.einsum("bihn,bjhn->bijh", c_[:, part], b_[:, part])
        y = torch.einsum("bijh,bjhp->bihp", weight, xs[:, part])
        y = y + torch.exp(cum)[..., None] * torch.einsum("bihn,bhpn->bihp", c_[:, part], state)
        tail = torch.exp(cum[:, -1:] - cum)  # [N, l, H]: decay from each row to the chunk's end
        state = torch.exp(cum[:, -1])[..., None, None] * state + torch.einsum(
            "bjh,bjhn,bjhp->bhpn", tail, b_[:, part], xs[:, part]
        )
        outs.append(y)
    out = torch.cat(outs, 1) if outs else x.new_zeros((batch, 0, h, p), dtype=wide)
    if D is not None:
        out = out + x.to(wide) * D.to(wide)[:, None]
    return (out, state) if return_final_states else out


def ssd_scan(
    scan: Scan,
    x: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    plan: RunPlan,
    group: dist.ProcessGroup | None,
    *,
    chunk_size: int,
    D: Tensor | None = None,
    dt_bias: Tensor | None = None,
    dt_softplus: bool = False,
    dt_limit: tuple[float, float] = (0.0, math.inf),
) -> Tensor:
    """The SSD scan over the whole (sharded) sequence, this rank's rows.

    Args:
        scan: the local kernel (see ``Scan``): transformers' ``mamba2_chunk_scan`` or mamba-ssm's
            ``mamba_chunk_scan_combined``.
        x: ``[B, S_local, H, P]``; dt: ``[B, S_local, H]`` (before bias, softplus and limit);
        A: ``[H]`` (negative); B, C: ``[B, S_local, G, N]`` (``H`` a multiple of ``G``);
        plan: ``ssd_plan(layout, B, rank)``; group: the layout's CP group.
        chunk_size, D, dt_bias, dt_softplus, dt_limit: passed to the scan (``D``: ``[H]``).

    Returns ``[B, S_local, H, P]`` in the scan's output dtype: each row's output as the scan over its
    document in global order from a zero state (padding rows: zeros). Collective over ``group``
    (one all-gather forward, one all-reduce backward).
    """
    h, p, g, n = x.shape[2], x.shape[3], B.shape[2], B.shape[3]
    xs, dts, bs, cs = (stack_runs(t, plan) for t in (x, dt, B, C))
    out, ext = scan(xs, dts, A, bs, cs, chunk_size, D=D, dt_bias=dt_bias, initial_states=None,
                    dt_softplus=dt_softplus, dt_limit=dt_limit, return_final_states=True)  # fmt: skip
    wide = torch.promote_types(x.dtype, torch.float32)
    real = plan.real[..., None]  # [R, L, 1]
    log_decay = step_sizes(dts, dt_bias, dt_softplus, dt_limit) * A.to(wide) * real  # [R, L, H], 0 on padding
    runs = len(plan.state.runs)
    maps: list[Tensor | None] = [None] * runs
    if plan.cont_runs:
        total = log_decay.sum(1).exp()  # [R, H]
        for i in plan.cont_runs:
            maps[i] = total[i]
    states = incoming_states(
        plan.layout, plan.batch, plan.rank, group, maps, list(ext.unbind(0))[:runs], apply_scalar,
        map_shape=(h,), state_shape=(h, p, n), plan=plan.state, dtype=wide, device=x.device,
    )  # fmt: skip
    if plan.fixed_runs:  # y_t += exp(cumsum log a)_t (S_in C_t); a zero state on a first run adds zeros
        s_in = torch.stack([states[i] for i in plan.fixed_runs])  # type: ignore[misc]  # [F, H, P, N]
        decay = log_decay.index_select(0, plan.fixed).cumsum(1).exp()  # [F, L, H]
        c = cs.index_select(0, plan.fixed).to(wide).repeat_interleave(h // g, dim=2)  # [F, L, H, N]
        extra = torch.einsum("flhn,fhpn->flhp", c, s_in) * decay[..., None]
        out = out.index_add(0, plan.fixed, extra.to(out.dtype))
    return unstack_runs(out, plan)
