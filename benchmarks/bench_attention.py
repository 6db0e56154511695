"""Attention-level benchmark of hf_ring on CPU/gloo (issue 6).

    python -m benchmarks.bench_attention --out benchmarks/results/attention.jsonl          # ~10 min idle
    python -m benchmarks.bench_attention --out /tmp/attention.jsonl --quick                # < 30 s

Causal attention, B=1, Hq=8, Hkv=2, D=64, float32, total sequence N in {4096, 8192, 16384}, P in
{1, 2, 4} gloo ranks (fresh spawned processes, ``benchmarks.harness.launch``). The machine's
cores are shared out: every configuration uses the same total number of threads (``--threads``,
default: all cores). P ranks get ``max(1, threads // P)`` threads each; when P exceeds the cores the
ranks are oversubscribed, and the rows say so in ``note``.

Measured (see NOTES.md for definitions):
  * fwd+bwd wall time of hf_ring (zigzag), torch's ring on the same shards, hf_ring with the
    contiguous layout, and single-process SDPA over the whole sequence with all the threads;
    per iteration each rank times itself and the row keeps the max over ranks; median/p20/p80 over
    iterations. efficiency = t_sdpa / t_ring.
  * per-rank compute time (main-thread CPU seconds of the fwd+bwd: sleeping in a wait costs none)
    and its max/mean over ranks, zigzag vs contiguous.
  * communication hiding: the same schedule's compute without send/recv (t_nocomm), the same hops
    without compute (t_comm_alone); hidden = 1 - (t_ring - t_nocomm) / t_comm_alone.
  * peak memory per rank: growth of the resident set (VmHWM after resetting it through
    /proc/self/clear_refs, minus VmRSS before) across one fwd+bwd, measured first in each fresh
    worker while glibc returns every allocation >= 64 KiB to the OS on free (mallopt
    M_MMAP_THRESHOLD), so that the resident set follows the live tensors.
  * on a shared machine, an iteration during which other processes used > 10% of the CPUs is run
    again (at most ``iters`` times per N); ``machine_load`` rows record the load of the kept ones.
    ``--wait-idle S`` waits up to S s for a quiet machine before each P. Every finished P is saved
    in the raw file; ``--resume [--redo P ...]`` continues an interrupted run.

Output: one JSON object per line with fields name, provider, metric, x, P, N, median, p20, p80,
unit, machine, versions, threads, note (``benchmarks.attention_table.build_rows``); and
``<out stem>_raw.json`` with every per-rank sample. Providers: ``benchmarks.workloads``.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import sys
import time
from pathlib import Path

from benchmarks import harness as H
from benchmarks.attention_table import build_rows

FULL = {
    "Ns": [4096, 8192, 16384],
    "Ps": [1, 2, 4],
    "iters": {4096: 7, 8192: 5, 16384: 3},
    "warmup": 1,
    "comm_repeats": 3,
    "mem_repeats": 2,
    "sdpa_1thread": True,
    "max_foreign": 0.10,  # redo an iteration when other processes used > 10% of the machine during it
    "max_redo": 1,  # ... at most iters times per N (the run takes at most twice as long)
}
QUICK = {
    "Ns": [512],
    "Ps": [1, 2],
    "iters": {512: 1},
    "warmup": 1,
    "comm_repeats": 1,
    "mem_repeats": 1,
    "sdpa_1thread": True,
    "max_foreign": 1.0,  # never redo
    "max_redo": 0,
}


# ============================================================================ worker side
def _worker(rank: int, size: int, cfg: dict) -> dict:
    """One rank of a P-rank group: the memory probes first (fresh process), then the timings."""
    import torch.distributed as dist

    from benchmarks import workloads as W

    group = dist.group.WORLD
    if size > 1:
        W.configure_torch_ring()
    mem = _memory(rank, size, group, cfg) if cfg["memory"] else {}
    return {"memory": mem, "timing": _timing(rank, size, group, cfg)}


def _one_iteration(work: dict, group, comm_repeats: int) -> dict:
    """Every provider once (comm_alone ``comm_repeats`` times), in a fixed order, each from a barrier."""
    import torch.distributed as dist

    rec: dict = {k: [] for k in work}
    for name, fn in work.items():
        for _ in range(comm_repeats if name == "comm_alone" else 1):
            dist.barrier(group=group)
            rec[name].append(fn())
    return rec


def _timing(rank: int, size: int, group, cfg: dict) -> dict:
    """Per N, the samples of every provider over the kept iterations of ``harness.measure`` (an
    iteration during which other processes used more than ``cfg["max_foreign"]`` of the machine is
    run again), with the kept iterations' foreign load (``_foreign``) and the number redone."""
    meter = H.GroupLoad(group, rank, len(os.sched_getaffinity(0)))
    res: dict = {}
    for n in cfg["Ns"]:
        work = _make_work(n, rank, size, group, cfg)
        kept, loads, redone = H.measure(functools.partial(_one_iteration, work, group, cfg["comm_repeats"]), meter,
                                        warmup=cfg["warmup"], iters=cfg["iters"][str(n)],
                                        max_foreign=cfg["max_foreign"], max_redo=cfg["max_redo"])  # fmt: skip
        samples: dict = {k: [s for rec in kept for s in rec[k]] for k in work}
        samples["_foreign"], samples["_redone"] = loads, redone
        res[str(n)] = samples
        del work
        gc.collect()
    return res


def _make_work(n: int, rank: int, size: int, group, cfg: dict) -> dict:
    """The fwd+bwd callables of every provider for total length ``n`` on this rank, in run order."""
    import torch

    from benchmarks import workloads as W

    zz = W.local_inputs(n, rank, size, "zigzag")
    hf = W.HfRing.on(group)
    # the baseline runs on rank 0 with all the threads while the other ranks sleep in the next
    # barrier, interleaved with the ring runs so that both see the same machine
    full_t = W.to_bhsd(*W.full_inputs(n)) if rank == 0 else None

    def sdpa(threads=cfg["total_threads"]):
        if rank != 0:
            return {}
        torch.set_num_threads(threads)
        try:
            return W.sdpa_fwd_bwd(*full_t)
        finally:
            torch.set_num_threads(cfg["threads"])

    work = {"sdpa": sdpa}
    if size == 1 and cfg["sdpa_1thread"]:
        work["sdpa_1thread"] = lambda: sdpa(1)
    work["hf_ring"] = lambda: hf.fwd_bwd(*zz, order="zigzag")
    if size > 1:
        cont = W.local_inputs(n, rank, size, "contiguous")
        zz_t = W.to_bhsd(*zz)
        nocomm = W.HfRing.nocomm(size, rank)
        work["hf_ring_nocomm"] = lambda: nocomm.fwd_bwd(*zz)
        work["torch_ring"] = lambda: W.torch_ring_fwd_bwd(*zz_t, group=group)
        work["hf_ring_contiguous"] = lambda: hf.fwd_bwd(*cont, order="contiguous")
        work["comm_alone"] = lambda: W.comm_alone(zz[1], zz[2], ring=hf.ring)  # its waits timed, as hf_ring's
    return work


def _mem_case(prov: str, n: int, rank: int, size: int, group):
    from benchmarks import workloads as W

    if prov == "sdpa":
        inp = W.to_bhsd(*W.full_inputs(n))
        return inp, lambda: W.sdpa_fwd_bwd(*inp)
    if prov == "torch_ring":
        inp = W.to_bhsd(*W.local_inputs(n, rank, size))
        return inp, lambda: W.torch_ring_fwd_bwd(*inp, group=group)
    inp = W.local_inputs(n, rank, size)
    hf = W.HfRing.on(group)
    return inp, lambda: hf.fwd_bwd(*inp)


def _memory(rank: int, size: int, group, cfg: dict) -> dict:
    """Peak resident-set growth across one fwd+bwd per (N, provider), while glibc returns every
    allocation >= 64 KiB to the OS on free (``harness.allocations_to_os``)."""
    import torch.distributed as dist

    from benchmarks import workloads as W

    res: dict = {}
    with H.allocations_to_os():
        # initialise thread pools, kernels and gloo pairs outside the measurement
        W.HfRing.on(group).fwd_bwd(*W.local_inputs(64 * size, rank, size))
        for n in cfg["Ns"]:
            res[str(n)] = {}
            for prov in ["hf_ring", "sdpa"] if size == 1 else ["hf_ring", "torch_ring"]:
                samples = []
                for _ in range(cfg["mem_repeats"]):
                    inp, fn = _mem_case(prov, n, rank, size, group)
                    input_bytes = sum(t.numel() * t.element_size() for t in inp)
                    gc.collect()
                    dist.barrier(group=group)
                    rss0 = H.status_kib("VmRSS")
                    ok = H.reset_hwm()
                    fn()
                    hwm = H.status_kib("VmHWM")
                    samples.append({"growth_kib": hwm - rss0, "rss0_kib": rss0, "hwm_kib": hwm,
                                    "input_bytes": input_bytes, "hwm_reset": ok})  # fmt: skip
                    del inp, fn
                    gc.collect()
                res[str(n)][prov] = samples
    return res


# ============================================================================ driver side
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    H.add_grid_args(ap, "benchmarks/results/attention.jsonl")
    ap.add_argument("--no-memory", action="store_true")
    ap.add_argument("--resume", action="store_true", help="reuse the P already in <out>_raw.json (same config)")
    ap.add_argument("--redo", type=int, nargs="*", default=None, metavar="P", help="with --resume: run these P again")
    args = ap.parse_args(argv)

    meta = {"machine": H.machine_info(), "versions": H.versions(), "load": {}}
    cfg = H.grid_config(args, FULL, QUICK, meta["machine"]["cores"])
    cfg["memory"] = not args.no_memory
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    t_start = time.monotonic()
    raw = out.with_name(out.stem + "_raw.json")
    timing, memory, walls = {}, {}, {}
    if args.resume and raw.exists():
        old = json.loads(raw.read_text())
        keys = ("Ns", "iters", "threads", "memory")
        if {k: old["config"].get(k) for k in keys} != {k: cfg[k] for k in keys}:
            raise SystemExit(f"--resume: {raw} was made with another configuration ({old['config']})")
        for ps, v in old["timing"].items():
            if int(ps) in cfg["Ps"] and int(ps) not in (args.redo or []):
                timing[int(ps)], memory[int(ps)] = v, old["memory"][ps]
                meta["load"][int(ps)] = old["meta"]["load"][ps]
                walls[int(ps)] = old.get("walls", {}).get(ps)
        print(f"[bench] resuming: P={sorted(timing)} taken from {raw}", flush=True)

    def save_raw() -> None:
        with open(raw, "w") as f:
            json.dump({"config": cfg, "meta": meta, "timing": {str(p): v for p, v in timing.items()},
                       "memory": {str(p): v for p, v in memory.items()},
                       "walls": {str(p): v for p, v in walls.items()}}, f)  # fmt: skip

    for p, per_rank, wall in H.each_p(_worker, cfg, meta, timeout=args.timeout, wait_idle_s=args.wait_idle,
                                      skip=set(timing)):  # fmt: skip
        walls[p] = wall
        timing[p] = [r["timing"] for r in per_rank]
        memory[p] = [r["memory"] for r in per_rank]
        save_raw()  # after every P, so that an interrupted run can --resume

    # reshape: [p][rank][n][provider][iter] -> [p][n][rank][provider][iter]
    tim = {p: {n: [timing[p][r][n] for r in range(p)] for n in timing[p][0]} for p in timing}
    mem = {p: {n: [memory[p][r][n] for r in range(p)] for n in memory[p][0]} for p in memory}
    meta["load"] = {int(k): v for k, v in meta["load"].items()}
    rows = build_rows(tim, mem, cfg, meta)
    H.write_rows(out, rows)
    save_raw()
    print(f"[bench] {len(rows)} rows -> {out} (raw samples: {raw}); total {time.monotonic() - t_start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
