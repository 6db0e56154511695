"""Ring schedules as data: which local query rows meet which rows of the visiting K/V block.

At ring step ``s`` rank ``r`` holds the K/V block of rank ``src = (r - s) mod P``. A schedule lists,
for every step, the kernel calls to make. Rows are counted in halves of the local length, because
the zigzag layout gives every rank two chunks of the sequence::

    sequence cut into 2P chunks (P = 3):   c0 c1 c2 c3 c4 c5
    rank 0 holds [c0 | c5], rank 1 holds [c1 | c4], rank 2 holds [c2 | c3]

    step 0, src == r : both chunks attend both chunks, causal (local order keeps global order)
    src < r          : both local chunks attend src's first chunk only, no mask
    src > r          : only the local second chunk attends both of src's chunks, no mask

Every off-diagonal step is half a block of work and needs no mask, and every rank does the same
work. This module imports nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

LAYOUTS = ("zigzag", "contiguous")


@dataclass(frozen=True)
class Block:
    """One kernel call: local query halves ``q`` meet K/V halves ``kv``, ``[start, stop)`` of 2."""

    q: tuple[int, int]
    kv: tuple[int, int]
    causal: bool


ALL, FIRST, SECOND = (0, 2), (0, 1), (1, 2)


def make_schedule(layout: str, causal: bool, rank: int, size: int) -> list[tuple[Block, ...]]:
    """The kernel calls of each of the ``size`` ring steps for ``rank``.

    ``layout="zigzag"``: rank ``r`` holds chunks ``r`` and ``2P-1-r`` of ``2P``.
    ``layout="contiguous"``: rank ``r`` holds chunk ``r`` of ``P`` (kept for comparison: causal work
    is unbalanced across ranks, rank ``P-1`` does ``2P-1`` times the work of rank 0).
    """
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; choose one of {LAYOUTS}")
    steps: list[tuple[Block, ...]] = []
    for s in range(size):
        src = (rank - s) % size
        if not causal:
            steps.append((Block(ALL, ALL, False),))
        elif src == rank:
            steps.append((Block(ALL, ALL, True),))
        elif src < rank:
            steps.append((Block(ALL, FIRST if layout == "zigzag" else ALL, False),))
        elif layout == "zigzag":
            steps.append((Block(SECOND, ALL, False),))
        else:
            steps.append(())  # contiguous: a later rank's keys are all in the future
    return steps
