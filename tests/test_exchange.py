"""ShardLayout (where every token of a batch lives) and the row exchange behind halos: every rank
fetches the rows preceding its runs from the ranks that hold them, forward and backward, against the
unsharded sequence, P = 1..4, Ulysses pieces, packed documents of 1, 2 and more tokens."""

from __future__ import annotations

import pytest
import torch

from hf_ring.ops.exchange import halo_plan
from hf_ring.ops.layout import ShardLayout, sequence_layout
from hf_ring.transformers.batch import _packed_layout
from testkit.spawn import run_ranks

DOCS = {  # document lengths of one packed row of 24 tokens
    "one": [24],
    "short_ones": [1, 2, 1, 3, 1, 1, 2, 5, 8],
    "long_and_short": [2, 17, 1, 4],
}


def lengths_to_starts(lengths: list[int]) -> list[int]:
    out, s = [], 0
    for n in lengths:
        out.append(s)
        s += n
    return out


def make_layout(kind: str, size: int, ulysses: int, rows: int) -> ShardLayout:
    if kind == "sequence":
        return sequence_layout(24, size // ulysses, ulysses)
    starts = [lengths_to_starts(DOCS[kind]), lengths_to_starts(DOCS["long_and_short"])][:rows]
    return _packed_layout(starts, 24, size, ulysses)[0]


@pytest.mark.parametrize("kind", ["sequence", *DOCS])
@pytest.mark.parametrize(("size", "ulysses"), [(1, 1), (2, 1), (3, 1), (4, 1), (4, 2)])
def test_layout_covers_every_token_once(kind: str, size: int, ulysses: int) -> None:
    layout = make_layout(kind, size, ulysses, 2)
    batch = 2
    index = layout.index(batch)
    assert index.shape == (size, batch, layout.local)
    for b in range(batch):
        held = index[:, b][index[:, b] < layout.n]
        assert sorted(held.tolist()) == list(range(layout.n))  # every token exactly once
        rank_of, local_of = layout.locate(batch)
        for g in range(layout.n):
            assert index[rank_of[b, g], b, local_of[b, g]] == g
        for rank in range(size):
            for run in layout.runs(rank, b):
                rows = index[rank, b, run.local : run.local + run.length].tolist()
                assert rows == list(range(run.start, run.start + run.length))
                assert run.doc_start <= run.start


def halo_errors(kind: str, width: int, ulysses: int) -> dict[str, float]:
    size, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    batch, feat = 2, 5
    layout = make_layout(kind, size, ulysses, batch)
    g = torch.Generator().manual_seed(3)
    full = torch.randn(batch, layout.n, feat, generator=g, dtype=torch.float64)
    index = layout.index(batch)
    padded = torch.cat((full, torch.zeros(batch, 1, feat, dtype=torch.float64)), dim=1)
    local = padded.gather(1, index[rank][..., None].expand(-1, -1, feat)).requires_grad_()
    halo = halo_plan(layout, batch, rank, width)
    got = halo.fetch(local, None)
    want = []
    for run in halo.runs:
        lo = max(run.doc_start, run.start - width)
        want.append(full[run.row, lo : run.start])
    want_t = torch.cat(want) if want else full.new_zeros(0, feat)
    weights = torch.randn(got.shape, generator=torch.Generator().manual_seed(rank), dtype=torch.float64)
    (got * weights).sum().backward()
    # the gradient of each global row: the weights of every rank's fetches of that row
    grad_full = torch.zeros(batch, layout.n + 1, feat, dtype=torch.float64)
    for r in range(size):
        w_r = torch.randn(got.shape if r == rank else (halo_plan(layout, batch, r, width).plan.count, feat),
                          generator=torch.Generator().manual_seed(r), dtype=torch.float64)  # fmt: skip
        h_r = halo_plan(layout, batch, r, width)
        for run, (a, b) in zip(h_r.runs, zip(h_r.offsets, h_r.offsets[1:])):
            grad_full[run.row, run.start - (b - a) : run.start] += w_r[a:b]
    want_grad = grad_full.gather(1, index[rank][..., None].expand(-1, -1, feat))
    return {
        "count": float(abs(got.shape[0] - want_t.shape[0])),
        "out": float((got - want_t).abs().max()) if got.numel() else 0.0,
        "grad": float((local.grad - want_grad).abs().max()),
        "sent": float(halo.plan.sent_rows),
    }


@pytest.mark.parametrize("width", [1, 3, 7])
@pytest.mark.parametrize("kind", ["sequence", "short_ones", "long_and_short"])
@pytest.mark.parametrize(("world", "ulysses"), [(1, 1), (2, 1), (3, 1), (4, 1), (4, 2)])
def test_halo_fetches_the_preceding_rows(world: int, ulysses: int, kind: str, width: int) -> None:
    """Widths longer than a chunk (24 / 2P = 3 tokens at P = 4) reach back over several chunks and ranks."""
    for r in run_ranks(world, halo_errors, kind, width, ulysses):
        assert r["count"] == 0 and r["out"] == 0 and r["grad"] < 1e-12, r


def test_zigzag_halo_sends_only_the_border() -> None:
    """One sequence, width 2 <= a chunk: each rank sends 2 rows per boundary it precedes."""
    layout = sequence_layout(64, 4)
    sent = [halo_plan(layout, 1, r, 2).plan.sent_rows for r in range(4)]
    # chunks c0..c7, rank r holds c_r and c_{7-r}; c3 and c4 are both rank 3's (no transfer between them)
    assert sent == [2, 4, 4, 2]
