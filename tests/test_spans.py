"""Bidirectional spans (Gemma 3's image blocks: the tokens of one image attend to each other both ways)
under the ring: every schedule covers transformers' mask exactly (each visible pair in one call, no
other pair), and ring attention with them equals float64 attention under that mask, forward and every
gradient, at P = 1-4, packed documents, GQA, head_dim 80, Ulysses x ring."""

from __future__ import annotations

import random

import pytest
import torch
import torch.distributed as dist

from hf_ring.ops.kernels import band_mask
from hf_ring.ops.layout import ShardLayout, sequence_layout, with_spans
from hf_ring.ops.windows import mask_plan
from testkit.flash_blocks import packed_layout
from testkit.oracle import rel_err, visible
from testkit.spawn import run_ranks

N = 46  # not a multiple of 2P for P = 3, 4: shard_batch pads to 48
DOCS = [[7, 1, 20, 13, 7], [29, 19]]  # two packed rows that differ, 48 tokens each


def random_spans(n: int, rows: int, seed: int, longest: int) -> list[list[tuple[int, int]]]:
    """Per row, disjoint runs of 1..``longest`` positions with gaps (some cross a document boundary)."""
    rng = random.Random(seed)
    out = []
    for _ in range(rows):
        spans, pos = [], rng.randrange(3)
        while pos < n:
            length = rng.randint(1, longest)
            spans.append((pos, min(n, pos + length)))
            pos += length + rng.randint(1, 5)
        out.append(spans)
    return out


def layout_of(packed: bool, ring: int, ulysses: int = 1, seed: int = 0, longest: int = 6) -> tuple[ShardLayout, int]:
    base = packed_layout(DOCS, ring, ulysses) if packed else sequence_layout(48, ring, ulysses)
    rows = len(DOCS) if packed else 2
    return with_spans(base, random_spans(N, rows, seed, longest)), rows


def want(layout: ShardLayout, rows: int, window: int | None) -> torch.Tensor:
    starts = [layout.starts[b if len(layout.starts) > 1 else 0] for b in range(rows)]
    spans = [layout.spans[b if len(layout.spans) > 1 else 0] for b in range(rows)]
    return visible(layout.n, window=window, starts=starts, spans=spans)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("window", [None, 6, 9, 30])
@pytest.mark.parametrize("packed", [False, True], ids=["sequence", "packed"])
@pytest.mark.parametrize("ring", [1, 2, 3, 4])
def test_span_schedules_cover_the_mask_exactly(ring: int, packed: bool, window: int | None, seed: int) -> None:
    """Every (query, key) pair that transformers' Gemma 3 mask keeps (causal OR same image, AND the
    window, AND the same document) is in exactly one call of one rank, and no call holds another."""
    layout, rows = layout_of(packed, ring, seed=seed)
    mask = want(layout, rows, window)
    index = layout.index(rows)  # [P, B, local]
    seen = torch.zeros(rows, layout.n, layout.n, dtype=torch.long)
    for r in range(ring):
        steps = mask_plan(layout, rows, r, window=window).schedule if window else layout.schedule(r)
        for s, blocks in enumerate(steps):
            src = (r - s) % ring
            for blk in blocks:
                for b in range(*(blk.batch or (0, rows))):
                    qi, ki = index[r, b][slice(*blk.q)], index[src, b][slice(*blk.kv)]
                    vis = torch.ones(len(qi), len(ki), dtype=torch.bool)
                    if blk.causal:
                        vis = vis.tril()
                    if blk.window is not None:
                        vis &= band_mask(len(qi), len(ki), blk.window)
                    assert (qi < layout.n).all() and (ki < layout.n).all()
                    assert mask[b][qi[:, None], ki[None, :]][vis].all(), "a call attends outside the mask"
                    seen[b][qi[:, None], ki[None, :]] += vis.long()
    assert torch.equal(seen, mask.long())


def test_a_span_longer_than_the_window_is_refused() -> None:
    layout = with_spans(sequence_layout(48, 2), [[(4, 20)], [(30, 33)]])
    with pytest.raises(ValueError, match="longer than the window"):
        mask_plan(layout, 2, 0, window=8)
    with pytest.raises(ValueError, match="border route"):
        mask_plan(layout, 2, 0, window=4, route="border")
    assert mask_plan(layout, 2, 0, window=16).route == "ring"  # the span fits: the whole image sees itself


def span_errors(packed: bool, ulysses: int, windows: list[int | None], hq: int, hkv: int, d: int) -> list[dict]:
    """On every rank: ring attention under the spans' mask (full layers: the layout's schedule; windowed
    ones: ``mask_plan``) against float64 attention over the whole sequence; out on this rank's real
    rows, dq/dk/dv gathered whole."""
    import hf_ring
    from hf_ring.ops.ring import ring_attention
    from hf_ring.ops.ulysses import ulysses_ring_attention
    from hf_ring.ops.windows import masked_attention
    from testkit.oracle import attention

    world, rank = dist.get_world_size(), dist.get_rank()
    cp = hf_ring.setup_context_parallel(world, ulysses_size=ulysses) if ulysses > 1 else None
    layout, rows = layout_of(packed, world // ulysses, ulysses, seed=3)
    n = layout.n
    g = torch.Generator().manual_seed(7)
    q, dout = (torch.randn(rows, n, hq, d, generator=g, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(rows, n, hkv, d, generator=g, dtype=torch.float64) for _ in range(2))
    index = layout.index(rows)
    real = index[rank] < n

    def take(t: torch.Tensor, r: int = rank) -> torch.Tensor:
        full = torch.cat((t, t.new_zeros(t.shape[0], 1, *t.shape[2:])), dim=1)
        return full.gather(1, index[r][..., None, None].expand(-1, -1, *t.shape[2:])).contiguous()

    out_rows = []
    ring_pos = rank // ulysses
    for window in windows:
        loc = [take(t).requires_grad_(i < 3) for i, t in enumerate((q, k, v, dout))]
        plan = mask_plan(layout, rows, ring_pos, window=window) if window else None
        schedule = layout.schedule(ring_pos) if plan is None else None
        if cp is not None:
            out = ulysses_ring_attention(*loc[:3], ulysses_group=cp.ulysses_group, ring_group=cp.ring_group,
                                         schedule=schedule, mask=plan)  # fmt: skip
        elif plan is not None:
            out = masked_attention(*loc[:3], plan)
        else:
            out = ring_attention(*loc[:3], schedule=schedule)
        out.backward(loc[3])
        ref_in = [t.clone().requires_grad_() for t in (q, k, v)]
        ref = attention(*ref_in, mask=want(layout, rows, window))
        ref.backward(dout)
        errs = {"window": window, "out": rel_err(out[real], take(ref.detach())[real])}
        for name, got, ref_grad in zip(("dq", "dk", "dv"), (t.grad for t in loc[:3]), (t.grad for t in ref_in)):
            parts = [torch.empty_like(got) for _ in range(world)]
            dist.all_gather(parts, got.contiguous())
            full = torch.zeros(rows, n + 1, *got.shape[2:], dtype=torch.float64)
            for r, part in enumerate(parts):
                full.scatter_(1, index[r][..., None, None].expand_as(part), part)
            errs[name] = rel_err(full[:, :n], ref_grad)
        out_rows.append(errs)
    return out_rows


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("world", "packed", "ulysses"), [(1, False, 1), (2, True, 1), (3, False, 1), (3, True, 1), (4, True, 2)]
)
def test_ring_attention_with_spans_matches_float64(world: int, packed: bool, ulysses: int) -> None:
    """Full and windowed layers (windows of 6, 9 and 30 keys) with random image spans, GQA 6:2 heads of
    dimension 80: forward and every gradient within 1e-12 of float64 attention under the same mask."""
    for per_rank in run_ranks(world, span_errors, packed, ulysses, [None, 6, 9, 30], 6, 2, 80, timeout=100):
        for errs in per_rank:
            assert max(errs[k] for k in ("out", "dq", "dk", "dv")) <= 1e-12, errs
