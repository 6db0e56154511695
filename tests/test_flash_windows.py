"""Sliding windows over packed documents through flash-attn's real mask.

Every kernel call of many random plans (P = 1..8 ranks, Ulysses 2, windows from 1 to beyond N, both
routes) is checked against the mask flash-attn 2.6.3-2.8.3 applies to it (``testkit.flash_rules``: its
window clamps, ``set_params_fprop`` and ``mask.h``), dense and varlen; and packed rows whose plans held
blocks that flash-attn masks differently (before ``schedule.flash_exact``) run end to end through the
flash-attn stand-in at P = 2, 3, 4, with and without sinks and soft-capping, against float64: out and
every gradient.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from hf_ring.ops import schedule
from hf_ring.ops.varlen import varlen_calls
from hf_ring.ops.windows import mask_plan, masked_attention
from testkit.flash_blocks import block_mismatch, packed_layout, plan_blocks, survey
from testkit.flash_rules import flash_keeps, flash_mask, flash_window
from testkit.oracle import attention
from testkit.spawn import run_ranks
from tests.test_masks import allowed, rel_err

# packed rows (document lengths, window) whose ring-route plans hold band blocks that flash-attn masks
# differently unless cut (``schedule.flash_exact``; found by search)
RING_CASES = {2: ([6, 11, 227], 6), 3: ([19, 12, 10, 1, 9, 207], 8), 4: ([87, 4, 9, 18, 6, 10, 218], 6)}
# rows whose halos a document start cuts short: a block of a run's fetched rows alone then had a right edge
# >= Sk (what the border route made before it laid each run's fetched rows before its own)
BORDER_CASES = {2: ([5, 41, 3, 23], 16), 4: ([125, 51, 5, 1, 11, 3, 1, 21, 6, 8, 64], 6)}


def test_flash_rule_is_the_sources_rule() -> None:
    """The rule's corner cases, as flash_api.cpp and mask.h give them: a right edge >= Sk becomes Sk
    (``-1`` then ``seqlen_k``), so with Sq >= Sk + 2 the first rows lose keys; both edges >= Sk: no mask;
    ``causal`` sets the right edge to 0 (bottom-right), ``Sq == 1`` turns it off in the forward; the
    varlen clamps read ``max_seqlen_k``."""
    w = flash_window(False, 1, 9, 12, 4, "fwd")  # right 9 >= Sk 4: -1, then seqlen_k
    assert (w.is_local, w.left, w.right) == (True, 1, 4)
    keep = flash_mask(12, 4, w)
    assert not keep[:4].any() and keep[4:].any(1).all()  # rows i < Sq - 2 Sk see nothing
    assert flash_keeps(12, 4, False, (4, 9)).all()  # both clamped: no mask at all
    assert torch.equal(flash_keeps(3, 5, True, None), torch.ones(3, 5, dtype=torch.bool).tril(2))
    assert flash_keeps(1, 5, True, None).all() and flash_keeps(1, 5, True, None, "bwd").all()
    # varlen: a right edge below max_seqlen_k is kept even when it is >= this sequence's Sk
    assert flash_window(False, 0, 5, 12, 9, "varlen_fwd").right == 5
    assert not flash_keeps(12, 4, False, (0, 5), "varlen_fwd", 12, 9)[:2].any()


def test_every_band_block_is_masked_by_flash_as_planned() -> None:
    """Random packed and unpacked layouts, P = 1..8 (ring x Ulysses), windows of 1 to N + 5, both routes:
    no kernel call, dense or varlen (a step's blocks grouped as the ring groups them for a varlen kernel),
    is masked by flash-attn differently from its own band. (The same survey on the schedules before
    ``flash_exact``: 22 of 218,130 calls, 173 rows; ``python -m benchmarks.bench_flash_masks --small``.)"""
    s = survey(seed=1, layouts=16)
    assert s.plans > 1000 and s.banded > 1000 and s.varlen_calls > 1000, vars(s)
    assert s.wrong_calls == 0 and s.varlen_wrong == 0, s.examples


def _wrong(docs: list[int], ring: int, window: int, route: str) -> int:
    layout = packed_layout([docs], ring)
    total = 0
    for pos in range(ring):
        plan = mask_plan(layout, 1, pos, window=window, route=route)
        total += sum(max(block_mismatch(b, 0, "fwd"), block_mismatch(b, 0, "bwd")) for _, b in plan_blocks(plan))
    return total


@pytest.mark.parametrize("ring", sorted(RING_CASES))
def test_ring_cases_hold_blocks_flash_would_change(ring: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the cut (``flash_exact`` always true) the ring plans of ``RING_CASES`` hold blocks that
    flash-attn masks differently; with it, none."""
    docs, window = RING_CASES[ring]
    assert _wrong(docs, ring, window, "ring") == 0
    monkeypatch.setattr(schedule, "flash_exact", lambda b: True)
    assert _wrong(docs, ring, window, "ring") > 0


@pytest.mark.parametrize("ring", sorted(BORDER_CASES))
def test_border_cases_cut_halos_short(ring: int) -> None:
    """``BORDER_CASES`` have runs whose halo a document start cuts to fewer than ``W - 1`` rows while the
    run is longer; their plans put each run's rows after its halo under one band ``(W - 1, 0)`` (causal
    blocks and one-row blocks where the band does not bind), none of which flash-attn changes, and a
    varlen kernel gets each rank's layer in one call."""
    docs, window = BORDER_CASES[ring]
    layout = packed_layout([docs], ring)
    cut = 0
    for pos in range(ring):
        plan = mask_plan(layout, 1, pos, window=window, route="border")
        offsets, runs = plan.halo.offsets, plan.halo.runs
        cut += sum(0 < offsets[i + 1] - offsets[i] < window - 1 < run.length for i, run in enumerate(runs))
        assert all(b.causal or b.window == (window - 1, 0) or b.q[1] - b.q[0] == 1 for b in plan.blocks)
        calls = varlen_calls(plan.blocks, layout.local, 1, torch.device("cpu"))
        assert len(calls) == 1 and calls[0].window == (window - 1, 0)  # the rank's whole layer: one varlen call
    assert cut > 0
    assert _wrong(docs, ring, window, "border") == 0


def packed_flash_errors(
    docs: list[int], window: int, sinks: str | None, softcap: float, backend: str, routes: tuple[str, ...]
) -> list:
    """On every rank: the packed row ``docs`` under ``window`` through ``masked_attention`` with ``backend``
    (``testkit.cuda_standins.make_kernel`` name), float32, GQA 6 over 2, head_dim 36 (padded to 40 for
    flash-attn); errors of out (real rows) and dq/dk/dv (gathered) against float64, per route."""
    from testkit.cuda_standins import make_kernel

    world, rank = dist.get_world_size(), dist.get_rank()
    layout = packed_layout([docs], world)
    n, hq, hkv, d = layout.n, 6, 2, 36
    g = torch.Generator().manual_seed(5)
    q, dout = (torch.randn(1, n, hq, d, generator=g, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(1, n, hkv, d, generator=g, dtype=torch.float64) for _ in range(2))
    sink = torch.randn(hq, generator=g, dtype=torch.float64) if sinks else None
    index = layout.index(1)
    real = index[rank] < n

    def take(t, r=rank):
        full = torch.cat((t, t.new_zeros(t.shape[0], 1, *t.shape[2:])), dim=1)
        return full.gather(1, index[r][..., None, None].expand(-1, -1, *t.shape[2:])).contiguous()

    mask = allowed(layout, 1, window, None)
    ref_in = [t.float().double().requires_grad_() for t in (q, k, v)]
    ref_sink = None if sink is None else sink.float().double().requires_grad_()
    ref = attention(*ref_in, mask=mask, softcap=softcap, sinks=ref_sink)
    ref.backward(dout.float().double())
    out_errs = []
    for route in routes:
        plan = mask_plan(layout, 1, rank, window=window, route=route)
        loc = [take(t).float().requires_grad_(i < 3) for i, t in enumerate((q, k, v, dout))]
        s = None if sink is None else sink.float().requires_grad_()
        out = masked_attention(*loc[:3], plan, backend=make_kernel(backend), softcap=softcap or None, sinks=s)
        out.backward(loc[3])
        errs = {"route": route, "out": rel_err(out[real], take(ref.detach())[real])}
        for name, got, want in zip(("dq", "dk", "dv"), (t.grad for t in loc[:3]), (t.grad for t in ref_in)):
            parts = [torch.empty_like(got) for _ in range(world)]
            dist.all_gather(parts, got.contiguous())
            full = torch.zeros(1, n + 1, *got.shape[2:], dtype=torch.float64)
            for r, part in enumerate(parts):
                full.scatter_(1, index[r][..., None, None].expand_as(part), part.double())
            errs[name] = rel_err(full[:, :n], want)
        if s is not None:
            got = s.grad.double().clone()
            dist.all_reduce(got)
            errs["dsinks"] = rel_err(got, ref_sink.grad)
        out_errs.append(errs)
    return out_errs


CASES = [(p, "ring", *RING_CASES[p]) for p in sorted(RING_CASES)]
CASES += [(p, "border", *BORDER_CASES[p]) for p in sorted(BORDER_CASES)]


@pytest.mark.parametrize(("ring", "kind", "docs", "window"), CASES, ids=[f"P{c[0]}-{c[1]}" for c in CASES])
@pytest.mark.parametrize(
    ("sinks", "softcap"), [(None, 0.0), ("head", 0.0), ("head", 2.0)], ids=["plain", "sinks", "sinks+softcap"]
)
def test_packed_windows_through_flash_attn_match_float64(
    ring: int, kind: str, docs: list[int], window: int, sinks: str | None, softcap: float
) -> None:
    """Out, dq, dk, dv (and the sinks' gradient) within 1e-5 of float64 through the flash-attn stand-in
    (its clamps, mask and empty-row ``lse = +inf``), on both routes; no NaN."""
    args = (docs, window, sinks, softcap, "flash_attn:2.8-custom-op", ("border", "ring"))
    for rank_errs in run_ranks(ring, packed_flash_errors, *args):
        for errs in rank_errs:
            assert all(v <= 1e-5 for k, v in errs.items() if k != "route"), errs  # NaN fails too


@pytest.mark.parametrize(
    ("ring", "kind", "docs", "window"), [c for c in CASES if c[0] == 2], ids=["P2-ring", "P2-border"]
)
def test_packed_windows_block_by_block_through_flash_attn_2_6(
    ring: int, kind: str, docs: list[int], window: int
) -> None:
    """flash-attn 2.6 (no varlen here: one dense call per block, ``window_size`` as a tuple), sinks and a cap."""
    args = (docs, window, "head", 2.0, "flash_attn:2.6", ("border", "ring"))
    for rank_errs in run_ranks(ring, packed_flash_errors, *args):
        for errs in rank_errs:
            assert all(v <= 1e-5 for k, v in errs.items() if k != "route"), errs


@pytest.mark.parametrize("backend", ["flash_attn_3:custom-op", "flash_attn_3:plain", "flash_attn_4"])
@pytest.mark.parametrize(
    ("ring", "kind", "docs", "window"), [c for c in CASES if c[0] == 2], ids=["P2-ring", "P2-border"]
)
def test_packed_windows_through_flash_attn_3_and_4_match_float64(
    backend: str, ring: int, kind: str, docs: list[int], window: int
) -> None:
    """flash-attn 3 and 4 (their stand-ins: FA3's own window clamps, both libraries' empty-row ``lse = -inf``,
    varlen calls with one band each) on packed rows with sliding windows, GQA 6/2, head_dim 36, sinks and a
    soft-cap: out and every gradient within 1e-5 of float64 on both routes."""
    args = (docs, window, "head", 2.0, backend, ("border", "ring"))
    for rank_errs in run_ranks(ring, packed_flash_errors, *args):
        for errs in rank_errs:
            assert all(v <= 1e-5 for k, v in errs.items() if k != "route"), errs
