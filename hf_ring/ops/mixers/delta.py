"""The context-parallel form of the gated delta rules (Gated DeltaNet: Qwen3.5, Qwen3-Next, OLMo-Hybrid,
Lara; Kimi Delta Attention with its per-channel gate: Kimi Linear, Bailing hybrid) by state passing.

A delta rule keeps a state ``S [Dk, Dv]`` per value head; each token multiplies it on the left by
``diag(exp(g_t)) (I - beta_t k_t k_t^T)`` (``g_t`` a scalar per head, or per channel for KDA) and
adds ``beta_t k_t v_t^T``; it reads ``o_t = q_t^T S_t``. So a run of tokens turns its incoming
state into ``S_out = M S_in + E`` and its outputs into ``o = o_E + Q_M S_in``, where, from two calls
of the installed rule (fla's kernel on CUDA, transformers' torch fallback otherwise) on the run:

- zero state, the run's values: ``o_E`` and ``E`` (the final state);
- identity state ``I [Dk, Dk]``, zero values: ``Q_M [L, Dk]`` (row ``t``: ``q_t^T M_t``) and ``M``.

``ops.state_passing.incoming_states`` gathers every rank's ``(M, E)`` and composes each run's ``S_in``
over its document in global order; the outputs then take ``Q_M S_in`` (a ``[L, Dk] x [Dk, Dv]``
product per head). Runs that begin a document skip the identity call. Forward and backward are exact
(everything is torch autograd through the rule, the all-gather and the product); communication is
``O(runs x Hv x Dk x (Dk + Dv))`` per layer, whatever the sequence length. This module imports only
torch; the group is passed in.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor

from ..exchange import tie
from ..layout import ShardLayout
from ..state_passing import apply_matrix, incoming_states
from .runs import RunPlan, run_plan, stack_runs, unstack_runs

__all__ = ["DeltaPlan", "delta_plan", "delta_rule"]

Rule = Callable[..., tuple[Tensor, Tensor | None]]
# rule(q [N, L, Hk, Dk], k, v [N, L, Hv, Dv], g, beta, initial_state=[N, Hv, Dk, Dv] | None,
#      output_final_state=True, **options) -> (out [N, L, Hv, Dv], final state [N, Hv, Dk, Dv])


DeltaPlan = RunPlan


def delta_plan(layout: ShardLayout, batch: int, rank: int, device: torch.device | str | None = None) -> RunPlan:
    """The plan of ``delta_rule`` on CP rank ``rank`` for a batch of ``batch`` rows (runs padded
    after their end: zero rows with ``g = beta = 0`` leave the state alone), on ``device``."""
    return run_plan(layout, batch, rank, device=device)


def delta_rule(
    rule: Rule,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    plan: RunPlan,
    group: dist.ProcessGroup | None,
    final_state: bool = False,
    **options,
) -> Tensor | tuple[Tensor, Tensor]:
    """The delta rule over the whole (sharded) sequence, this rank's rows.

    Args:
        rule: the local kernel (see ``Rule``): transformers' ``torch_chunk_gated_delta_rule`` /
            ``chunk_kimi_delta_attention`` or fla's ``chunk_gated_delta_rule`` / ``chunk_kda``.
        q, k: ``[B, S_local, Hk, Dk]``; v: ``[B, S_local, Hv, Dv]`` (``Hv`` a multiple of ``Hk``).
        g: log decay, ``[B, S_local, Hv]`` (Gated DeltaNet) or ``[B, S_local, Hv, Dk]`` (KDA).
        beta: ``[B, S_local, Hv]``.
        plan: ``delta_plan(layout, B, rank)``; group: the layout's CP group.
        final_state: also return the state after each batch row's last run of one sequence per row
            (``[B, Hv, Dk, Dv]``, float32 or wider, the same on every rank: one more all-reduce, not
            differentiable) -- what decoding goes on from (``hf_ring.transformers.decode``).
        options: passed to every rule call (``use_qk_l2norm_in_kernel``, ``chunk_size``, ``scale``).

    Returns ``[B, S_local, Hv, Dv]`` in ``q``'s dtype: each row's output as the rule over its
    document in global order from a zero state (padding rows: zeros); with ``final_state``, the pair
    ``(out, state)``. Collective over ``group`` (one all-gather forward, one all-reduce backward).
    """
    hv, dk = v.shape[2], q.shape[3]
    qs, ks, vs, gs, bs = (stack_runs(t, plan) for t in (q, k, v, g, beta))
    out, ext = rule(qs, ks, vs, gs, bs, initial_state=None, output_final_state=True, **options)
    maps: list[Tensor | None] = [None] * len(plan.state.runs)
    q_map = None
    if plan.cont_runs:
        n = len(plan.cont_runs)
        eye = torch.eye(dk, dtype=torch.float32, device=q.device).expand(n, hv, dk, dk).contiguous()
        zeros = vs.new_zeros((n, plan.length, hv, dk))
        qi, ki, gi, bi = (t.index_select(0, plan.cont) for t in (qs, ks, gs, bs))
        q_map, m = rule(qi, ki, zeros, gi, bi, initial_state=eye, output_final_state=True, **options)
        for j, i in enumerate(plan.cont_runs):
            maps[i] = m[j]
    exts: list[Tensor | None] = list(ext.unbind(0))[: len(plan.state.runs)]
    states = incoming_states(
        plan.layout, plan.batch, plan.rank, group, maps, exts, apply_matrix,
        map_shape=(hv, dk, dk), state_shape=(hv, dk, v.shape[3]), plan=plan.state,
        dtype=torch.promote_types(q.dtype, torch.float32), device=q.device,
    )  # fmt: skip
    if plan.fixed_runs:
        s_in = torch.stack([states[i] for i in plan.fixed_runs])  # type: ignore[misc]  # [F, Hv, Dk, Dv]
        if plan.state.tied:  # a zero state handed to a run that begins its document (see incoming_states)
            out = tie(out, s_in)
        else:
            qm = q_map.index_select(0, plan.fixed_in_cont)  # type: ignore[union-attr]  # [F, L, Hv, Dk]
            extra = torch.einsum("flhk,fhkv->flhv", qm.to(s_in.dtype), s_in)
            out = out.index_add(0, plan.fixed, extra.to(out.dtype))
    if not final_state:
        return unstack_runs(out, plan)
    return unstack_runs(out, plan), _final_states(plan, maps, exts, states, group, q.dtype)


def _final_states(
    plan: RunPlan, maps: list, exts: list, states: list, group: dist.ProcessGroup | None, dtype: torch.dtype
) -> Tensor:
    """``[B, Hv, Dk, Dv]``: the state leaving each row's last run (``M S_in + E`` on the rank that holds
    it, zeros elsewhere), summed over ``group`` so that every rank has every row's."""
    if plan.layout.packed:
        raise ValueError("delta_rule(final_state=True) takes one sequence per batch row, not packed documents")
    shape = next(e for e in exts if e is not None).shape
    final = torch.zeros((plan.batch, *shape), dtype=torch.promote_types(dtype, torch.float32), device=exts[0].device)
    for i, run in enumerate(plan.state.runs):
        if plan.state.sent[i]:  # a later run of its row continues from it: not the last
            continue
        state = exts[i].to(final.dtype)
        if states[i] is not None and maps[i] is not None:
            state = apply_matrix(maps[i].to(final.dtype), states[i].to(final.dtype)) + state
        final[run.row] = state
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(final, group=group)
    return final
