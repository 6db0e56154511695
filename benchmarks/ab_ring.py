"""Paired A/B timing and memory of hf_ring variants (to measure a proposed change to hf_ring).

    python -m benchmarks.ab_ring --variant fix=/path/to/checkout [--variant ...] \\
        [--P 2 4] [--N 8192 16384] [--iters 5] [--out benchmarks/results/ab.json]
    python -m benchmarks.ab_ring --quick                     # main against itself, P=2, N=512: smoke test

A variant is a directory holding an ``hf_ring`` package (a patched copy of this repository). Each is
imported under its own name next to this checkout's ``hf_ring`` ("main"), so all of them run in the
same gloo processes, interleaved within every iteration (main, variant 1, ..., from one barrier
each): machine noise hits them alike and the per-iteration ratios t_variant / t_main are paired.
Per variant: fwd+bwd wall time (max over ranks), main-thread CPU time (max over ranks), and the peak
RSS growth of one fwd+bwd (measured first, as in bench_attention). Ranks, load control and the
resident-set probes come from ``benchmarks.harness``.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks import harness as H


def _import_variant(name: str, root: str):
    """Import ``root/hf_ring`` as package ``name`` (its __init__ is skipped: only the ring modules);
    returns its ring module (``ops/ring.py``, or ``ring.py`` in checkouts before the ops/ layout)."""
    pkg_dir = os.path.join(root, "hf_ring")
    spec = importlib.util.spec_from_loader(name, loader=None, is_package=True)
    pkg = importlib.util.module_from_spec(spec)
    pkg.__path__ = [pkg_dir]
    sys.modules[name] = pkg
    sub = "ops.ring" if os.path.exists(os.path.join(pkg_dir, "ops", "ring.py")) else "ring"
    return importlib.import_module(f"{name}.{sub}")


def _fwd_bwd(ring_mod, q, k, v, do) -> dict:
    """One fwd+bwd of ``ring_mod.ring_attention`` on the world group: wall and main-thread CPU seconds."""
    import torch

    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    c0, t0 = time.thread_time(), time.perf_counter()
    out = ring_mod.ring_attention(q, k, v, causal=True)
    t1 = time.perf_counter()
    grads = torch.autograd.grad(out, (q, k, v), do)
    t2, c2 = time.perf_counter(), time.thread_time()
    del out, grads
    return {"fwd": t1 - t0, "bwd": t2 - t1, "total": t2 - t0, "cpu": c2 - c0}


def _iteration(mods: dict, inp: tuple) -> dict:
    """Every module once, in order, each from a barrier."""
    import torch.distributed as dist

    rec = {}
    for name, m in mods.items():
        dist.barrier()
        rec[name] = _fwd_bwd(m, *inp)
    return rec


def _worker(rank: int, size: int, cfg: dict) -> dict:
    """Memory of one fwd+bwd per (N, module), then the paired timings (``harness.measure``)."""
    import gc

    import torch.distributed as dist

    import hf_ring.ops.ring
    from benchmarks import workloads as W

    mods = {"main": hf_ring.ops.ring}
    for name, root in cfg["variants"].items():
        mods[name] = _import_variant(f"hf_ring_ab_{name}", root)
    res: dict = {"memory": {}, "timing": {}}
    with H.allocations_to_os():
        for m in mods.values():  # warm up every module outside the measurement
            _fwd_bwd(m, *W.local_inputs(64 * size, rank, size))
        for n in cfg["Ns"]:
            inp = W.local_inputs(n, rank, size)
            res["memory"][str(n)] = {}
            for name, m in mods.items():
                gc.collect()
                dist.barrier()
                rss0 = H.status_kib("VmRSS")
                H.reset_hwm()
                _fwd_bwd(m, *inp)
                res["memory"][str(n)][name] = (H.status_kib("VmHWM") - rss0) / 1024
    meter = H.GroupLoad(None, rank, len(os.sched_getaffinity(0)))
    for n in cfg["Ns"]:
        inp = W.local_inputs(n, rank, size)
        kept, loads, redone = H.measure(lambda inp=inp: _iteration(mods, inp), meter, warmup=1, iters=cfg["iters"],
                                        max_foreign=cfg["max_foreign"], max_redo=1)  # fmt: skip
        samples = {name: [rec[name] for rec in kept] for name in mods}
        res["timing"][str(n)] = {"samples": samples, "foreign": loads, "redone": redone}
    return res


def _summarise(parts: list, P: int, names: list[str]) -> dict:
    """Per N: medians of wall and CPU time (max over ranks per iteration), peak RSS growth, and the
    paired ratios variant / main as [p20, median, p80]."""
    out: dict = {}
    for n in parts[0]["timing"]:
        t = [p["timing"][n]["samples"] for p in parts]
        row: dict = {"foreign_load_median": float(np.median(parts[0]["timing"][n]["foreign"])),
                     "redone": parts[0]["timing"][n]["redone"]}  # fmt: skip
        wall = {m: H.per_iter_max([r[m] for r in t], "total") for m in names}
        cpu = {m: H.per_iter_max([r[m] for r in t], "cpu") for m in names}
        for m in names:
            row[m] = {"wall_median_s": float(np.median(wall[m])), "cpu_median_s": float(np.median(cpu[m])),
                      "peak_rss_growth_MiB": max(p["memory"][n][m] for p in parts)}  # fmt: skip
            if m != "main":
                for key, x in (("wall_ratio_vs_main", wall), ("cpu_ratio_vs_main", cpu)):
                    med, p20, p80 = H.stats([a / b for a, b in zip(x[m], x["main"])])
                    row[m][key] = [p20, med, p80]
        out[f"P={P} N={n}"] = row
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=DIR")
    ap.add_argument("--P", type=int, nargs="+", default=[2])
    ap.add_argument("--N", type=int, nargs="+", default=[8192])
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None, help="total threads (default: all cores)")
    ap.add_argument("--max-foreign", type=float, default=0.10)
    ap.add_argument("--out", default=None)
    ap.add_argument("--quick", action="store_true", help="P=2, N=512, 1 iteration (smoke test)")
    args = ap.parse_args(argv)
    if args.quick:
        args.P, args.N, args.iters = [2], [512], 1
    variants = dict(v.split("=", 1) for v in args.variant)
    total = args.threads or len(os.sched_getaffinity(0))
    summary: dict = {}
    for P in args.P:
        cfg = {"Ns": args.N, "threads": H.threads_per_rank(total, P), "iters": args.iters,
               "variants": variants, "max_foreign": args.max_foreign}  # fmt: skip
        parts, _ = H.launch(_worker, P, cfg, threads=cfg["threads"], timeout=3600.0)
        summary.update(_summarise(parts, P, ["main", *variants]))
    text = json.dumps(summary, indent=1)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
