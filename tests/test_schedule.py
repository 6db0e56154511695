"""make_schedule as data: exact coverage of the attention matrix and balanced work per rank."""

from __future__ import annotations

from collections import Counter

import pytest

from hf_ring.ops.schedule import Block, make_schedule

CHUNK = 3  # rows per chunk of the sequence (odd on purpose)


def local_positions(order: str, rank: int, size: int) -> list[int]:
    """Global sequence positions of a rank's local rows, independently of hf_ring.sharding."""
    if order == "zigzag":
        chunks = (rank, 2 * size - 1 - rank)
        return [c * CHUNK + i for c in chunks for i in range(CHUNK)]
    n = 2 * CHUNK  # same local length as zigzag; rank r holds chunk r of P
    return [rank * n + i for i in range(n)]


def rows(half: tuple[int, int], positions: list[int]) -> list[int]:
    n = len(positions)
    assert n % 2 == 0
    return positions[half[0] * n // 2 : half[1] * n // 2]


def covered(order: str, causal: bool, size: int) -> Counter:
    """How often each (query position, key position) pair is computed over all ranks and steps."""
    pairs: Counter = Counter()
    for rank in range(size):
        steps = make_schedule(order, causal, rank, size)
        assert len(steps) == size
        for step, blocks in enumerate(steps):
            src = (rank - step) % size  # the rank whose K/V block is here at this step
            for b in blocks:
                assert isinstance(b, Block)
                qpos = rows(b.q, local_positions(order, rank, size))
                kpos = rows(b.kv, local_positions(order, src, size))
                if b.causal:
                    # the kernel masks block column j > row i: only sound on square blocks
                    assert len(qpos) == len(kpos), f"causal block {b} is not square"
                for i, qp in enumerate(qpos):
                    for j, kp in enumerate(kpos):
                        if not (b.causal and j > i):
                            pairs[qp, kp] += 1
    return pairs


def expected(causal: bool, size: int) -> Counter:
    n = 2 * size * CHUNK
    return Counter({(i, j): 1 for i in range(n) for j in range(n) if j <= i or not causal})


@pytest.mark.parametrize("size", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("order", ["zigzag", "contiguous"])
@pytest.mark.parametrize("causal", [True, False])
def test_every_needed_pair_covered_exactly_once(order: str, causal: bool, size: int) -> None:
    got, want = covered(order, causal, size), expected(causal, size)
    missing = sorted(set(want) - set(got))
    extra = sorted(set(got) - set(want))
    twice = sorted(p for p, c in got.items() if c > 1)
    assert not missing, f"pairs never computed: {missing[:10]}"
    assert not extra, f"pairs computed that the mask forbids: {extra[:10]}"
    assert not twice, f"pairs computed more than once: {twice[:10]}"
    assert got == want


def work(order: str, causal: bool, rank: int, size: int) -> float:
    """Query rows x key rows over a rank's kernel calls, causal (square) blocks counting half."""
    n = 2 * CHUNK
    total = 0.0
    for blocks in make_schedule(order, causal, rank, size):
        for b in blocks:
            area = (b.q[1] - b.q[0]) * n // 2 * (b.kv[1] - b.kv[0]) * n // 2
            total += area / 2 if b.causal else area
    return total


@pytest.mark.parametrize("size", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("causal", [True, False])
def test_zigzag_work_is_balanced(causal: bool, size: int) -> None:
    loads = [work("zigzag", causal, r, size) for r in range(size)]
    assert loads == [loads[0]] * size, loads
    n = 2 * CHUNK
    # causal: half of the local square per step, i.e. half the non-causal work
    assert loads[0] == (n * n * size / 2 if causal else n * n * size)


@pytest.mark.parametrize("size", [1, 2, 3, 4, 5])
def test_zigzag_steps(size: int) -> None:
    """Step 0 is the rank's own block, causal; every later step is half a block, unmasked."""
    for rank in range(size):
        steps = make_schedule("zigzag", True, rank, size)
        assert steps[0] == (Block((0, 2), (0, 2), True),)
        for blocks in steps[1:]:
            assert len(blocks) == 1 and not blocks[0].causal
            b = blocks[0]
            # one local half against two halves, or two against one: half of the square
            assert sorted((b.q[1] - b.q[0], b.kv[1] - b.kv[0])) == [1, 2]


@pytest.mark.parametrize("size", [2, 3, 4, 5])
def test_contiguous_causal_is_unbalanced(size: int) -> None:
    """The comparison order: the last rank does 2P - 1 times the work of rank 0."""
    loads = [work("contiguous", True, r, size) for r in range(size)]
    assert loads == sorted(loads) and loads[0] < loads[-1]
    assert loads[-1] == (2 * size - 1) * loads[0]


def test_unknown_layout_raises() -> None:
    with pytest.raises(
        ValueError, match=r"unknown order 'striped'; choose one of \('zigzag', 'contiguous'\)"
    ):
        make_schedule("striped", True, 0, 2)
