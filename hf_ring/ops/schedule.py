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
work.

Packed documents (``document_schedule``): the same zigzag over the packed stream, each chunk pair
cut along document boundaries. A token attends only to earlier tokens of its own document, so a
chunk pair contributes one kernel call per document that both chunks hold -- causal on the
diagonal (the same rows on both sides), unmasked below it -- and chunk pairs that share no document
make no call at all. This module imports nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

LAYOUTS = ("zigzag", "contiguous")


@dataclass(frozen=True)
class Block:
    """One kernel call: local query rows ``q`` meet the visiting block's rows ``kv``.

    ``q`` and ``kv`` are ``[start, stop)`` in units of ``1 / unit`` of the local length: halves for
    the zigzag schedules (``unit=2``); rows for document schedules (``unit=0`` means "in rows").
    ``batch``: the batch rows of the call (``None``: all).
    """

    q: tuple[int, int]
    kv: tuple[int, int]
    causal: bool
    unit: int = 2
    batch: tuple[int, int] | None = None

    def rows(self, which: tuple[int, int], n: int) -> slice:
        """``which`` (``self.q`` or ``self.kv``) as a slice of ``n`` local rows."""
        if self.unit == 0:
            return slice(which[0], which[1])
        return slice(which[0] * n // self.unit, which[1] * n // self.unit)


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


Schedule = list[tuple[Block, ...]]


def _segments(starts: list[int], lo: int, hi: int) -> list[tuple[int, int, int]]:
    """``(document, start, stop)`` of the documents (global ``starts``, sorted) over ``[lo, hi)``."""
    out = []
    for d, s in enumerate(starts):
        e = starts[d + 1] if d + 1 < len(starts) else hi
        if e > lo and s < hi:
            out.append((d, max(s, lo), min(e, hi)))
    return out


def document_schedule(starts: list[list[int]], n: int, rank: int, size: int) -> Schedule:
    """The zigzag ring schedule of ``rank`` for packed documents, as row ranges (``unit=0``).

    ``starts[b]``: the global start offsets of batch row ``b``'s documents (sorted, beginning with
    0; padding at the end counts as a document of its own); ``n``: the padded sequence length, a
    multiple of ``2 * size``. Rank ``r`` holds chunks ``r`` and ``2P-1-r`` (rows ``[0, c)`` and
    ``[c, 2c)``, ``c = n / 2P``). At step ``s`` the K/V of rank ``src = (r - s) mod P`` are here;
    every pair (query chunk ``a``, key chunk ``b <= a``) yields one call per shared document: causal
    when ``a == b``, unmasked otherwise. Rows of the batch with the same documents share their calls.
    """
    c = n // (2 * size)
    groups: dict[tuple[int, ...], list[int]] = {}
    for b, s in enumerate(starts):
        groups.setdefault(tuple(s), []).append(b)
    if len(groups) == 1:
        spans: list[tuple[tuple[int, ...], tuple[int, int] | None]] = [(next(iter(groups)), None)]
    else:
        spans = [(key, (b, b + 1)) for key, rows in groups.items() for b in rows]

    def chunks(r: int) -> tuple[tuple[int, int], tuple[int, int]]:
        return (r, 0), (2 * size - 1 - r, c)  # (global chunk, first local row)

    steps: Schedule = []
    for step in range(size):
        src = (rank - step) % size
        blocks: list[Block] = []
        for key, batch in spans:
            doc_starts = list(key)
            for qa, q0 in chunks(rank):
                for kb, k0 in chunks(src):
                    if kb > qa:
                        continue  # keys in the future
                    kv = {d: (s, e) for d, s, e in _segments(doc_starts, kb * c, (kb + 1) * c)}
                    for d, s, e in _segments(doc_starts, qa * c, (qa + 1) * c):
                        if d not in kv:
                            continue
                        ks, ke = kv[d]
                        q_rows = (q0 + s - qa * c, q0 + e - qa * c)
                        k_rows = (k0 + ks - kb * c, k0 + ke - kb * c)
                        blocks.append(Block(q_rows, k_rows, causal=qa == kb, unit=0, batch=batch))
        steps.append(tuple(blocks))
    return steps
