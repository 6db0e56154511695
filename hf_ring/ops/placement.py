"""Placements: which tokens of a sequence each rank of a ring holds, as segments of documents.

A ``Placement`` lists, per rank, the ``Segment``s it holds in local order (runs of one document's
consecutive tokens). ``zigzag_placement``: rank ``r`` holds chunks ``r`` and ``2P-1-r`` of ``2P``, cut
along the documents; ``balanced_placement``: the zigzag applied per long document, short documents
whole; ``chunk_placement``: segments cut where chunked attention restarts; ``span_placement``: segments
cut at the bidirectional spans (Gemma 3's image blocks) and tagged with them.
``schedule.placement_schedule`` turns a placement into a ring schedule and ``layout.ShardLayout`` holds
one per batch row. This module imports nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Placement", "Segment", "balanced_placement", "chunk_placement", "span_placement", "zigzag_placement"]


@dataclass(frozen=True)
class Segment:
    """A run of one document's tokens held by one rank: global ``[start, stop)`` at local row ``local``;
    ``span``: the bidirectional span it lies in (``span_placement``), ``-1`` for none."""

    doc: int
    start: int
    stop: int
    local: int
    span: int = -1


Placement = list[list[Segment]]
"""Which tokens each rank holds: per rank, its ``Segment``s in local order (a ``ShardLayout`` holds one
per batch row)."""


def _documents(starts: list[int], n: int) -> list[tuple[int, int]]:
    return [(s, starts[d + 1] if d + 1 < len(starts) else n) for d, s in enumerate(starts)]


def zigzag_placement(starts: list[int], n: int, size: int) -> Placement:
    """The zigzag placement (rank ``r``: chunks ``r`` and ``2P-1-r`` of ``2P``) cut along the documents
    that begin at ``starts`` (sorted, from 0) in a sequence of ``n`` tokens (a multiple of ``2P``)."""
    c = n // (2 * size)
    placement: Placement = []
    for r in range(size):
        segs = []
        for local0, chunk in ((0, r), (c, 2 * size - 1 - r)):
            lo, hi = chunk * c, (chunk + 1) * c
            for d, (s, e) in enumerate(_documents(starts, n)):
                if e > lo and s < hi:
                    segs.append(Segment(d, max(s, lo), min(e, hi), local0 + max(s, lo) - lo))
        placement.append(segs)
    return placement


def balanced_placement(starts: list[int], n: int, size: int, split_from: int | None = None) -> tuple[Placement, int]:
    """A placement that balances attention work over the ranks without cutting short documents up.

    Documents of at least ``split_from`` tokens (default: a quarter of a zigzag chunk, ``n / 8P``;
    ``benchmarks/bench_packed.py`` measured the trade-off between balance and kernel calls) -- the ones
    whose quadratic work would unbalance the ranks -- are cut into ``2P`` pieces of near-equal
    length and rank ``r`` holds pieces ``r`` and ``2P-1-r`` (the zigzag applied per document), so
    every rank holds ``1/P`` of each one's work. The shorter documents, in order, then fill the
    ranks up to the same token count, rank 0 first (a document that crosses from one rank to the
    next is cut there); each costs one kernel call on the diagonal. Returns the placement and the
    local length (the most tokens any rank holds; the others are padded up to it with rows that
    belong to no document, at most ``P - 1`` in all).
    """
    if split_from is None:
        split_from = max(1, n // (8 * size))
    held = [0] * size
    placement: Placement = [[] for _ in range(size)]
    short: list[tuple[int, int, int]] = []
    for d, (s, e) in enumerate(_documents(starts, n)):
        length = e - s
        if length < split_from:
            short.append((d, s, e))
            continue
        sizes = [length // (2 * size)] * (2 * size)
        for _ in range(length % (2 * size)):  # a leftover token to the emptiest rank's first free piece
            r = min(range(size), key=lambda x: (held[x] + sizes[x] + sizes[2 * size - 1 - x], x))
            sizes[r if sizes[r] <= sizes[2 * size - 1 - r] else 2 * size - 1 - r] += 1
        pos = s
        for i, k in enumerate(sizes):
            if k:
                r = i if i < size else 2 * size - 1 - i
                placement[r].append(Segment(d, pos, pos + k, held[r]))
                held[r] += k
                pos += k
    target = -(-n // size)
    r = 0
    for d, s, e in short:
        while s < e:
            while r < size - 1 and held[r] >= target:
                r += 1
            k = e - s if r == size - 1 else min(e - s, target - held[r])
            placement[r].append(Segment(d, s, s + k, held[r]))
            held[r] += k
            s += k
    return placement, max(held)


def chunk_placement(placement: Placement, starts: list[int], chunk: int) -> tuple[Placement, list[int]]:
    """``placement``'s segments cut where chunked attention restarts: every ``chunk`` positions of each
    document (from the document's start; ``starts``: the documents' global starts). Returns the cut
    placement, whose segments are numbered by the pieces they belong to, and the pieces' starts."""
    if chunk < 1:
        raise ValueError(f"chunk_placement: chunk must be >= 1, got {chunk}")
    ends = [*starts[1:], max(seg.stop for segs in placement for seg in segs)]
    cuts = sorted({s + i * chunk for s, e in zip(starts, ends) for i in range(max(1, -(-(e - s) // chunk)))})
    piece = {c: i for i, c in enumerate(cuts)}
    out: Placement = []
    for segs in placement:
        mine = []
        for seg in segs:
            doc0 = starts[seg.doc]
            pos = seg.start
            while pos < seg.stop:
                c0 = doc0 + (pos - doc0) // chunk * chunk
                stop = min(seg.stop, c0 + chunk)
                mine.append(Segment(piece[c0], pos, stop, seg.local + pos - seg.start))
                pos = stop
        out.append(mine)
    return out, cuts


def span_placement(placement: Placement, spans: list[tuple[int, int]]) -> Placement:
    """``placement``'s segments cut at the boundaries of the bidirectional ``spans`` (global ``[s, e)``,
    sorted, disjoint), each piece inside span ``k`` tagged ``span=k`` (``placement_schedule`` and
    ``band_schedule`` then let the tokens of a span see each other both ways)."""
    cuts = sorted({c for s, e in spans for c in (s, e)})
    out: Placement = []
    for segs in placement:
        mine = []
        for seg in segs:
            bounds = [seg.start, *(c for c in cuts if seg.start < c < seg.stop), seg.stop]
            for a, b in zip(bounds, bounds[1:]):
                span = next((k for k, (s, e) in enumerate(spans) if s <= a and b <= e), -1)
                mine.append(Segment(seg.doc, a, b, seg.local + a - seg.start, span))
        out.append(mine)
    return out
