"""Paired A/B timing and memory of hf_ring variants (to measure a proposed change to hf_ring).

    python -m benchmarks.ab_ring --variant fix=/path/to/checkout [--variant ...] \\
        [--P 2 4] [--N 8192 16384] [--iters 5] [--out benchmarks/results/ab.json]

A variant is a directory holding an ``hf_ring`` package (a patched copy of this repository). Each is
imported under its own name next to this checkout's ``hf_ring`` ("main"), so all of them run in the
same gloo processes, interleaved within every iteration (main, variant 1, ..., from one barrier
each): machine noise hits them alike and the per-iteration ratios t_variant / t_main are paired.
Per variant: fwd+bwd wall time (max over ranks), main-thread CPU time (max over ranks), and the peak
RSS growth of one fwd+bwd (measured first, as in bench_attention).
"""

from __future__ import annotations

import argparse
import gc
import importlib
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.bench_attention import GroupLoad, _reset_hwm, _status_kib


def _import_variant(name: str, root: str):
    """Import ``root/hf_ring`` as package ``name`` (its __init__ is skipped: only the ring modules)."""
    pkg_dir = os.path.join(root, "hf_ring")
    spec = importlib.util.spec_from_loader(name, loader=None, is_package=True)
    pkg = importlib.util.module_from_spec(spec)
    pkg.__path__ = [pkg_dir]
    sys.modules[name] = pkg
    return importlib.import_module(f"{name}.ring")


def _fwd_bwd(ring_mod, q, k, v, do) -> dict:
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    import torch

    c0, t0 = time.thread_time(), time.perf_counter()
    out = ring_mod.ring_attention(q, k, v, causal=True)
    t1 = time.perf_counter()
    grads = torch.autograd.grad(out, (q, k, v), do)
    t2, c2 = time.perf_counter(), time.thread_time()
    del out, grads
    return {"fwd": t1 - t0, "bwd": t2 - t1, "total": t2 - t0, "cpu": c2 - c0}


def _worker(rank: int, size: int, init_file: str, cfg: dict, out_path: str) -> None:
    import ctypes

    import torch
    import torch.distributed as dist

    from benchmarks import workloads as W

    torch.set_num_threads(cfg["threads"])
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=size)
    try:
        import hf_ring.ops.ring

        mods = {"main": hf_ring.ops.ring}
        for name, root in cfg["variants"].items():
            mods[name] = _import_variant(f"hf_ring_ab_{name}", root)
        res: dict = {"memory": {}, "timing": {}}
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 64 * 1024)  # M_MMAP_THRESHOLD: see bench_attention._memory
        libc.mallopt(-1, 0)  # M_TRIM_THRESHOLD
        for m in mods.values():  # warm up every module outside the measurement
            _fwd_bwd(m, *W.local_inputs(64 * size, rank, size))
        for n in cfg["Ns"]:
            inp = W.local_inputs(n, rank, size)
            res["memory"][str(n)] = {}
            for name, m in mods.items():
                gc.collect()
                dist.barrier()
                rss0 = _status_kib("VmRSS")
                _reset_hwm()
                _fwd_bwd(m, *inp)
                res["memory"][str(n)][name] = (_status_kib("VmHWM") - rss0) / 1024
        libc.mallopt(-3, 32 * 1024 * 1024)
        libc.mallopt(-1, 64 * 1024 * 1024)
        libc.malloc_trim(0)
        meter = GroupLoad(None, rank, len(os.sched_getaffinity(0)))
        for n in cfg["Ns"]:
            inp = W.local_inputs(n, rank, size)
            samples: dict = {name: [] for name in mods}
            loads, kept, redone = [], 0, 0
            while kept < cfg["iters"] + 1:
                dist.barrier()
                meter.start()
                rec = {}
                for name, m in mods.items():
                    dist.barrier()
                    rec[name] = _fwd_bwd(m, *inp)
                dist.barrier()
                load = meter.stop()
                if kept > 0 and load > cfg["max_foreign"] and redone < cfg["iters"]:
                    redone += 1
                    continue
                if kept > 0:
                    for name, r in rec.items():
                        samples[name].append(r)
                    loads.append(load)
                kept += 1
            res["timing"][str(n)] = {"samples": samples, "foreign": loads, "redone": redone}
        parts = [None] * size
        dist.all_gather_object(parts, res)
        if rank == 0:
            with open(out_path, "w") as f:
                json.dump(parts, f)
    finally:
        dist.destroy_process_group()


def _summarise(parts: list, P: int, names: list[str]) -> dict:
    out: dict = {}
    for n in parts[0]["timing"]:
        t = [p["timing"][n]["samples"] for p in parts]
        row: dict = {"foreign_load_median": float(np.median(parts[0]["timing"][n]["foreign"])),
                     "redone": parts[0]["timing"][n]["redone"]}  # fmt: skip
        wall = {m: [max(r[m][i]["total"] for r in t) for i in range(len(t[0][m]))] for m in names}
        cpu = {m: [max(r[m][i]["cpu"] for r in t) for i in range(len(t[0][m]))] for m in names}
        for m in names:
            row[m] = {
                "wall_median_s": float(np.median(wall[m])),
                "cpu_median_s": float(np.median(cpu[m])),
                "peak_rss_growth_MiB": max(p["memory"][n][m] for p in parts),
            }
            if m != "main":
                row[m]["wall_ratio_vs_main"] = [float(x) for x in np.percentile(
                    [a / b for a, b in zip(wall[m], wall["main"])], [20, 50, 80])]  # fmt: skip
                row[m]["cpu_ratio_vs_main"] = [float(x) for x in np.percentile(
                    [a / b for a, b in zip(cpu[m], cpu["main"])], [20, 50, 80])]  # fmt: skip
        out[f"P={P} N={n}"] = row
    return out


def main(argv: list[str] | None = None) -> int:
    import torch.multiprocessing as mp

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=DIR")
    ap.add_argument("--P", type=int, nargs="+", default=[2])
    ap.add_argument("--N", type=int, nargs="+", default=[8192])
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None, help="total threads (default: all cores)")
    ap.add_argument("--max-foreign", type=float, default=0.10)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    variants = dict(v.split("=", 1) for v in args.variant)
    total = args.threads or len(os.sched_getaffinity(0))
    summary: dict = {}
    for P in args.P:
        cfg = {"Ns": args.N, "threads": total if P == 1 else max(1, total // P), "iters": args.iters,
               "variants": variants, "max_foreign": args.max_foreign}  # fmt: skip
        tmp = tempfile.mkdtemp(prefix="hf_ring_ab_")
        try:
            path = os.path.join(tmp, "res.json")
            mp.start_processes(_worker, args=(P, os.path.join(tmp, "rdzv"), cfg, path), nprocs=P, start_method="spawn")
            with open(path) as f:
                parts = json.load(f)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        summary.update(_summarise(parts, P, ["main", *variants]))
    text = json.dumps(summary, indent=1)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
