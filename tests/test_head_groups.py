"""Attention heads in groups inside the ring (``head_groups``), against the float64 oracle on odd shapes:
P = 3, GQA 6:2, head_dim 80, chunks of odd length, forward and every gradient; with sliding windows on
both routes, attention sinks (per head, per row), logit soft-capping, packed documents and Ulysses x
ring; through the ops (``ring_attention``, ``masked_attention``, ``ulysses_ring_attention``) and through
``AttentionCall.forward`` / ``backward`` one group at a time (the tiled layer's path). The groups send
the same bytes and hold less."""

from __future__ import annotations

import pytest
import torch

from hf_ring.ops.ring import head_groups_of, ring_attention
from testkit.comm import NoCommRing
from testkit.live_tensors import LiveTensorBytes
from testkit.spawn import run_ranks
from tests.test_masks import _check, extras_masks, mask_errors, window_masks
from tests.test_sinks_softcap import DOCS, SHAPES, ring_errors


def test_groups_keep_gqa_groups_whole() -> None:
    """Group ``g``: K/V heads ``[g Hkv/G, (g+1) Hkv/G)`` and their query heads; ``G`` must divide ``Hkv``."""
    assert head_groups_of(6, 2, 2) == [(slice(0, 3), slice(0, 1)), (slice(3, 6), slice(1, 2))]
    assert head_groups_of(32, 8, 4)[1] == (slice(8, 16), slice(2, 4))
    with pytest.raises(ValueError, match=r"head_groups=3 must divide the 2 K/V heads .* pick one of \[1, 2\]"):
        head_groups_of(6, 2, 3)
    q, k = torch.zeros(1, 4, 6, 8), torch.zeros(1, 4, 2, 8)
    with pytest.raises(ValueError, match="head_groups=4"):
        ring_attention(q, k, k, head_groups=4)


@pytest.mark.parametrize(
    ("softcap", "sinks", "packed"),
    [(None, None, False), (5.0, "head", False), (None, "row", True), (5.0, "head", True)],
    ids=["plain", "softcap+sinks", "row_sinks+packed", "softcap+sinks+packed"],
)
def test_ring_head_groups_match_float64(softcap: float | None, sinks: str | None, packed: bool) -> None:
    """P = 3, GQA 6:2 in 2 groups (3 query heads over 1 K/V head each), head_dim 80, 30 tokens (chunks
    of 5): out, dQ, dK, dV and the sinks' gradient within 1e-5 of float64 (fp32)."""
    n = sum(DOCS[3][0]) if packed else SHAPES[3]
    docs = DOCS[3] if packed else None
    for r in run_ranks(3, ring_errors, n, 6, 2, 80, softcap, sinks, docs, "float32", "auto", 2):
        assert max(r.values()) <= 1e-5, r


@pytest.mark.parametrize("packed", [False, True], ids=["sequence", "packed"])
def test_windows_in_head_groups_match_float64(packed: bool) -> None:
    """Sliding windows on both routes (border and ring), P = 3, GQA 6:2 in 2 groups, head_dim 80."""
    masks = [m for m in window_masks(3) if m[2] != "auto"]
    for rank_results in run_ranks(3, mask_errors, packed, masks, 6, 2, 80, head_groups=2):
        _check(rank_results)


def test_windows_sinks_softcap_in_head_groups_match_float64() -> None:
    """Windows with per-row sinks and soft-capping, both routes, packed documents, P = 3, 2 groups."""
    for rank_results in run_ranks(3, mask_errors, True, extras_masks(3), 6, 2, 80, softcap=2.0, sinks="row",
                                  head_groups=2):  # fmt: skip
        _check(rank_results)


def test_ulysses_x_ring_head_groups_match_float64() -> None:
    """Ulysses 2 x ring 2 (4 ranks), 8 query over 4 K/V heads: 2 K/V heads per rank after the all-to-all,
    in 2 groups; windows on both routes, packed documents, per-head sinks and soft-capping."""
    masks = [(1000, None, "ring")] + extras_masks(2)
    for rank_results in run_ranks(4, mask_errors, True, masks, 8, 4, 16, 2, softcap=3.0, sinks="head",
                                  head_groups=2):  # fmt: skip
        _check(rank_results)


@pytest.mark.parametrize("ulysses", [1, 2], ids=["ring", "ulysses2xring"])
def test_groups_one_after_the_other_match_float64(ulysses: int) -> None:
    """The tiled layer's path: ``AttentionCall.forward`` then ``backward`` per head group (no autograd
    inside), every route: the whole causal ring, windows by the border and by the ring, packed documents,
    per-head sinks, soft-capping; P = 3 (GQA 6:2, head_dim 80) and Ulysses 2 x ring 2 (8:4 heads)."""
    world, heads = (3, (6, 2, 80)) if ulysses == 1 else (4, (8, 4, 16))
    masks = [(1000, None, "ring")] + extras_masks(world // ulysses)
    for packed in (False, True):
        for rank_results in run_ranks(world, mask_errors, packed, masks, *heads, ulysses, softcap=3.0,
                                      sinks="head", head_groups=2, functional=True):  # fmt: skip
            _check(rank_results)


def _ring_step(groups: int) -> tuple[int, int]:
    """Rank 1 of a ring of 4 (nothing sent): the bytes its channels would send and the peak of the
    tensors a forward + backward creates, with ``groups`` head groups."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 512, 8, 32, generator=g, requires_grad=True)
    k, v = (torch.randn(1, 512, 4, 32, generator=g, requires_grad=True) for _ in range(2))
    ring = NoCommRing(4, 1)
    with LiveTensorBytes() as mem:
        out = ring_attention(q, k, v, ring=ring, backend="torch", head_groups=groups)
        out.backward(torch.ones_like(out))
        del out
    return sum(c.sent_bytes for c in ring.channels), mem.peak


def test_head_groups_send_the_same_bytes_and_hold_less() -> None:
    """4 groups: the same bytes on the ring; the peak of forward + backward (the inputs' gradients
    included) well below that of one group."""
    sent1, peak1 = _ring_step(1)
    sent4, peak4 = _ring_step(4)
    assert sent4 == sent1 > 0
    assert peak4 < 0.7 * peak1, (peak4, peak1)
