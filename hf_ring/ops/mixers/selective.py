"""The context-parallel form of Mamba's selective scan (Jamba, Zamba; Mamba, Falcon-Mamba) by state
passing.

Per channel ``d`` the scan keeps a state ``S [N]``; each token decays it elementwise and adds a
vector, and reads it with ``C``::

    dt_t = softplus(dt_t + delta_bias)         a_t = exp(dt_t A_d)      (A [D, N] < 0)
    S_t = a_t * S_{t-1} + dt_t x_t B_t         y_t = (S_t . C_t + D_d x_t) * silu(z_t)

So a run maps its incoming state elementwise, ``S_out = m * S_in + E`` with ``m = exp(A sum_t dt_t)``
(``[D, N]``), and its outputs become ``y = y_E + (sum_n C_t exp(A cumsum_t dt) S_in) * silu(z_t)``.
The installed scan (mamba-ssm's ``selective_scan_fn`` on CUDA, transformers' torch scan otherwise)
runs each run from a zero state and gives ``y_E`` only. Everything that carries a state to another
run is torch autograd on the step sizes, ``A``, ``B`` and ``C``: ``m``, the outgoing state
``E = sum_t exp(A (cumsum_L dt - cumsum_t dt)) dt_t x_t B_t`` and the outputs' correction, each in
blocks of rows recomputed in the backward (memory flat in the run's length). So the gradients
through the states are exact whatever the kernel does with its own last state: mamba-ssm 2.2.2 ..
2.3.2.post1 returns one but drops its gradient (``selective_scan_interface.py``, ``backward(ctx,
dout, *args)``), which would lose every cross-run term of du, ddt, dA, dB and delta_bias.
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

Scan = Callable[..., Tensor]
# scan(u [N, D, L], delta [N, D, L], A [D, Ns], B [N, Ns, L], C [N, Ns, L], D=[D] | None, z=[N, D, L] | None,
#      delta_bias=[D] | None, delta_softplus=bool, return_last_state=False) -> y [N, D, L]


def selective_plan(layout: ShardLayout, batch: int, rank: int, device: torch.device | str | None = None) -> RunPlan:
    """The plan of ``selective_scan`` on CP rank ``rank`` (runs padded before their start), on ``device``."""
    return run_plan(layout, batch, rank, left=True, device=device)


def _stack(x: Tensor, plan: RunPlan) -> Tensor:
    """``[B, F, S_local]`` (channels first, the kernel's layout) -> ``[R, F, length]``."""
    return stack_runs(x.transpose(1, 2), plan).transpose(1, 2).contiguous()


def _block(cum: Tensor, c: Tensor, a: Tensor, s_in: Tensor) -> Tensor:
    """``sum_n C_t exp(A cum_t) S_in``: ``cum [F, D, l]``, ``c [F, N, l]``, ``a [D, N]``, ``s_in [F, D, N]``."""
    return torch.einsum("fnl,fdln,fdn->fdl", c, torch.exp(cum[..., None] * a[:, None, :]), s_in)


def _state_block(tail: Tensor, du: Tensor, b: Tensor, a: Tensor) -> Tensor:
    """``sum_t exp(A tail_t) du_t B_t`` (``[F, D, N]``): ``tail`` (the step sizes after row ``t`` to the
    run's end) and ``du`` (``dt x``) ``[F, D, l]``, ``b [F, N, l]``, ``a [D, N]``."""
    return torch.einsum("fdln,fdl,fnl->fdn", torch.exp(tail[..., None] * a[:, None, :]), du, b)


def _blocked(fn: Callable[..., Tensor], rows: tuple[Tensor, ...], a: Tensor, *rest: Tensor, cat: bool,
             budget: int = 1 << 26) -> Tensor:  # fmt: skip
    """``fn(*rows, a, *rest)`` over the rows (last dim) of ``rows`` in blocks whose ``[F, D, rows, N]``
    decay holds at most ``budget`` elements, each recomputed in the backward (memory flat in the run's
    length); the blocks' results concatenated along the rows (``cat``) or summed."""
    f, d, length = rows[0].shape
    step = max(1, budget // max(1, f * d * a.shape[1]))
    if step >= length:
        return fn(*rows, a, *rest)
    parts = []
    for lo in range(0, length, step):
        piece = (*(t[..., lo : lo + step] for t in rows), a, *rest)
        parts.append(checkpoint(fn, *piece, use_reentrant=False) if torch.is_grad_enabled() else fn(*piece))
    return torch.cat(parts, -1) if cat else torch.stack(parts).sum(0)


def _correction(cum: Tensor, c: Tensor, a: Tensor, s_in: Tensor, budget: int = 1 << 26) -> Tensor:
    """``_block`` over the whole run, blocked (``_blocked``): ``[F, D, L]``."""
    return _blocked(_block, (cum, c), a, s_in, cat=True, budget=budget)


def _outgoing(tail: Tensor, du: Tensor, b: Tensor, a: Tensor, budget: int = 1 << 26) -> Tensor:
    """The state leaving each run from a zero state, ``_state_block`` blocked (``_blocked``): ``[F, D, N]``."""
    return _blocked(_state_block, (tail, du, b), a, cat=False, budget=budget)


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
            ``selective_scan_fn``; asked for its outputs only (``return_last_state=False``).
        u, delta: ``[B, D, S_local]`` (``delta`` before bias and softplus); A: ``[D, N]`` (negative);
        B, C: ``[B, N, S_local]``; D: ``[D]``; z: the gate ``[B, D, S_local]``; delta_bias: ``[D]``.
        plan: ``selective_plan(layout, B, rank, device=u.device)``; group: the layout's CP group.
        options: passed to every scan call (transformers' ``use_mambapy``, ...).

    Returns ``[B, D, S_local]`` in the scan's output dtype: each row's output as the scan over its
    document in global order from a zero state (padding rows: zeros). Collective over ``group``
    (one all-gather forward, one all-reduce backward).
    """
    d, n = A.shape
    us, ds, bs, cs = (_stack(t, plan) for t in (u, delta, B, C))
    zs = None if z is None else _stack(z, plan)
    out = scan(us, ds, A, bs, cs, D=D, z=zs, delta_bias=delta_bias, delta_softplus=delta_softplus,
               return_last_state=False, **options)  # fmt: skip
    wide = torch.promote_types(u.dtype, torch.float32)
    step = ds.to(wide)
    if delta_bias is not None:
        step = step + delta_bias.to(wide)[:, None]
    if delta_softplus:
        step = F.softplus(step)
    step = step * plan.real[:, None, :]  # [R, D, L], 0 on padding
    cum = step.cumsum(-1)
    a = A.to(wide)
    runs = len(plan.state.runs)
    maps: list[Tensor | None] = [None] * runs
    exts: list[Tensor | None] = [None] * runs
    if plan.cont_runs:
        total = torch.exp(cum[..., -1:] * a)  # [R, D, N]
        for i in plan.cont_runs:
            maps[i] = total[i]
    if plan.sent_runs:  # E in torch: the kernel's own last state may carry no gradient
        sent = plan.sent
        tail = (cum[..., -1:] - cum).index_select(0, sent)
        du = (step * us.to(wide)).index_select(0, sent)
        ext = _outgoing(tail, du, bs.index_select(0, sent).to(wide), a)  # [S, D, N]
        for j, i in enumerate(plan.sent_runs):
            exts[i] = ext[j]
    states = incoming_states(
        plan.layout, plan.batch, plan.rank, group, maps, exts, apply_elementwise,
        map_shape=(d, n), state_shape=(d, n), plan=plan.state, dtype=wide, device=u.device,
    )  # fmt: skip
    if plan.fixed_runs:  # y_t += (sum_n C_t exp(A cumsum dt) S_in) silu(z_t); a zero state on a first run adds zeros
        rows = plan.fixed
        s_in = torch.stack([states[i] for i in plan.fixed_runs])  # type: ignore[misc]  # [F, D, N]
        extra = _correction(cum.index_select(0, rows), cs.index_select(0, rows).to(wide), a, s_in)
        if zs is not None:
            extra = extra * F.silu(zs.index_select(0, rows).to(wide))
        out = out.index_add(0, rows, extra.to(out.dtype))
    return unstack_runs(out.transpose(1, 2), plan).transpose(1, 2)
