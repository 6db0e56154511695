"""Attention one head group at a time through ``AttentionCall.forward`` / ``backward`` (the two plain
steps the tiled layer runs), wrapped in an autograd Function so that tests can compare it with the
float64 oracle like any other op."""

from __future__ import annotations

import torch
from torch import Tensor

from hf_ring.ops.attention_call import AttentionCall
from hf_ring.ops.ring import head_groups_of


def _sinks_of(sinks: Tensor | None, qs: slice) -> Tensor | None:
    return None if sinks is None else sinks[qs] if sinks.dim() == 1 else sinks[:, :, qs]


class _Grouped(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, call, groups):  # type: ignore[override]
        out = q.new_empty(q.shape)
        states: list[Tensor] = []
        ctx.counts = []
        for qs, ks in head_groups_of(q.shape[2], k.shape[2], groups):
            o, state = call.forward(q[:, :, qs], k[:, :, ks], v[:, :, ks], _sinks_of(sinks, qs))
            out[:, :, qs] = o
            ctx.counts.append(len(state))
            states.extend(state)
        ctx.call, ctx.groups, ctx.has_sinks = call, groups, sinks is not None
        ctx.save_for_backward(q, k, v, out, *(() if sinks is None else (sinks,)), *states)
        return out

    @staticmethod
    def backward(ctx, dout):  # type: ignore[override]
        q, k, v, out, *rest = ctx.saved_tensors
        sinks = rest.pop(0) if ctx.has_sinks else None
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        dsinks = torch.zeros_like(sinks) if sinks is not None and ctx.needs_input_grad[3] else None
        for g, (qs, ks) in enumerate(head_groups_of(q.shape[2], k.shape[2], ctx.groups)):
            n = ctx.counts[g]
            state, rest = tuple(rest[:n]), rest[n:]
            dq_g, dk_g, dv_g, ds = ctx.call.backward(
                dout[:, :, qs], q[:, :, qs], k[:, :, ks], v[:, :, ks], out[:, :, qs], state, _sinks_of(sinks, qs),
                dsinks is not None,
            )  # fmt: skip
            dq[:, :, qs], dk[:, :, ks], dv[:, :, ks] = dq_g, dk_g, dv_g
            if dsinks is not None:
                if dsinks.dim() == 1:
                    dsinks[qs] = ds
                else:
                    dsinks[:, :, qs] = ds
        return dq, dk, dv, dsinks, None, None


def grouped_attention(call: AttentionCall, q: Tensor, k: Tensor, v: Tensor, sinks: Tensor | None = None,
                      groups: int = 1) -> Tensor:  # fmt: skip
    """``call``'s attention of ``q [B, S, Hq, D]`` over ``k, v [B, S, Hkv, D]``, ``groups`` head groups one
    after the other through ``call.forward`` / ``call.backward``; differentiable in q, k, v and sinks."""
    return _Grouped.apply(q, k, v, sinks, call, groups)
