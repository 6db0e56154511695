"""Layer masks over a sharded sequence, exact: sliding windows and chunked attention.

A sliding window of ``W`` keys lets query ``i`` see keys ``i - W < j <= i`` of its own document
(transformers' ``sliding_window_causal_mask_function``; flash-attn's ``window_size=(W - 1, 0)``).
Chunked attention (Llama 4) lets it see the earlier keys of its own chunk of ``C`` positions,
counted from the document's start (positions do not restart at a chunk). Both run on the batch's
layout (``ShardLayout``, ring level: the rows a ring position holds) by one of two routes, which
``mask_plan`` picks from the layout alone (every rank picks the same):

- **border** (the mask reaches back ``R = W - 1`` or ``C - 1`` rows, at most a zigzag chunk): the
  ring does not turn. Each rank fetches the ``R`` rows of K/V that precede each run of its rows
  (``exchange.halo_plan``: one all-to-all, its backward sends dK/dV of those rows home), lays each
  run's fetched rows right before its own (``MaskPlan.kv_rows``: one copy), and attends locally: one
  band over each run and the rows before it, all with the window ``(W - 1, 0)`` (a flash-attn varlen
  kernel takes a rank's whole layer in one call).
  Communication is ``O(R)`` rows per run, flat in the sequence length::

      P = 2, chunks c0 c1 c2 c3, W - 1 <= |chunk|: rank 0 holds [c0 | c3], rank 1 [c1 | c2]
      rank 0 fetches the last W - 1 rows of c2 (for c3); rank 1 those of c0 (c1) and c1 (c2)

- **ring** (longer reach): the zigzag ring with the schedule cut to the mask (``placement_schedule``
  with ``window``; chunked attention is the layout cut at the chunk boundaries,
  ``placement.chunk_placement``): blocks outside the band make no call, blocks across its edge carry
  it to the kernel, and the ring stops after the last step in which some rank has a call.

This module imports only torch.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor

from .checks import check_extras, check_qkv
from .comm import Ring
from .exchange import Halo, fetch_backward, fetch_forward, halo_plan, tie
from .kernels import BlockKernel
from .layout import ShardLayout
from .placement import Placement, chunk_placement
from .ring import block_attention, ring_attention, ring_backward, ring_forward
from .schedule import Block, Schedule, band_blocks, band_schedule, placement_schedule, trim_steps

__all__ = [
    "WINDOW_ROUTES",
    "MaskPlan",
    "border_backward",
    "border_forward",
    "mask_plan",
    "masked_attention",
    "ring_level",
]

WINDOW_ROUTES = ("auto", "border", "ring")


@dataclass(frozen=True, eq=False)
class MaskPlan:
    """How one ring position computes a masked layer for one batch (``mask_plan``).

    ``route``: ``"ring"`` (``schedule``: the ring steps) or ``"border"`` (``halo``: the rows fetched
    before each run; ``blocks``: the local calls, query rows of the ``[B * S]`` local rows, key rows of
    the K/V laid out by ``kv_rows``). ``window``/``chunk``: the mask it computes.
    """

    window: int | None
    chunk: int | None
    route: str
    schedule: Schedule | None = None
    halo: Halo | None = None
    blocks: tuple[Block, ...] = ()
    kv_dst: Tensor | None = None  # border: where each of the [B * S] local then [M] fetched rows goes
    _on_device: dict = field(default_factory=dict, repr=False)

    def _dst(self, device: torch.device) -> Tensor:
        assert self.kv_dst is not None
        dst = self._on_device.get(device)
        if dst is None:  # once per batch (the plan is cached per batch) and device
            dst = self._on_device[device] = self.kv_dst.to(device)
        return dst

    def kv_rows(self, local: Tensor, fetched: Tensor) -> Tensor:
        """The border route's key rows ``[B * S + M, *F]``: each run's fetched rows right before its own
        (``local [B * S, *F]``, ``fetched [M, *F]``), rows of no run (padding) at the end; one copy,
        differentiable in both."""
        dst = self._dst(local.device)
        n = local.shape[0]
        rows = local.new_empty(n + fetched.shape[0], *local.shape[1:])
        return rows.index_copy_(0, dst[:n], local).index_copy_(0, dst[n:], fetched)

    def kv_rows_grad(self, grad: Tensor, n: int) -> tuple[Tensor, Tensor]:
        """The gradient of ``kv_rows`` (``grad [B * S + M, *F]``): that of the ``n`` local rows and of the
        fetched ones."""
        dst = self._dst(grad.device)
        return grad[dst[:n]], grad[dst[n:]]

    @property
    def sent_rows(self) -> int:
        """K/V rows this rank sends to other ranks per forward on the border route (the backward
        sends as many rows of dK/dV back); 0 on the ring route (see ``schedule``)."""
        return self.halo.plan.sent_rows if self.halo is not None else 0


def ring_level(layout: ShardLayout) -> ShardLayout:
    """``layout`` as the ring sees it: ``R`` ranks, each with its ring position's whole shard (what
    the Ulysses all-to-all gathers: the ``U`` pieces end to end)."""
    if layout.ulysses == 1:
        return layout
    return dataclasses.replace(layout, ulysses=1, local=layout.local * layout.ulysses)


def _chunked(layout: ShardLayout, chunk: int) -> ShardLayout:
    """``layout`` (ring level) with every document cut into pieces of ``chunk`` positions."""
    if layout.spans:
        raise ValueError(
            "mask_plan: chunked attention over a batch with bidirectional spans (token_type_ids of image "
            "tokens) is not computed; run without the spans or without context parallelism"
        )
    rows, starts = [], []
    for i, row in enumerate(layout.rows):
        cut, pieces = chunk_placement(row, list(layout.starts[i if len(layout.starts) > 1 else 0]), chunk)
        rows.append(cut)
        starts.append(tuple(pieces))
    return ShardLayout(layout.n, layout.ring, 1, layout.local, tuple(rows), tuple(starts), layout.packed)


def _ring_schedule(rows: tuple[Placement, ...], rank: int, window: int | None) -> Schedule:
    size = len(rows[0])

    def one(placement: Placement, r: int, batch: tuple[int, int] | None) -> Schedule:
        if window is not None:
            return band_schedule(placement, r, batch, window)
        return placement_schedule(placement, r, batch)

    every = []
    for r in range(size):
        if len(rows) == 1:
            every.append(one(rows[0], r, None))
            continue
        per_row = [one(placement, r, (i, i + 1)) for i, placement in enumerate(rows)]
        every.append([tuple(b for row in per_row for b in row[s]) for s in range(size)])
    return trim_steps(every)[rank]


def mask_plan(
    layout: ShardLayout,
    batch: int,
    ring_pos: int,
    *,
    window: int | None = None,
    chunk: int | None = None,
    route: str = "auto",
) -> MaskPlan:
    """The plan of ring position ``ring_pos`` for a layer with a sliding ``window`` (keys
    ``i - W < j <= i``) and/or attention ``chunk``s, over ``batch`` rows laid out as ``layout``
    (``hf_ring.shard_batch``'s; with Ulysses, the plan is over the ring level).

    ``route="auto"``: ``"border"`` when the mask reaches back at most one zigzag chunk
    (``min(W, C) - 1 <= S_ring / 2``), there is a ring and no bidirectional span (``layout.spans``),
    else ``"ring"``. Computed once per batch and mask (``RingContext.cached``); every rank derives the
    same route.
    """
    if route not in WINDOW_ROUTES:
        raise ValueError(f"mask_plan: unknown route {route!r}; choose one of {WINDOW_ROUTES}")
    for name, w in (("window", window), ("chunk", chunk)):
        if w is not None and (not isinstance(w, int) or w < 1):
            raise ValueError(f"mask_plan: {name} must be a positive int or None, got {w!r}")
    lay = ring_level(layout)
    if chunk is not None:
        lay = _chunked(lay, chunk)
    reach = min((w - 1 for w in (window, chunk) if w is not None), default=None)
    if route == "auto":
        border = reach is not None and lay.ring > 1 and reach <= lay.local // 2 and not lay.spans
        route = "border" if border else "ring"
    if route == "ring":
        return MaskPlan(window, chunk, "ring", schedule=_ring_schedule(lay.rows, ring_pos, window))
    if reach is None:
        raise ValueError("mask_plan: the border route needs a window or a chunk")
    if lay.spans:  # its halo holds the rows before a run only; a span's rows also see the rows after them
        raise ValueError("mask_plan: the border route does not take bidirectional spans; use route='ring'")
    halo = halo_plan(lay, batch, ring_pos, reach)
    n = batch * lay.local
    dst = torch.full((n + halo.offsets[-1],), -1, dtype=torch.long)
    blocks, pos = [], 0
    for i, run in enumerate(halo.runs):  # run i's keys: its fetched rows, then its own, contiguous
        flat = run.row * lay.local + run.local
        fetched = halo.offsets[i + 1] - halo.offsets[i]
        dst[n + halo.offsets[i] : n + halo.offsets[i + 1]] = torch.arange(pos, pos + fetched)
        dst[flat : flat + run.length] = torch.arange(pos + fetched, pos + fetched + run.length)
        q, k = (run.start, run.start + run.length), (run.start - fetched, run.start + run.length)
        blocks += band_blocks(q, k, flat, pos, window)
        pos += fetched + run.length
    rest = dst < 0  # rows of no run (padding): after every run's
    dst[rest] = torch.arange(pos, pos + int(rest.sum()))
    return MaskPlan(window, chunk, "border", halo=halo, blocks=tuple(blocks), kv_dst=dst)


def masked_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    plan: MaskPlan,
    *,
    group: dist.ProcessGroup | None = None,
    ring: Ring | None = None,
    softmax_scale: float | None = None,
    backend: str | BlockKernel = "auto",
    softcap: float | None = None,
    sinks: Tensor | None = None,
    head_groups: int = 1,
) -> Tensor:
    """Attention of this rank's rows under ``plan``'s mask (``mask_plan`` of this ring position).

    ``q: [B, S, Hq, D]``, ``k, v: [B, S, Hkv, D]``: this ring position's rows (with Ulysses: after
    the all-to-all). ``group``/``ring``: the ring (group) the plan was made for. ``softcap`` and
    ``sinks`` (``[Hq]`` or ``[B, S, Hq]``) as for ``ring_attention``, on either route: the cap goes to
    every block kernel call, the sinks join each row's merged softmax once; ``head_groups`` as for
    ``ring_attention`` (on the border route the kernel calls and their accumulators go one head group at
    a time; the fetched border rows are few). Returns ``[B, S, Hq, D]``
    in ``q``'s dtype, differentiable in ``q``, ``k``, ``v`` (and ``sinks``); collective over the ring
    on either route.
    """
    if ring is None:
        ring = Ring(group)
    elif group is not None:
        raise ValueError("masked_attention: pass group or ring, not both")
    if plan.route == "ring":
        return ring_attention(
            q, k, v, ring=ring, softmax_scale=softmax_scale, backend=backend, schedule=plan.schedule,
            softcap=softcap, sinks=sinks, head_groups=head_groups,
        )  # fmt: skip
    check_qkv(q, k, v, "masked_attention")
    check_extras(q, softcap, sinks, "masked_attention")
    assert plan.halo is not None
    b, s, hq, d = q.shape
    if sinks is not None and sinks.dim() == 3:
        sinks = sinks.reshape(1, b * s, hq)  # per-row sinks follow the rows into the one flat block
    kv = torch.cat((k, v), dim=-1)  # [B, S, Hkv, 2D]: K and V rows travel together
    got = plan.halo.fetch(kv, ring.group)  # [M, Hkv, 2D]
    rows = plan.kv_rows(kv.reshape(b * s, *kv.shape[2:]), got)[None]  # [1, B * S + M, Hkv, 2D]
    out = block_attention(
        q.reshape(1, b * s, hq, d), rows[..., :d], rows[..., d:], plan.blocks, softmax_scale=softmax_scale,
        backend=backend, softcap=softcap, sinks=sinks, head_groups=head_groups,
    )  # fmt: skip
    return tie(out, got).view(b, s, hq, d)  # every rank runs the fetch's backward


def _flat_sinks(sinks: Tensor | None, b: int, s: int) -> Tensor | None:
    """Per-row sinks ``[B, S, Hq]`` follow the rows into the one flat block ``[1, B * S, Hq]``."""
    return sinks.reshape(1, b * s, sinks.shape[2]) if sinks is not None and sinks.dim() == 3 else sinks


def border_forward(
    q: Tensor, k: Tensor, v: Tensor, plan: MaskPlan, group: dist.ProcessGroup | None, scale: float,
    kernel: BlockKernel, sinks: Tensor | None = None, cap: float = 0.0,
) -> tuple[Tensor, tuple[Tensor, Tensor]]:  # fmt: skip
    """The border route of ``masked_attention`` without autograd: ``out [B, S, Hq, D]`` and what
    ``border_backward`` needs besides the inputs: the float32 log-sum-exp ``[B, S, Hq]`` and the fetched
    border rows ``[M, Hkv, 2D]`` (``W - 1`` per run: a few; kept so that backward fetches nothing again).
    Collective over ``group``."""
    assert plan.halo is not None
    b, s, hq, d = q.shape
    kv = torch.cat((k, v), dim=-1)  # [B, S, Hkv, 2D]: K and V rows travel together
    flat = kv.reshape(b * s, *kv.shape[2:])
    got = fetch_forward(flat, plan.halo.plan, group)
    rows = plan.kv_rows(flat, got)[None]  # [1, B * S + M, Hkv, 2D]
    del kv, flat
    out, lse = ring_forward(q.reshape(1, b * s, hq, d), rows[..., :d], rows[..., d:], scale, [plan.blocks], kernel,
                            None, _flat_sinks(sinks, b, s), cap)  # fmt: skip
    return out.view(b, s, hq, d), (lse.view(b, s, hq), got)


def border_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, state: tuple[Tensor, Tensor], plan: MaskPlan,
    group: dist.ProcessGroup | None, scale: float, kernel: BlockKernel, sinks: Tensor | None = None,
    cap: float = 0.0, sinks_grad: bool = False,
) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:  # fmt: skip
    """The gradients ``(dq, dk, dv, dsinks)`` of ``border_forward`` (its ``out`` and ``state``): the block
    kernels' backward over the same rows, and the fetched rows' dK/dV sent home (one exchange, collective)."""
    assert plan.halo is not None
    lse, got = state
    b, s, hq, d = q.shape
    kv = torch.cat((k, v), dim=-1)
    n = b * s
    rows = plan.kv_rows(kv.reshape(n, *kv.shape[2:]), got)[None]
    del kv
    dq, dk_r, dv_r, dsinks = ring_backward(
        dout.reshape(1, n, hq, d), q.reshape(1, n, hq, d), rows[..., :d], rows[..., d:], out.reshape(1, n, hq, d),
        lse.reshape(1, n, hq), scale, [plan.blocks], kernel, None, _flat_sinks(sinks, b, s), cap, sinks_grad,
    )  # fmt: skip
    del rows
    d_local, d_got = plan.kv_rows_grad(torch.cat((dk_r, dv_r), dim=-1)[0], n)
    d_local = d_local + fetch_backward(d_got, plan.halo.plan, group, n)
    dk, dv = d_local.view(b, s, -1, 2 * d).split(d, dim=-1)
    if dsinks is not None and dsinks.dim() == 3:
        dsinks = dsinks.view(b, s, hq)
    return dq.view(b, s, hq, d), dk, dv, dsinks
