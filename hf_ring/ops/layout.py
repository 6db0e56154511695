"""Where the tokens of one batch live across a context-parallel group: ``ShardLayout``.

``shard_batch`` lays a batch out once; everything that needs to know which global token a local
row holds reads it from the layout: the ring's schedules (which query rows meet which key rows),
the context-parallel token mixers and the halo exchanges (which rows precede a run of local rows in
global order, where a document begins), the loss (which rows are padding). The layout is plain data,
the same on every rank of the CP group (each rank derives it from the same full batch)::

    one sequence per row, P = 2 (R = 2, U = 1), N = 8:  c0 c1 c2 c3 (2 tokens each)
        rank 0: segments [0, 2) at local 0, [6, 8) at local 2      rank 1: [2, 4) at 0, [4, 6) at 2

    Ulysses x ring, P = 4 = R 2 x U 2: ring position r holds the zigzag shard above, and its U
    ranks r * U + u hold contiguous pieces of it (rank 1: global [6, 8) at local 0).

Packed documents use the per-document layout (``placement.balanced_placement``) over the ``R`` ring
positions; rows a rank holds beyond its segments are padding (they belong to no document). This
module imports only torch (for the index tensors).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch
from torch import Tensor

from .placement import Placement, Segment, span_placement, zigzag_placement
from .schedule import Schedule, placement_schedule

__all__ = ["Run", "ShardLayout", "sequence_layout", "with_spans"]


@dataclass(frozen=True)
class Run:
    """Local rows ``[local, local + length)`` of batch row ``row`` that hold the consecutive global
    positions ``[start, start + length)`` of one document, which begins at global ``doc_start``."""

    row: int
    local: int
    length: int
    start: int
    doc_start: int


@dataclass(frozen=True, eq=False)
class ShardLayout:
    """The layout of one batch over a CP group of ``P = ring * ulysses`` ranks.

    Attributes:
        n: tokens of each batch row's full (padded) sequence.
        ring, ulysses: ring positions ``R`` and Ulysses degree ``U``; CP rank ``= r * U + u``.
        local: rows each CP rank holds (``S_local``).
        rows: per batch row, the ring-level layout: ``R`` lists of ``Segment`` (global ``[start,
            stop)`` of document ``doc`` at ring-level local row ``local``); one entry when every
            batch row is laid out alike.
        starts: per batch row (one entry when shared), the global start of each document.
        packed: the batch holds packed documents (else one sequence per row, one document).
        spans: per batch row (one entry when shared), the bidirectional spans (global ``[s, e)``,
            ``with_spans``) whose tokens see each other both ways; ``()``: none.
    """

    n: int
    ring: int
    ulysses: int
    local: int
    rows: tuple[Placement, ...]
    starts: tuple[tuple[int, ...], ...]
    packed: bool = False
    spans: tuple[tuple[tuple[int, int], ...], ...] = ()

    @property
    def size(self) -> int:
        """CP ranks ``P``."""
        return self.ring * self.ulysses

    def _row(self, row: int) -> int:
        return row if len(self.rows) > 1 else 0

    def ring_segments(self, ring_pos: int, row: int = 0) -> list[Segment]:
        """Ring position ``ring_pos``'s segments of batch row ``row``, rows counted over its ``U * local`` rows."""
        return self.rows[self._row(row)][ring_pos]

    def segments(self, rank: int, row: int = 0) -> list[Segment]:
        """CP rank ``rank``'s segments of batch row ``row``, in local order (local rows of that rank)."""
        return list(_cp_segments(self, rank, self._row(row)))

    def runs(self, rank: int, row: int = 0) -> list[Run]:
        """CP rank ``rank``'s local rows of batch row ``row`` as maximal runs: consecutive local rows
        that hold consecutive global positions of one document."""
        return list(_runs(self, rank, self._row(row), row))

    def doc_start(self, row: int, doc: int) -> int:
        """Global start of document ``doc`` of batch row ``row``."""
        return self.starts[self._row(row)][doc]

    def schedule(self, ring_pos: int) -> Schedule:
        """The ring schedule of ring position ``ring_pos`` over every batch row (``placement_schedule``
        per row; one shared when the rows are laid out alike)."""
        if len(self.rows) == 1:
            return placement_schedule(self.rows[0], ring_pos)
        per_row = [placement_schedule(rows, ring_pos, (i, i + 1)) for i, rows in enumerate(self.rows)]
        return [tuple(blk for row in per_row for blk in row[step]) for step in range(len(per_row[0]))]

    def index(self, batch: int, device: torch.device | str = "cpu") -> Tensor:
        """``[P, batch, local]`` int64: the global position of every local row of every CP rank
        (``n``, one past the end, for padding rows)."""
        out = torch.full((self.size, batch, self.local), self.n, dtype=torch.long)
        for b in range(batch):
            for rank in range(self.size):
                for seg in self.segments(rank, b):
                    out[rank, b, seg.local : seg.local + seg.stop - seg.start] = torch.arange(seg.start, seg.stop)
        return out.to(device)

    def locate(self, batch: int) -> tuple[Tensor, Tensor]:
        """``(rank, local)``, each ``[batch, n]`` int64: which CP rank holds each global position, and
        at which local row (the inverse of ``index``)."""
        return _locate(self, batch)


@functools.lru_cache(maxsize=64)
def _cp_segments(layout: ShardLayout, rank: int, row: int) -> tuple[Segment, ...]:
    ring_pos, u = divmod(rank, layout.ulysses)
    lo, hi = u * layout.local, (u + 1) * layout.local
    out = []
    for seg in layout.rows[row][ring_pos]:
        a, b = max(seg.local, lo), min(seg.local + seg.stop - seg.start, hi)
        if a < b:
            start = seg.start + a - seg.local
            out.append(Segment(seg.doc, start, start + b - a, a - lo, seg.span))
    return tuple(out)


@functools.lru_cache(maxsize=64)
def _runs(layout: ShardLayout, rank: int, row: int, batch_row: int) -> tuple[Run, ...]:
    runs: list[Run] = []
    starts = layout.starts[row]
    for seg in _cp_segments(layout, rank, row):
        last = runs[-1] if runs else None
        if (
            last is not None
            and last.local + last.length == seg.local
            and last.start + last.length == seg.start
            and starts[seg.doc] == last.doc_start
        ):
            runs[-1] = Run(batch_row, last.local, last.length + seg.stop - seg.start, last.start, last.doc_start)
        else:
            runs.append(Run(batch_row, seg.local, seg.stop - seg.start, seg.start, starts[seg.doc]))
    return tuple(runs)


@functools.lru_cache(maxsize=16)
def _locate(layout: ShardLayout, batch: int) -> tuple[Tensor, Tensor]:
    rank_of = torch.full((batch, layout.n), -1, dtype=torch.long)
    local_of = torch.full((batch, layout.n), -1, dtype=torch.long)
    for b in range(batch):
        for rank in range(layout.size):
            for seg in layout.segments(rank, b):
                rank_of[b, seg.start : seg.stop] = rank
                local_of[b, seg.start : seg.stop] = torch.arange(seg.local, seg.local + seg.stop - seg.start)
    return rank_of, local_of


def with_spans(layout: ShardLayout, spans: list[list[tuple[int, int]]]) -> ShardLayout:
    """``layout`` with bidirectional ``spans`` (per batch row, global ``[s, e)``, sorted and disjoint):
    every row's segments cut at their boundaries (``placement.span_placement``), so its schedules let
    the tokens of a span see each other both ways. Unchanged when no row has a span."""
    if not any(spans):
        return layout
    if len(layout.rows) == 1 and all(s == spans[0] for s in spans):
        rows, starts, kept = (span_placement(layout.rows[0], spans[0]),), layout.starts, (tuple(spans[0]),)
    else:
        rows = tuple(span_placement(layout.rows[layout._row(b)], s) for b, s in enumerate(spans))
        starts = tuple(layout.starts[layout._row(b)] for b in range(len(spans)))
        kept = tuple(tuple(s) for s in spans)
    return dataclasses.replace(layout, rows=rows, starts=starts, spans=kept)


def sequence_layout(n: int, ring: int, ulysses: int = 1) -> ShardLayout:
    """The layout of one sequence of ``n`` tokens per batch row (``n`` a multiple of
    ``zigzag.hybrid_multiple(ring * ulysses, ulysses)``): the zigzag over ``ring`` positions, each
    position's shard cut into ``ulysses`` contiguous pieces; one document."""
    return ShardLayout(n, ring, ulysses, n // (ring * ulysses), (zigzag_placement([0], n, ring),), ((0,),))
