"""State passing over the runs of a sharded batch (``ops.state_passing``): every rank's incoming
states and every gradient (through maps and exts) against a float64 oracle that chains all runs of
each document in one process; P = 1..4, Ulysses pieces, packed documents of 1, 2 and more tokens,
the three map kinds."""

from __future__ import annotations

import pytest
import torch

from hf_ring.ops.state_passing import (
    apply_elementwise,
    apply_matrix,
    apply_scalar,
    incoming_states,
    state_plan,
)
from testkit.spawn import run_ranks
from tests.test_exchange import make_layout

KINDS = {  # map shape, state shape, apply
    "matrix": ((3, 4, 4), (3, 4, 5), apply_matrix),
    "scalar": ((3,), (3, 2, 5), apply_scalar),
    "elementwise": ((3, 5), (3, 5), apply_elementwise),
}


def run_entry(kind: str, row: int, start: int, what: str) -> torch.Tensor:
    """The map, ext or output weight of the run that starts at global ``start`` of batch row ``row``."""
    m_shape, e_shape, _ = KINDS[kind]
    g = torch.Generator().manual_seed(1000 * row + 7 * start + {"map": 1, "ext": 2, "weight": 3}[what])
    shape = m_shape if what == "map" else e_shape
    x = torch.randn(shape, generator=g, dtype=torch.float64)
    return x * 0.5 if what == "map" else x


def oracle(kind: str, layout, batch: int):
    """Every run's incoming state, and the gradient of the summed weighted states, in one process."""
    _, _, apply = KINDS[kind]
    runs = [run for r in range(layout.size) for b in range(batch) for run in layout.runs(r, b)]
    leaves = {
        (run.row, run.start): tuple(run_entry(kind, run.row, run.start, w).requires_grad_() for w in ("map", "ext"))
        for run in runs
    }
    total = torch.zeros((), dtype=torch.float64)
    states = {}
    for run in sorted(runs, key=lambda r: (r.row, r.start)):
        if run.start == run.doc_start:
            state = None
        else:
            prev = next(p for p in runs if p.row == run.row and p.start + p.length == run.start)
            m, e = leaves[(prev.row, prev.start)]
            s_prev = states[(prev.row, prev.start)]
            state = e if s_prev is None else apply(m, s_prev) + e
        states[(run.row, run.start)] = state
        if state is not None:
            total = total + (state * run_entry(kind, run.row, run.start, "weight")).sum()
    if total.requires_grad:
        total.backward()
    grads = {k: (v[0].grad, v[1].grad) for k, v in leaves.items()}
    return states, grads


def state_errors(layout_kind: str, ulysses: int, kind: str, sparse: bool) -> dict[str, float]:
    size, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    batch = 2
    layout = make_layout(layout_kind, size, ulysses, batch)
    m_shape, e_shape, apply = KINDS[kind]
    plan = state_plan(layout, batch, rank)
    maps, exts = [], []
    for i, run in enumerate(plan.runs):
        need_map = not sparse or (plan.sent[i] and not plan.first[i])
        need_ext = not sparse or plan.sent[i]
        maps.append(run_entry(kind, run.row, run.start, "map").requires_grad_() if need_map else None)
        exts.append(run_entry(kind, run.row, run.start, "ext").requires_grad_() if need_ext else None)
    got = incoming_states(
        layout, batch, rank, None, maps, exts, apply, map_shape=m_shape, state_shape=e_shape, dtype=torch.float64
    )
    total = torch.zeros((), dtype=torch.float64)
    for run, s in zip(plan.runs, got):
        if s is not None:
            total = total + (s * run_entry(kind, run.row, run.start, "weight")).sum()
    if total.requires_grad:
        total.backward()
    want, grads = oracle(kind, layout, batch)
    err = {"out": 0.0, "grad": 0.0, "none": 0.0, "dtype": 0.0}
    for i, (run, s) in enumerate(zip(plan.runs, got)):
        w = want[(run.row, run.start)]
        if w is None and s is not None and not (i == 0 and all(x is None for x in got[1:]) and not s.any()):
            err["none"] = 1.0  # a zero state only where the rank would otherwise return nothing
        elif w is None or s is None:
            err["none"] = max(err["none"], float(s is None and w is not None))
        elif (s is None) != (w is None):
            err["none"] = 1.0
        elif s is not None:
            err["out"] = max(err["out"], float((s - w).detach().abs().max()))
            err["dtype"] = max(err["dtype"], float(s.dtype != torch.float64))
        gm, ge = grads[(run.row, run.start)]
        for leaf, g in ((maps[i], gm), (exts[i], ge)):
            if leaf is None:
                continue
            mine = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
            ref = g if g is not None else torch.zeros_like(leaf)
            err["grad"] = max(err["grad"], float((mine - ref).abs().max()))
    return err


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("layout_kind", ["sequence", "short_ones", "long_and_short"])
@pytest.mark.parametrize(("world", "ulysses"), [(1, 1), (2, 1), (3, 1), (4, 1), (4, 2)])
def test_incoming_states_match_the_chain(world: int, ulysses: int, layout_kind: str, kind: str) -> None:
    for sparse in (False, True):
        for r in run_ranks(world, state_errors, layout_kind, ulysses, kind, sparse):
            assert r["none"] == 0 and r["dtype"] == 0, r
            assert r["out"] < 1e-12 and r["grad"] < 1e-12, (sparse, r)


def test_plan_sends_only_states_that_are_needed() -> None:
    """One sequence of 8 chunks over P = 4: every run but the last one of the sequence (the second
    half of rank 0's rows) is sent; packed documents that fit in one run send nothing."""
    layout = make_layout("sequence", 4, 1, 1)
    plans = [state_plan(layout, 1, r) for r in range(4)]
    assert [p.sent for p in plans] == [(True, False), (True, True), (True, True), (True,)]
    assert plans[0].first == (True, False) and plans[0].slots == 2
    assert [len(c) for c in plans[0].chains] == [0, 6]  # chunks 0..6 in 6 runs: rank 3 holds 3 and 4 as one
