"""Every band block of a mask plan against the mask flash-attn really applies to it (``flash_rules``).

``survey(...)`` builds random packed layouts (and single sequences; with Ulysses too), plans sliding
windows on both routes for every ring position, and counts the kernel calls whose mask flash-attn
would compute differently from the block's own (``Block.window`` / ``causal``: the ``BlockKernel``
contract, ``hf_ring.ops.kernels.band_mask``), row by row: dense calls (``mha_fwd`` / ``mha_bwd``), and the
varlen calls the ring makes of a step's blocks for a varlen kernel (``mha_varlen_fwd`` /
``mha_varlen_bwd``: clamps against the call's ``max_seqlen_k``).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

import torch

from hf_ring.ops.layout import ShardLayout, sequence_layout
from hf_ring.ops.placement import balanced_placement
from hf_ring.ops.schedule import Block
from hf_ring.ops.windows import MaskPlan, mask_plan, ring_level
from testkit.flash_rules import flash_limits, flash_window

__all__ = ["Survey", "block_mismatch", "packed_layout", "plan_blocks", "survey"]


def packed_layout(docs: list[list[int]], ring: int, ulysses: int = 1) -> ShardLayout:
    """What ``shard_batch`` lays out for packed rows (document lengths per batch row, equal sums): the
    per-document zigzag over the ring positions, each position's rows cut into ``ulysses`` pieces."""
    n = sum(docs[0])
    starts = [[sum(d[:i]) for i in range(len(d))] for d in docs]
    placements = [balanced_placement(s, n, ring) for s in starts]
    local = -(-max(length for _, length in placements) // ulysses) * ulysses
    return ShardLayout(
        n, ring, ulysses, local // ulysses, tuple(x for x, _ in placements), tuple(map(tuple, starts)), True
    )


def intended(b: Block, sq: int, sk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per query row, the keys ``lo <= j < hi`` the block asks its kernel for (the ``BlockKernel``
    contract: causal top-left, ``j <= i``; a band ``-left <= j - i - (Sk - Sq) <= right``, as
    ``hf_ring.ops.kernels.band_mask``)."""
    row = torch.arange(sq)
    lo, hi = torch.zeros(sq, dtype=torch.long), torch.full((sq,), sk, dtype=torch.long)
    if b.window is not None:
        lo = torch.clamp(row + sk - sq - b.window[0], min=0)
        hi = torch.clamp(row + sk - sq + b.window[1] + 1, max=sk)
    if b.causal:
        hi = torch.minimum(hi, row + 1)
    return lo, hi


def block_mismatch(
    b: Block, n: int, entry: str = "fwd", max_q: int | None = None, max_k: int | None = None, call: Any = None
) -> int:
    """Query rows of block ``b`` (over ``n`` local rows) whose keys flash-attn's ``entry`` masks differently
    from the block's own mask (``max_q/max_k``: the ``max_seqlen`` of the varlen call it is part of;
    ``call``: that call, whose ``causal`` and ``window`` flash-attn applies)."""
    qs, ks = b.rows(b.q, n), b.rows(b.kv, n)
    sq, sk = qs.stop - qs.start, ks.stop - ks.start
    causal, window = (call.causal, call.window) if call is not None else (b.causal, b.window)
    left, right = window if window is not None else (-1, -1)
    lo, hi = flash_limits(sq, sk, flash_window(causal, left, right, max_q or sq, max_k or sk, entry))
    want_lo, want_hi = intended(b, sq, sk)
    empty, want_empty = lo >= hi, want_lo >= want_hi
    differ = (empty != want_empty) | (~empty & ((lo != want_lo) | (hi != want_hi)))
    return int(differ.sum())


def plan_blocks(plan: MaskPlan) -> list[tuple[int, Block]]:
    """``(ring step, block)`` of every kernel call of a plan (the border route: step 0)."""
    if plan.route == "border":
        return [(0, b) for b in plan.blocks]
    return [(s, b) for s, blocks in enumerate(plan.schedule or ()) for b in blocks]


@dataclass
class Survey:
    """Counts over every plan surveyed: kernel calls, banded ones, calls flash masks differently
    (and their wrong rows), and the same for the varlen calls of a varlen kernel."""

    plans: int = 0
    calls: int = 0
    banded: int = 0
    wrong_calls: int = 0
    wrong_rows: int = 0
    varlen_calls: int = 0
    varlen_wrong: int = 0
    examples: list = field(default_factory=list)


def _varlen_check(plan: MaskPlan, local: int, batch: int, out: Survey) -> None:
    """The varlen calls the ring makes of each step for a varlen kernel, each sequence checked with
    the call's ``max_seqlen_q/k``."""
    from hf_ring.ops.varlen import varlen_calls

    border = plan.route == "border"
    steps = [plan.blocks] if border else list(plan.schedule or ())
    n_local, rows = (local * batch, 1) if border else (local, batch)  # as the ring sees q: [rows, n_local]
    for blocks in steps:
        if len(blocks) < 2:
            continue
        calls = varlen_calls(tuple(blocks), n_local, rows, torch.device("cpu"))
        for call in calls:
            if isinstance(call, Block):
                continue
            out.varlen_calls += 1
            for b in getattr(call, "blocks", ()):
                if block_mismatch(b, n_local, "varlen_fwd", call.max_q, call.max_k, call) or block_mismatch(
                    b, n_local, "varlen_bwd", call.max_q, call.max_k, call
                ):
                    out.varlen_wrong += 1


def survey(seed: int = 0, layouts: int = 60, max_ring: int = 8, ulysses: tuple[int, ...] = (1, 2)) -> Survey:
    """Random layouts (packed rows of random document lengths, or one sequence), ring sizes 1..``max_ring``
    (times each Ulysses degree, within ``max_ring`` ranks in all), windows from 1 to beyond ``N``, both
    routes, every ring position: the flash-attn mask of every call against the block's own."""
    rng = random.Random(seed)
    out = Survey()
    for _ in range(layouts):
        u = rng.choice(ulysses)
        r = rng.randint(1, max(1, max_ring // u))
        n = rng.randint(4, 40) * 2 * r * u
        batch = rng.choice((1, 2))
        if rng.random() < 0.8:
            docs = []
            for _ in range(batch):
                lengths, left = [], n
                while left:
                    k = min(left, max(1, int(rng.expovariate(1 / rng.choice((3, 12, 40))))))
                    lengths.append(k)
                    left -= k
                docs.append(lengths)
            layout = packed_layout(docs, r, u)
        else:
            layout = sequence_layout(n, r, u)
        lay = ring_level(layout)
        c = max(1, lay.local // 2)
        windows = sorted({1, 2, 3, rng.randint(1, n), max(1, c // 2), c, c + 1, c + 2, 3 * c + 1, n - 1, n, n + 5})
        for w in windows:
            for route in ("ring", "border"):
                for pos in range(lay.ring):
                    plan = mask_plan(layout, batch, pos, window=w, route=route)
                    out.plans += 1
                    n_local = lay.local * (batch if route == "border" else 1)
                    if route == "border" and plan.halo is not None:
                        n_local += plan.halo.offsets[-1]
                    for _, b in plan_blocks(plan):
                        out.calls += 1
                        out.banded += b.window is not None
                        bad = max(block_mismatch(b, n_local, "fwd"), block_mismatch(b, n_local, "bwd"))
                        if bad:
                            out.wrong_calls += 1
                            out.wrong_rows += bad
                            if len(out.examples) < 5:
                                out.examples.append((n, lay.ring, u, w, route, b))
                    _varlen_check(plan, lay.local, batch, out)
    return out
