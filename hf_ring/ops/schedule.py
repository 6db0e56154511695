"""Ring schedules as data: which local query rows meet which rows of the visiting K/V block.

At ring step ``s`` rank ``r`` holds the K/V block of rank ``src = (r - s) mod P``. A schedule lists,
for every step, the kernel calls to make. Rows are counted in halves of the local length, because
the zigzag order gives every rank two chunks of the sequence::

    sequence cut into 2P chunks (P = 3):   c0 c1 c2 c3 c4 c5
    rank 0 holds [c0 | c5], rank 1 holds [c1 | c4], rank 2 holds [c2 | c3]

    step 0, src == r : both chunks attend both chunks, causal (local order keeps global order)
    src < r          : both local chunks attend src's first chunk only, no mask
    src > r          : only the local second chunk attends both of src's chunks, no mask

Every off-diagonal step is half a block of work and needs no mask, and every rank does the same
work.

A ``Placement`` says which tokens each rank holds (``placement.py``: per rank, ``Segment``s of
documents in local order), and ``placement_schedule`` turns one into a ring schedule
(``layout.ShardLayout`` holds one per batch row; ``make_schedule``'s ``order`` names the two
placements of one unpacked sequence).

Packed documents (``document_schedule``): the same zigzag over the packed stream, each chunk pair
cut along document boundaries. A token attends only to earlier tokens of its own document, so a
chunk pair contributes one kernel call per document that both chunks hold -- causal on the
diagonal (the same rows on both sides), unmasked below it -- and chunk pairs that share no document
make no call at all.

Layer masks (``band_block(s)``, ``chunk_placement``, ``placement_schedule(..., window=W)``): a sliding window
keeps key ``j`` for query ``i`` iff ``i - W < j <= i`` (global positions of one document, as
transformers' ``sliding_window_causal_mask_function``); a block that crosses the band's edge carries
it as ``Block.window``, a block outside the band is no call, and trailing ring steps in which no
rank has a call are dropped. Chunked attention (boundaries every ``C`` positions of a document) is
a document placement cut at the chunk boundaries.

Bidirectional spans (``span_placement``: Gemma 3's image tokens, transformers' ``blockwise_overlay``):
the tokens of one span also see the later tokens of their span, so a query of span ``[s, e)`` sees the
keys ``[doc start, e)`` (under a window, ``i - W < j < e``). The placement is cut at the spans'
boundaries and every pair of segments of one span is one unmasked call, whatever their order; the
other pairs are as above. This module imports only ``placement``.
"""

from __future__ import annotations

from dataclasses import dataclass

from .placement import Placement, Segment, zigzag_placement

ORDERS = ("zigzag", "contiguous")  # how a sequence is dealt to the ranks (make_schedule's order)


@dataclass(frozen=True)
class Block:
    """One kernel call: local query rows ``q`` meet the visiting block's rows ``kv``.

    ``q`` and ``kv`` are ``[start, stop)`` in units of ``1 / unit`` of the local length: halves for
    the zigzag schedules (``unit=2``); rows for document schedules (``unit=0`` means "in rows").
    ``batch``: the batch rows of the call (``None``: all). ``window``: a band mask ``(left, right)``
    in flash-attn's convention (aligned bottom-right: key ``j`` is visible to query ``i`` iff
    ``-left <= j - i - (Sk - Sq) <= right``), with ``causal=False``; ``None``: no band. The schedules
    make only ``flash_exact`` bands (flash-attn's window clamps leave them unchanged).
    """

    q: tuple[int, int]
    kv: tuple[int, int]
    causal: bool
    unit: int = 2
    batch: tuple[int, int] | None = None
    window: tuple[int, int] | None = None

    def rows(self, which: tuple[int, int], n: int) -> slice:
        """``which`` (``self.q`` or ``self.kv``) as a slice of ``n`` local rows."""
        if self.unit == 0:
            return slice(which[0], which[1])
        return slice(which[0] * n // self.unit, which[1] * n // self.unit)


ALL, FIRST, SECOND = (0, 2), (0, 1), (1, 2)


def make_schedule(order: str, causal: bool, rank: int, size: int) -> list[tuple[Block, ...]]:
    """The kernel calls of each of the ``size`` ring steps for ``rank``.

    ``order="zigzag"``: rank ``r`` holds chunks ``r`` and ``2P-1-r`` of ``2P``.
    ``order="contiguous"``: rank ``r`` holds chunk ``r`` of ``P`` (kept for comparison: causal work
    is unbalanced across ranks, rank ``P-1`` does ``2P-1`` times the work of rank 0).
    """
    if order not in ORDERS:
        raise ValueError(f"unknown order {order!r}; choose one of {ORDERS}")
    steps: list[tuple[Block, ...]] = []
    for s in range(size):
        src = (rank - s) % size
        if not causal:
            steps.append((Block(ALL, ALL, False),))
        elif src == rank:
            steps.append((Block(ALL, ALL, True),))
        elif src < rank:
            steps.append((Block(ALL, FIRST if order == "zigzag" else ALL, False),))
        elif order == "zigzag":
            steps.append((Block(SECOND, ALL, False),))
        else:
            steps.append(())  # contiguous: a later rank's keys are all in the future
    return steps


Schedule = list[tuple[Block, ...]]


def band_block(
    q: tuple[int, int], k: tuple[int, int], q_local: int, k_local: int, window: int | None,
    batch: tuple[int, int] | None = None,
) -> Block | None:  # fmt: skip
    """The call in which global positions ``q = [a, b)`` (local rows from ``q_local``) attend to the
    earlier-or-equal positions ``k = [c, d)`` (local rows from ``k_local``) of the same document
    within a window of ``window`` keys (``i - W < j <= i``; ``None``: no window), or ``None`` when
    no pair is visible. Rows that see no key and keys no row sees are cut off first, so every query
    row of the block sees at least one key. The block is unmasked, causal (square, on the diagonal)
    or banded (``Block.window``).
    """
    w = window if window is not None else q[1] - k[0] + 1  # a window that never binds
    qa, qb = max(q[0], k[0]), min(q[1], k[1] + w - 1)
    ka, kb = max(k[0], q[0] - w + 1), min(k[1], q[1])
    if qa >= qb or ka >= kb:
        return None
    rows = (q_local + qa - q[0], q_local + qb - q[0]), (k_local + ka - k[0], k_local + kb - k[0])
    upper = kb - 1 > qa  # a key after the first query
    lower = ka < qb - w  # a key too old for the last query
    if not upper and not lower:
        return Block(*rows, causal=False, unit=0, batch=batch)
    if not lower and qa == ka and qb == kb:
        return Block(*rows, causal=True, unit=0, batch=batch)
    right = qb - kb
    return Block(*rows, causal=False, unit=0, batch=batch, window=(w - 1 - right, right))


def flash_exact(b: Block) -> bool:
    """Whether flash-attn applies the band of block ``b`` (rows, ``unit=0``) as written.

    flash-attn 2.6.3-2.8.3 rewrites a window before its kernel runs (``mha_fwd``/``mha_bwd``: a
    ``window_size_right >= Sk`` becomes ``-1``, which ``set_params_fprop`` turns into ``Sk``; the varlen
    functions do the same against ``max_seqlen_k``). A band keeps key ``j`` of row ``i`` below
    ``i + 1 + Sk - Sq + right`` (bottom-right), so replacing ``right`` by ``Sk`` hides keys from the first
    ``Sq - Sk - 1`` rows. The band is unchanged when ``right < Sk`` or ``Sq <= Sk + 1`` (then even
    ``right = Sk`` reaches every key, and the left edge's clamp never binds): ``docs/standins.md``.
    """
    if b.window is None:
        return True
    sq, sk = b.q[1] - b.q[0], b.kv[1] - b.kv[0]
    return b.window[1] < sk or sq <= sk + 1


def _flash_exact_blocks(
    q: tuple[int, int], k: tuple[int, int], q_local: int, k_local: int, window: int | None,
    batch: tuple[int, int] | None,
) -> list[Block]:  # fmt: skip
    """``band_block``, cut where flash-attn would change its band (``flash_exact``): into the rows that
    see a prefix of the keys, the rows that see all of them (unmasked) and the rows that see a suffix
    (each exact), neighbours merged again where the merge stays exact."""
    b = band_block(q, k, q_local, k_local, window, batch)
    if b is None or flash_exact(b):
        return [] if b is None else [b]
    assert window is not None  # a banded block has a window
    qa, qb = q[0] + b.q[0] - q_local, q[0] + b.q[1] - q_local
    ka, kb = k[0] + b.kv[0] - k_local, k[0] + b.kv[1] - k_local
    cuts = sorted({qa, qb, min(max(kb - 1, qa), qb), min(max(ka + window, qa), qb)})
    parts: list[tuple[int, int]] = []
    for a, z in zip(cuts, cuts[1:]):
        if parts:  # merge with the previous part where the union is still exact
            a0 = parts[-1][0]
            merged = band_block((a0, z), k, q_local + a0 - q[0], k_local, window, batch)
            if merged is not None and flash_exact(merged):
                parts[-1] = (a0, z)
                continue
        parts.append((a, z))
    out = [band_block(p, k, q_local + p[0] - q[0], k_local, window, batch) for p in parts]
    blocks = [x for x in out if x is not None]
    if not all(flash_exact(x) for x in blocks):  # pragma: no cover - each part is exact by construction
        raise RuntimeError(f"band rows {q} x keys {k} (window {window}): no flash-exact split")
    return blocks


TILE = 256  # fewest query rows of a band tile


def band_blocks(
    q: tuple[int, int], k: tuple[int, int], q_local: int, k_local: int, window: int | None,
    batch: tuple[int, int] | None = None,
) -> list[Block]:  # fmt: skip
    """``band_block`` with long bands cut into tiles of ``max(W, TILE)`` query rows, each against the
    keys its rows see (at most ``2 max(W, TILE) - 1``): a windowed layer's kernel work stays
    ``O(N W)`` rather than ``O(N * block)``, and its masks small. Every banded block is ``flash_exact``
    (a block that flash-attn would mask differently is cut in two or three)."""
    tile = max(window or 0, TILE)
    if window is None or q[1] - q[0] <= tile:
        return _flash_exact_blocks(q, k, q_local, k_local, window, batch)
    out = []
    for t0 in range(q[0], q[1], tile):
        out += _flash_exact_blocks((t0, min(q[1], t0 + tile)), k, q_local + t0 - q[0], k_local, window, batch)
    return out


def _one_span(qs: Segment, ks: Segment) -> bool:
    return qs.span >= 0 and ks.span == qs.span and ks.doc == qs.doc


def trim_steps(schedules: list[Schedule]) -> list[Schedule]:
    """Every rank's schedule cut after the last step in which some rank still has a call (the ring
    then makes fewer hops; at least one step is kept)."""
    last = max((s for sched in schedules for s, blocks in enumerate(sched) if blocks), default=0)
    return [sched[: last + 1] for sched in schedules]


def placement_schedule(
    placement: Placement, rank: int, batch: tuple[int, int] | None = None, window: int | None = None
) -> Schedule:
    """The ring schedule of ``rank`` for ``placement``, as row ranges (``unit=0``).

    At step ``s`` the K/V of rank ``src = (r - s) mod P`` are here. Every pair of segments of the
    same document makes one call: causal when it is the same segment (the diagonal), unmasked when
    the keys come entirely before the queries; keys after the queries, and segments of different
    documents, make no call; the segments of one bidirectional span (``span_placement``) meet unmasked.
    With ``window`` (a sliding window of ``W`` keys, ``i - W < j <= i``)
    pairs are cut to the band (``band_block``) and the schedule ends after the last step in which
    any rank has a call.
    """
    if window is not None:
        return trim_steps([band_schedule(placement, r, batch, window) for r in range(len(placement))])[rank]
    steps: Schedule = []
    for pairs in _step_pairs(placement, rank):
        blocks = []
        for qs, ks in pairs:
            q_rows, k_rows = (qs.local, qs.local + qs.stop - qs.start), (ks.local, ks.local + ks.stop - ks.start)
            if _one_span(qs, ks):
                blocks.append(Block(q_rows, k_rows, causal=False, unit=0, batch=batch))
            elif ks == qs:
                blocks.append(Block(q_rows, k_rows, causal=True, unit=0, batch=batch))
            elif ks.stop <= qs.start:
                blocks.append(Block(q_rows, k_rows, causal=False, unit=0, batch=batch))
            else:
                raise ValueError(f"placement_schedule: segments {qs} and {ks} overlap")
        steps.append(tuple(blocks))
    return steps


def _step_pairs(placement: Placement, rank: int) -> list[list[tuple[Segment, Segment]]]:
    """Per ring step ``s`` (K/V of rank ``(rank - s) mod P`` here): the pairs (query segment of
    ``rank``, key segment of that rank) of one document whose keys start before the queries end, or of
    one bidirectional span."""
    size = len(placement)
    return [
        [
            (qs, ks)
            for qs in placement[rank]
            for ks in placement[(rank - step) % size]
            if ks.doc == qs.doc and (ks.start < qs.stop or _one_span(qs, ks))
        ]
        for step in range(size)
    ]


def band_schedule(placement: Placement, rank: int, batch: tuple[int, int] | None, window: int) -> Schedule:
    """``rank``'s ring steps for ``placement`` under a sliding ``window`` (``band_blocks`` per pair of
    segments of one document), all ``P`` of them (``trim_steps`` cuts them over every rank). Two
    segments of one bidirectional span meet unmasked when every query sees every key (``i - W < j``);
    a span reaching further than the window raises ``ValueError``."""
    steps: Schedule = []
    for pairs in _step_pairs(placement, rank):
        blocks: list[Block] = []
        for qs, ks in pairs:
            if not _one_span(qs, ks):
                blocks += band_blocks((qs.start, qs.stop), (ks.start, ks.stop), qs.local, ks.local, window, batch)
            elif qs.stop - window <= ks.start:  # the last query sees the first key: every pair is visible
                rows = (qs.local, qs.local + qs.stop - qs.start), (ks.local, ks.local + ks.stop - ks.start)
                blocks.append(Block(*rows, causal=False, unit=0, batch=batch))
            else:
                raise ValueError(
                    f"band_schedule: the bidirectional span holding positions {qs.start}..{qs.stop - 1} reaches "
                    f"further back than the sliding window of {window} keys (query {qs.stop - 1} and key "
                    f"{ks.start}); spans longer than the window are not computed. Use images of at most "
                    f"{window} tokens, or run without context parallelism."
                )
        steps.append(tuple(blocks))
    return steps


def document_schedule(starts: list[list[int]], n: int, rank: int, size: int) -> Schedule:
    """The zigzag ring schedule of ``rank`` for packed documents (``zigzag_placement`` per batch row).

    ``starts[b]``: the global start offsets of batch row ``b``'s documents (sorted, beginning with
    0; padding at the end counts as a document of its own); ``n``: the padded sequence length, a
    multiple of ``2 * size``. Rows of the batch with the same documents share their calls.
    """
    rows: dict[tuple[int, ...], list[int]] = {}
    for b, s in enumerate(starts):
        rows.setdefault(tuple(s), []).append(b)
    if len(rows) == 1:
        return placement_schedule(zigzag_placement(starts[0], n, size), rank)
    per_row = [placement_schedule(zigzag_placement(starts[b], n, size), rank, (b, b + 1)) for b in range(len(starts))]
    return [tuple(blk for row in per_row for blk in row[step]) for step in range(size)]
