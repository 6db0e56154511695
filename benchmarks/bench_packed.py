"""Packed documents: per-rank attention work of each placement, from the ring schedules themselves.

    python -m benchmarks.bench_packed --out benchmarks/results/packed.jsonl     # ~1 min, no ranks

For document-length mixes in 128K-token windows -- lognormal lengths with means of 2K and 16K
(sigma 1), and one 64K document plus lognormal(1K) ones -- and P = 4 and 8, it builds the ring
schedule of every rank (``hf_ring.ops.schedule``) for three placements of the packed stream:

* ``zigzag``: the global zigzag (rank r holds chunks r and 2P-1-r) cut along documents;
* ``contiguous``: rank r holds the r-th P-th of the stream, cut along documents;
* ``per_document``: ``balanced_placement``, the zigzag applied to every document (each rank holds
  1/P of every document's work; a document's leftover tokens go to the emptiest rank).

Work of a rank = the score entries of its kernel calls (causal S x S blocks count S(S+1)/2),
i.e. exactly the query-key pairs its tokens need. Reported per placement (median, p20, p80 over 20
windows): ``max/mean`` rank work, padding overhead (padded tokens / tokens), the share of
(query segment, key segment) pairs that share no document and so make no kernel call, and kernel
calls per rank per layer: block by block, and with a varlen kernel (flash-attn's, which takes a ring
step's blocks in one call per mask kind).

    python -m benchmarks.bench_packed --throughput --out benchmarks/results/packed_throughput.jsonl

measures tokens/s of attention forward + backward (Hq 8, Hkv 2, D 64, fp32) on P = 2 gloo ranks,
8K-token windows of the same mixes scaled down 16x, for the packed stream in each placement and for
the same documents padded into rows of the longest one (what one pays without packing).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch

from benchmarks import harness as H
from hf_ring.ops.placement import Placement, Segment, balanced_placement, zigzag_placement
from hf_ring.ops.schedule import placement_schedule
from hf_ring.ops.varlen import varlen_calls

N = 128 * 1024
MIXES = ("lognormal-2K", "lognormal-16K", "64K+lognormal-1K")


def lengths(mix: str, n: int, rng: np.random.Generator) -> list[int]:
    """Document lengths that fill ``n`` tokens (the last one cut to fit)."""
    out: list[int] = []

    def draw(mean: float) -> int:
        return max(1, int(rng.lognormal(np.log(mean) - 0.5, 1.0)))  # sigma 1: the mean is ``mean``

    if mix.startswith("64K"):
        out.append(64 * 1024)
    mean = {"lognormal-2K": 2048, "lognormal-16K": 16384}.get(mix, 1024)
    while sum(out) < n:
        out.append(draw(mean))
    out[-1] -= sum(out) - n
    return [x for x in out if x > 0]


def starts_of(ls: list[int]) -> list[int]:
    return list(np.cumsum([0, *ls[:-1]]))


def contiguous_placement(starts: list[int], n: int, size: int) -> Placement:
    c = n // size
    placement: Placement = []
    for r in range(size):
        lo, hi = r * c, (r + 1) * c
        ends = [*starts[1:], n]
        placement.append([Segment(d, max(s, lo), min(e, hi), max(s, lo) - lo)
                       for d, (s, e) in enumerate(zip(starts, ends)) if e > lo and s < hi])  # fmt: skip
    return placement


def rank_work(placement: Placement) -> tuple[list[float], int, int, int]:
    """Score entries per rank, and (calls made, segment pairs that share no document, calls made by a
    varlen kernel such as flash-attn's, which takes a step's blocks in one call per mask kind)."""
    work, calls, skipped, varlen = [], 0, 0, 0
    local = max((s.local + s.stop - s.start for segs in placement for s in segs), default=0)
    for r in range(len(placement)):
        total = 0.0
        for step, blocks in enumerate(placement_schedule(placement, r)):
            src = (r - step) % len(placement)
            skipped += sum(1 for q in placement[r] for k in placement[src] if q.doc != k.doc)
            varlen += len(blocks) if len(blocks) < 2 else len(varlen_calls(blocks, local, 1, torch.device("cpu")))
            for b in blocks:
                sq, sk = b.q[1] - b.q[0], b.kv[1] - b.kv[0]
                total += sq * (sq + 1) / 2 if b.causal else sq * sk
                calls += 1
        work.append(total)
    return work, calls, skipped, varlen


def placements(ls: list[int], size: int) -> dict[str, tuple[Placement, float]]:
    """Each placement and its padding overhead (padded tokens / tokens)."""
    n = sum(ls)
    n_pad = -(-n // (2 * size)) * 2 * size
    starts = starts_of(ls)
    padded_starts = starts + ([n] if n_pad > n else [])
    per_doc, local = balanced_placement(starts, n, size)
    return {
        "zigzag": (zigzag_placement(padded_starts, n_pad, size), (n_pad - n) / n),
        "contiguous": (contiguous_placement(padded_starts, n_pad - n_pad % size, size), (n_pad - n) / n),
        "per_document": (per_doc, (local * size - n) / n),
    }


def run(windows: int, sizes: tuple[int, ...]) -> list[dict]:
    table = H.Table({"machine": H.machine_info(), "versions": H.versions()}, lambda _: 1)
    for mix in MIXES:
        rng = np.random.default_rng(0)
        samples = [lengths(mix, N, rng) for _ in range(windows)]
        for p in sizes:
            acc: dict[str, dict[str, list[float]]] = {}
            for ls in samples:
                for name, (placement, pad) in placements(ls, p).items():
                    work, calls, skipped, varlen = rank_work(placement)
                    a = acc.setdefault(
                        name, {"balance": [], "padding": [], "skipped": [], "calls": [], "varlen_calls": []}
                    )
                    a["varlen_calls"].append(varlen / p)
                    a["balance"].append(max(work) / np.mean(work))
                    a["padding"].append(pad)
                    a["skipped"].append(skipped / max(1, skipped + calls))
                    a["calls"].append(calls / p)
            for name, a in acc.items():
                for metric, unit in (("balance", "max/mean"), ("padding", "fraction"), ("skipped", "fraction"),
                                     ("calls", "kernel calls per rank per layer"),
                                     ("varlen_calls", "varlen kernel calls per rank per layer")):  # fmt: skip
                    table.add(f"packed_{metric}", name, unit, p, N, H.stats(a[metric]), unit, x=mix,
                              note=f"{windows} windows of {N} tokens")  # fmt: skip
    return table.rows


def _throughput_worker(rank: int, size: int, cfg: dict) -> dict:
    import time

    import torch

    from hf_ring.ops.ring import ring_attention
    from hf_ring.ops.zigzag import zigzag

    hq, hkv, d = 8, 2, 64
    g = torch.Generator().manual_seed(0)
    out: dict[str, list[float]] = {}

    def timed(name: str, q, k, v, schedule=None) -> None:
        for i in range(cfg["iters"] + 1):
            torch.distributed.barrier()
            t0 = time.perf_counter()
            ring_attention(q, k, v, schedule=schedule).sum().backward()
            torch.distributed.barrier()
            if i:  # the first is a warm-up
                out.setdefault(name, []).append(time.perf_counter() - t0)

    for ls in cfg["windows"]:
        for name, (placement, _) in placements(ls, size).items():
            if name == "contiguous":
                continue
            local = max(sum(s.stop - s.start for s in segs) for segs in placement)
            q, k, v = (torch.randn(1, local, h, d, generator=g, requires_grad=True) for h in (hq, hkv, hkv))
            timed(name, q, k, v, placement_schedule(placement, rank))
        lmax = -(-max(ls) // (2 * size)) * 2 * size  # each document alone in a row padded to the longest
        q = zigzag(torch.randn(len(ls), lmax, hq, d, generator=g), 1, size, rank).requires_grad_()
        k, v = (zigzag(torch.randn(len(ls), lmax, hkv, d, generator=g), 1, size, rank).requires_grad_() for _ in "kv")
        timed("padded_rows", q, k, v)
    return out


def throughput(quick: bool) -> list[dict]:
    """Tokens/s of attention fwd+bwd per placement, P = 2, windows of N / 16 tokens."""
    rng = np.random.default_rng(1)
    n = N // 16
    scaled = {m: [max(1, x // 16) for x in lengths(m, N, rng)] for m in MIXES}
    table = H.Table({"machine": H.machine_info(), "versions": H.versions()}, lambda _: 1)
    for mix, ls in scaled.items():
        ls[-1] += n - sum(ls)
        cfg = {"windows": [ls], "iters": 1 if quick else 3}
        per_rank, load = H.launch(_throughput_worker, 2, cfg, threads=1, timeout=1800)
        for name in per_rank[0]:
            times = [max(r[name][i] for r in per_rank) for i in range(len(per_rank[0][name]))]
            table.add("packed_throughput", name, "tokens/s", 2, n, H.stats([n / t for t in times]), "tokens/s", x=mix,
                      note=f"attention fwd+bwd, Hq 8 Hkv 2 D 64 fp32; {len(ls)} documents; foreign load "
                           f"{100 * load:.0f}%")  # fmt: skip
    return table.rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="benchmarks/results/packed.jsonl")
    ap.add_argument("--windows", type=int, default=20)
    ap.add_argument("--quick", action="store_true", help="2 windows, P = 4")
    ap.add_argument("--throughput", action="store_true", help="time attention on 2 gloo ranks instead")
    args = ap.parse_args()
    out = Path(args.out)
    if args.throughput:
        rows = throughput(args.quick)
        H.write_rows(out, rows)
        for r in rows:
            print(f"{r['provider']:13s} {r['x']:18s} {r['median']:10.0f} tokens/s")
        return
    rows = run(2 if args.quick else args.windows, (4,) if args.quick else (4, 8))
    H.write_rows(out, rows)
    for r in rows:
        if r["name"] == "packed_balance" or (r["name"] == "packed_padding" and r["provider"] == "per_document"):
            print(f"{r['name']:15s} {r['provider']:13s} P={r['P']} {r['x']:18s} {r['median']:.4f} "
                  f"[{r['p20']:.4f}, {r['p80']:.4f}]")  # fmt: skip
    print(f"wrote {out}")
    H.draw(out)


if __name__ == "__main__":
    main()
