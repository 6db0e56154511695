"""One layer's attention under context parallelism, as data: the route and every option of the call.

``AttentionCall`` holds what the transformers glue resolves once per layer call (the ring's group, the
Ulysses group, the packed-document schedule or the window's ``MaskPlan``, the scale, the soft-cap, the
kernel, the head groups) and runs it two ways:

- ``call(q, k, v, sinks)``: the differentiable ops (``ring_attention``, ``masked_attention``,
  ``ulysses_ring_attention``), as the attention function of ``attn_implementation="ring"`` does;
- ``call.forward(q, k, v, sinks) -> (out, state)`` and ``call.backward(dout, q, k, v, out, state, sinks)``:
  the same computation as two plain steps, no autograd, for a caller that decides itself what to keep
  in between -- the tiled layer (``ops.tiled_layer``) keeps only ``out`` and the float32 log-sum-exp of
  each head group (``state``), and makes q, k and v again from the layer's input in backward. The ring
  (and the border exchange, and the Ulysses all-to-alls) turn in each step exactly as in the ops; the
  Ulysses all-to-all of q, k, v and out runs again in backward (its bytes are counted by the planner).

Shapes as the ops': ``q [B, S, Hq, D]``, ``k, v [B, S, Hkv, D]``, this rank's rows. This module imports
only torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch.distributed as dist
from torch import Tensor

from .checks import check_extras
from .comm import Ring
from .kernels import BlockKernel
from .ring import _kernel, ring_attention, ring_backward, ring_forward
from .schedule import Schedule, make_schedule
from .ulysses import (
    _NoRing,
    from_heads_grads,
    heads_to_rows,
    rows_to_heads,
    to_heads,
    ulysses_ring_attention,
)
from .windows import MaskPlan, border_backward, border_forward, masked_attention

__all__ = ["AttentionCall"]

State = tuple[Tensor, ...]


@dataclass(frozen=True, eq=False)
class AttentionCall:
    """One attention call of a layer over a sharded sequence.

    ``group``: the ring's process group (the CP group; with Ulysses the ring group, ``None`` there for a
    ring of one); ``ring``: a ``Ring`` instead (benchmarks). ``ulysses_group``: the Ulysses group
    (``None``: no Ulysses). ``schedule``: packed documents' ring schedule (``None``: the zigzag);
    ``plan``: a window's or chunk's ``MaskPlan`` instead. ``scale``: ``None`` is ``1 / sqrt(D)``.
    ``head_groups``: passed to the ops by ``__call__`` (``forward``/``backward`` run the heads they are
    given: the caller loops over groups)."""

    group: dist.ProcessGroup | None = None
    ring: Ring | None = None
    ulysses_group: dist.ProcessGroup | None = None
    causal: bool = True
    scale: float | None = None
    schedule: Schedule | None = None
    plan: MaskPlan | None = None
    softcap: float | None = None
    backend: str | BlockKernel = "auto"
    head_groups: int = 1
    ulysses: bool = False

    # --- with autograd: the ops ----------------------------------------------------------------------

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, sinks: Tensor | None = None) -> Tensor:
        """``[B, S, Hq, D]``, differentiable in ``q``, ``k``, ``v`` (and ``sinks``)."""
        opts = dict(softmax_scale=self.scale, softcap=self.softcap, sinks=sinks, backend=self.backend,
                    head_groups=self.head_groups)  # fmt: skip
        if self.ulysses:
            return ulysses_ring_attention(
                q, k, v, ulysses_group=self.ulysses_group, ring_group=self.group, ring=self.ring, causal=self.causal,
                schedule=self.schedule if self.plan is None else None, mask=self.plan, **opts,
            )  # fmt: skip
        if self.plan is not None:
            return masked_attention(q, k, v, self.plan, group=self.group, ring=self.ring, **opts)
        return ring_attention(q, k, v, group=self.group, ring=self.ring, causal=self.causal, schedule=self.schedule,
                              **opts)  # fmt: skip

    # --- two plain steps -----------------------------------------------------------------------------

    def _ring(self) -> Ring:
        if self.ring is not None:
            return self.ring
        if self.ulysses and self.group is None:
            return _NoRing()  # type: ignore[return-value]
        return Ring(self.group)

    def _route(self, q: Tensor) -> tuple[str, Schedule, BlockKernel, float, float, Ring]:
        """``(route, steps, kernel, scale, cap, ring)`` of the ring level for ``q`` (after any all-to-all)."""
        ring = self._ring()
        cap = check_extras(q, self.softcap, None, "AttentionCall")
        scale = self.scale if self.scale is not None else 1.0 / math.sqrt(q.shape[3])
        if self.plan is not None and self.plan.route == "border":
            steps: Schedule = [self.plan.blocks]
            return "border", steps, _kernel(self.backend, q, cap, steps, "AttentionCall"), scale, cap, ring
        if self.plan is not None:
            steps = self.plan.schedule  # type: ignore[assignment]
        elif self.schedule is not None:
            steps = self.schedule
        else:
            steps = make_schedule("zigzag", self.causal, ring.rank, ring.size)
        return "ring", steps, _kernel(self.backend, q, cap, steps, "AttentionCall"), scale, cap, ring

    def _inner_forward(self, q: Tensor, k: Tensor, v: Tensor, sinks: Tensor | None) -> tuple[Tensor, State]:
        route, steps, kernel, scale, cap, ring = self._route(q)
        if route == "border":
            return border_forward(q, k, v, self.plan, ring.group, scale, kernel, sinks, cap)  # type: ignore[arg-type]
        out, lse = ring_forward(q, k, v, scale, steps, kernel, ring, sinks, cap)
        return out, (lse,)

    def _inner_backward(
        self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, state: State, sinks: Tensor | None,
        sinks_grad: bool,
    ) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:  # fmt: skip
        route, steps, kernel, scale, cap, ring = self._route(q)
        if route == "border":
            return border_backward(dout, q, k, v, out, state, self.plan, ring.group, scale, kernel, sinks, cap,  # type: ignore[arg-type]
                                   sinks_grad)  # fmt: skip
        return ring_backward(dout, q, k, v, out, state[0], scale, steps, kernel, ring, sinks, cap, sinks_grad)

    def forward(self, q: Tensor, k: Tensor, v: Tensor, sinks: Tensor | None = None) -> tuple[Tensor, State]:
        """``(out [B, S, Hq, D] in q's dtype, state)``, no autograd: ``state`` is what ``backward`` needs
        besides the inputs and ``out`` (the float32 log-sum-exp; on the border route also the fetched
        rows; under Ulysses in the all-to-all's layout). Collective over the call's groups."""
        if not self.ulysses:
            return self._inner_forward(q, k, v, sinks)
        ql, kl, vl, sl = to_heads(q, k, v, sinks, self.ulysses_group)
        out, state = self._inner_forward(ql, kl, vl, sl)
        del ql, kl, vl
        return heads_to_rows(out, self.ulysses_group), state

    def backward(
        self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, state: State,
        sinks: Tensor | None = None, sinks_grad: bool = False,
    ) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:  # fmt: skip
        """``(dq, dk, dv, dsinks)`` of ``forward`` (its ``out`` and ``state``; ``dsinks`` None unless
        ``sinks_grad``), no autograd. Collective over the call's groups."""
        if not self.ulysses:
            return self._inner_backward(dout, q, k, v, out, state, sinks, sinks_grad)
        ql, kl, vl, sl = to_heads(q, k, v, sinks, self.ulysses_group)
        out_l, dout_l = rows_to_heads(out, self.ulysses_group), rows_to_heads(dout, self.ulysses_group)
        dql, dkl, dvl, dsl = self._inner_backward(dout_l, ql, kl, vl, out_l, state, sl, sinks_grad)
        del ql, kl, vl, out_l, dout_l
        dq, dk, dv = from_heads_grads(dql, dkl, dvl, k.shape[2], self.ulysses_group)
        dsinks = None
        if dsl is not None and sinks is not None and sinks.dim() == 1:  # this rank's heads' share
            u = dist.get_rank(self.ulysses_group) if dist.is_initialized() else 0
            dsinks = sinks.new_zeros(sinks.shape)
            dsinks.view(-1, dsl.shape[0])[u] = dsl
        elif dsl is not None:
            dsinks = heads_to_rows(dsl, self.ulysses_group)
        return dq, dk, dv, dsinks
