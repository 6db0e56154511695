"""Attention-level benchmark of hf_ring on CPU/gloo (issue 6).

    python -m benchmarks.bench_attention --out benchmarks/results/attention.jsonl          # ~10 min idle
    python -m benchmarks.bench_attention --out /tmp/attention.jsonl --quick                # < 30 s

Causal attention, B=1, Hq=8, Hkv=2, D=64, float32, total sequence N in {4096, 8192, 16384}, P in
{1, 2, 4} gloo ranks (spawned processes, file:// rendezvous in a temporary directory). The machine's
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
unit, machine, versions, threads, note; and ``<out stem>_raw.json`` with every per-rank sample.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

FIELDS = ("name", "provider", "metric", "x", "P", "N", "median", "p20", "p80", "unit",
          "machine", "versions", "threads", "note")  # fmt: skip

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
def _init(rank: int, size: int, init_file: str, threads: int):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=size)
    from torch.distributed.distributed_c10d import _get_default_group

    return _get_default_group()


def _gather_to_file(obj, rank: int, size: int, path: str) -> None:
    import torch.distributed as dist

    parts = [None] * size
    dist.all_gather_object(parts, obj)
    if rank == 0:
        with open(path, "w") as f:
            json.dump(parts, f)


def _worker(rank: int, size: int, init_file: str, cfg: dict, out_path: str) -> None:
    """One rank of a P-rank group: the memory probes first (fresh process), then the timings."""
    import torch.distributed as dist

    from benchmarks import workloads as W

    group = _init(rank, size, init_file, cfg["threads"])
    if size > 1:
        W.configure_torch_ring()
    try:
        mem = _memory(rank, size, group, cfg) if cfg["memory"] else {}
        tim = _timing(rank, size, group, cfg)
        _gather_to_file({"memory": mem, "timing": tim}, rank, size, out_path)
    finally:
        dist.destroy_process_group()


def _timing(rank: int, size: int, group, cfg: dict) -> dict:
    """Every provider once per iteration, in a fixed order, each started from a barrier.

    The machine may be shared: rank 0 measures the CPU time that processes outside this group used
    during each iteration (/proc/stat busy time minus the group's own process CPU time). An
    iteration during which they used more than ``cfg["max_foreign"]`` of the machine is run again,
    at most ``cfg["max_redo"]`` times per iteration count; the kept iterations' foreign load is
    recorded with the samples.
    """
    import torch.distributed as dist

    from benchmarks import workloads as W

    W.install_probes()
    meter = GroupLoad(group, rank, len(os.sched_getaffinity(0)))
    res: dict = {}
    for n in cfg["Ns"]:
        iters = cfg["iters"][str(n)]
        work = _make_work(n, rank, size, group, cfg)
        samples: dict = {k: [] for k in work}
        foreign_kept: list[float] = []
        kept = redone = 0
        while kept < cfg["warmup"] + iters:
            dist.barrier(group=group)
            meter.start()
            rec: dict = {k: [] for k in work}
            for name, fn in work.items():
                reps = cfg["comm_repeats"] if name == "comm_alone" else 1
                for _ in range(reps):
                    dist.barrier(group=group)
                    rec[name].append(fn())
            dist.barrier(group=group)
            load = meter.stop()
            warm = kept < cfg["warmup"]
            if not warm and load > cfg["max_foreign"] and redone < cfg["max_redo"] * iters:
                redone += 1
                continue
            kept += 1
            if not warm:
                for k, v in rec.items():
                    samples[k].extend(v)
                foreign_kept.append(load)
            gc.collect()
        samples["_foreign"] = foreign_kept
        samples["_redone"] = redone
        res[str(n)] = samples
        del work
        gc.collect()
    return res


def _make_work(n: int, rank: int, size: int, group, cfg: dict) -> dict:
    """The fwd+bwd callables of every provider for total length ``n`` on this rank, in run order."""
    import torch

    from benchmarks import workloads as W

    zz = W.local_inputs(n, rank, size, "zigzag")
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
    work["hf_ring"] = lambda: W.hf_ring_fwd_bwd(*zz, group=group, layout="zigzag")
    if size > 1:
        cont = W.local_inputs(n, rank, size, "contiguous")
        zz_t = W.to_bhsd(*zz)
        work["hf_ring_nocomm"] = lambda: W.nocomm_fwd_bwd(*zz, group=group)
        work["torch_ring"] = lambda: W.torch_ring_fwd_bwd(*zz_t, group=group)
        work["hf_ring_contiguous"] = lambda: W.hf_ring_fwd_bwd(*cont, group=group, layout="contiguous")
        work["comm_alone"] = lambda: W.comm_alone(zz[1], zz[2], group=group)
    return work


def _status_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise KeyError(key)


def _reset_hwm() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _mem_case(prov: str, n: int, rank: int, size: int, group):
    from benchmarks import workloads as W

    if prov == "sdpa":
        inp = W.to_bhsd(*W.full_inputs(n))
        return inp, lambda: W.sdpa_fwd_bwd(*inp)
    if prov == "torch_ring":
        inp = W.to_bhsd(*W.local_inputs(n, rank, size))
        return inp, lambda: W.torch_ring_fwd_bwd(*inp, group=group)
    inp = W.local_inputs(n, rank, size)
    return inp, lambda: W.hf_ring_fwd_bwd(*inp, group=group)


# glibc mallopt parameters
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3


def _memory(rank: int, size: int, group, cfg: dict) -> dict:
    """Peak resident-set growth across one fwd+bwd per (N, provider).

    While measuring, glibc serves every allocation >= 64 KiB with its own mmap and unmaps it on free
    (mallopt M_MMAP_THRESHOLD=64 KiB, M_TRIM_THRESHOLD=0), so the resident set follows the live
    tensors; afterwards the thresholds go to glibc's dynamic maxima (32 MiB / 64 MiB, what the
    default settles at once large blocks have been freed) for the timings.
    """
    import ctypes

    import torch.distributed as dist

    from benchmarks import workloads as W

    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(_M_MMAP_THRESHOLD, 64 * 1024)
    libc.mallopt(_M_TRIM_THRESHOLD, 0)
    libc.malloc_trim(0)
    res: dict = {}
    try:
        # initialise thread pools, kernels and gloo pairs outside the measurement
        small = W.local_inputs(64 * size, rank, size)
        W.hf_ring_fwd_bwd(*small, group=group)
        for n in cfg["Ns"]:
            res[str(n)] = {}
            provs = ["hf_ring", "sdpa"] if size == 1 else ["hf_ring", "torch_ring"]
            for prov in provs:
                samples = []
                for _ in range(cfg["mem_repeats"]):
                    inp, fn = _mem_case(prov, n, rank, size, group)
                    input_bytes = sum(t.numel() * t.element_size() for t in inp)
                    gc.collect()
                    dist.barrier(group=group)
                    rss0 = _status_kib("VmRSS")
                    ok = _reset_hwm()
                    fn()
                    hwm = _status_kib("VmHWM")
                    samples.append({"growth_kib": hwm - rss0, "rss0_kib": rss0, "hwm_kib": hwm,
                                    "input_bytes": input_bytes, "hwm_reset": ok})  # fmt: skip
                    del inp, fn
                    gc.collect()
                res[str(n)][prov] = samples
    finally:
        libc.mallopt(_M_MMAP_THRESHOLD, 32 * 1024 * 1024)
        libc.mallopt(_M_TRIM_THRESHOLD, 64 * 1024 * 1024)
        libc.malloc_trim(0)
    return res


# ============================================================================ driver side
@contextlib.contextmanager
def _env(**kv):
    old = {k: os.environ.get(k) for k in kv}
    os.environ.update({k: str(v) for k, v in kv.items()})
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _cpu_busy_s() -> float:
    """Busy CPU seconds of the whole machine since boot (all cores), from /proc/stat."""
    with open("/proc/stat") as f:
        vals = [int(x) for x in f.readline().split()[1:]]
    idle = vals[3] + vals[4]  # idle + iowait
    return (sum(vals[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def _own_cpu_s() -> float:
    import resource

    a, b = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return a.ru_utime + a.ru_stime + b.ru_utime + b.ru_stime


class GroupLoad:
    """The share of the machine that processes outside a group of gloo ranks used during an iteration:
    ``start()`` on every rank, then ``stop()`` on every rank (two all-reduces over ``group``) gives
    rank 0's measurement (/proc/stat busy time minus the group's own CPU time) on every rank."""

    def __init__(self, group, rank: int, cores: int) -> None:
        self.group, self.rank, self.cores = group, rank, cores

    def start(self) -> None:
        self.b0, self.c0, self.t0 = _cpu_busy_s(), time.process_time(), time.monotonic()

    def stop(self) -> float:
        import torch
        import torch.distributed as dist

        own = torch.tensor([time.process_time() - self.c0], dtype=torch.float64)
        dist.all_reduce(own, group=self.group)
        load = torch.tensor([0.0], dtype=torch.float64)
        if self.rank == 0:
            busy = _cpu_busy_s() - self.b0
            load[0] = max(0.0, busy - own.item()) / ((time.monotonic() - self.t0) * self.cores)
        dist.all_reduce(load, group=self.group)  # rank 0's value on every rank
        return load.item()


def wait_idle(max_wait: float, threshold: float = 0.15, cores: int = 1) -> float:
    """Wait (up to ``max_wait`` s) until other processes use < ``threshold`` of the machine over
    2 s; returns the last measured foreign load fraction."""
    deadline = time.monotonic() + max_wait
    while True:
        b0, o0, t0 = _cpu_busy_s(), _own_cpu_s(), time.monotonic()
        time.sleep(2.0)
        load = ((_cpu_busy_s() - b0) - (_own_cpu_s() - o0)) / ((time.monotonic() - t0) * cores)
        if load < threshold or time.monotonic() > deadline:
            return load
        print(f"[bench] machine busy ({100 * load:.0f}% foreign load); waiting", flush=True)
        time.sleep(10.0)


def _launch(fn, size: int, cfg: dict, timeout: float, env: dict | None = None):
    """Spawn ``size`` gloo ranks running ``fn``; return (rank 0's gathered per-rank results,
    fraction of the machine's CPU used by other processes meanwhile)."""
    import torch.multiprocessing as mp

    tmp = tempfile.mkdtemp(prefix="hf_ring_bench_")
    b0, o0, t0 = _cpu_busy_s(), _own_cpu_s(), time.monotonic()
    try:
        init_file, out_path = os.path.join(tmp, "rdzv"), os.path.join(tmp, "result.json")
        with _env(**(env or {})):
            ctx = mp.start_processes(fn, args=(size, init_file, cfg, out_path), nprocs=size,
                                     join=False, start_method="spawn")  # fmt: skip
        deadline = time.monotonic() + timeout
        while not ctx.join(timeout=1.0):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    if p.is_alive():
                        p.kill()
                raise TimeoutError(f"{fn.__name__} with P={size} did not finish in {timeout:.0f} s")
        with open(out_path) as f:
            res = json.load(f)
        wall = time.monotonic() - t0
        foreign = (_cpu_busy_s() - b0) - (_own_cpu_s() - o0)
        return res, max(0.0, foreign) / (wall * (os.cpu_count() or 1))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def machine_info() -> dict:
    model = platform.processor() or "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"cpu": model, "cores": cores, "platform": platform.platform()}


def versions() -> dict:
    import re

    import torch

    init = Path(__file__).resolve().parent.parent / "hf_ring" / "__init__.py"
    m = re.search(r'__version__ = "([^"]+)"', init.read_text()) if init.exists() else None
    hf_version = m.group(1) if m else "unknown"  # without importing hf_ring (it imports transformers)
    commit = "unknown"
    with contextlib.suppress(Exception):
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=Path(__file__).resolve().parent, timeout=10).stdout.strip() or commit  # fmt: skip
    with contextlib.suppress(Exception):
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "hf_ring"], capture_output=True, text=True,
                               cwd=Path(__file__).resolve().parent, timeout=10).stdout.strip()  # fmt: skip
        commit += "+dirty" if dirty else ""
    return {"torch": torch.__version__, "hf_ring": hf_version, "hf_ring_commit": commit,
            "python": platform.python_version()}  # fmt: skip


def _stats(xs) -> tuple[float, float, float]:
    a = np.asarray(xs, dtype=float)
    return float(np.median(a)), float(np.percentile(a, 20)), float(np.percentile(a, 80))


def _per_iter_max(per_rank: list[list[dict]], key: str) -> list[float]:
    """[rank][iter] samples -> per-iteration max over ranks of ``key``."""
    return [max(r[i][key] for r in per_rank) for i in range(len(per_rank[0]))]


def build_rows(timing: dict, memory: dict, cfg: dict, meta: dict) -> list[dict]:
    """Turn per-rank samples into the long table."""
    rows: list[dict] = []
    cores = meta["machine"]["cores"]
    total_threads = cfg["threads"]

    def threads_of(p):
        return max(1, total_threads // p)

    def note_of(p, extra=""):
        t = threads_of(p)
        parts = []
        if p * t > cores:
            parts.append(f"oversubscribed: {p} ranks x {t} thread(s) on {cores} cores")
        if extra:
            parts.append(extra)
        return "; ".join(parts)

    def add(name, provider, metric, p, n, vals, unit, x=None, threads=None, note=""):
        med, p20, p80 = vals
        rows.append({"name": name, "provider": provider, "metric": metric, "x": n if x is None else x,
                     "P": p, "N": n, "median": med, "p20": p20, "p80": p80, "unit": unit,
                     "machine": meta["machine"], "versions": meta["versions"],
                     "threads": threads_of(p) if threads is None else threads, "note": note})  # fmt: skip

    for p in cfg["Ps"]:
        load = meta["load"].get(p)
        lnote = f"foreign CPU load during this P's run {100 * load:.0f}% of the machine" if load is not None else ""
        for n in cfg["Ns"]:
            ranks = timing[p][str(n)]  # [rank][provider][iter]
            iters = len(ranks[0]["hf_ring"])
            nt = f"iters={iters}"
            if "_foreign" in ranks[0]:
                fk = ranks[0]["_foreign"]
                nt += (f"; foreign CPU load in kept iterations median {100 * float(np.median(fk)):.0f}% "
                       f"max {100 * max(fk):.0f}%, {ranks[0]['_redone']} iteration(s) redone")  # fmt: skip
            elif lnote:
                nt += f"; {lnote}"
            if "_foreign" in ranks[0]:
                add("machine_load", "other_processes", "foreign_cpu_fraction_kept_iters", p, n,
                    _stats(ranks[0]["_foreign"]), "fraction",
                    note=f"CPU used by other processes / (wall x cores), per kept iteration; "
                         f"{ranks[0]['_redone']} iteration(s) redone")  # fmt: skip
            # single-process SDPA baseline, measured on rank 0 between the ring runs of this P
            sdpa = {}
            for prov, thr in (("sdpa", total_threads), ("sdpa_1thread", 1)):
                if prov not in ranks[0]:
                    continue
                samp = ranks[0][prov]
                for phase in ("total", "fwd", "bwd"):
                    name = "fwd_bwd" if phase == "total" else phase
                    add(name, prov, "time", p, n, _stats([s[phase] for s in samp]), "s", threads=thr,
                        note=f"one process, whole sequence, {thr} thread(s); run on rank 0 between the P={p} "
                             f"ring runs while the other ranks sleep; {nt}")  # fmt: skip
                sdpa[prov] = [s["total"] for s in samp]
            t_ring = {}
            for prov in ("hf_ring", "hf_ring_contiguous", "torch_ring", "hf_ring_nocomm"):
                if prov not in ranks[0]:
                    continue
                per_rank = [r[prov] for r in ranks]
                for phase in ("total", "fwd", "bwd"):
                    name = "fwd_bwd" if phase == "total" else phase
                    add(name, prov, "time", p, n, _stats(_per_iter_max(per_rank, phase)), "s", note=note_of(p, nt))
                t_ring[prov] = _per_iter_max(per_rank, "total")
            # efficiency vs single-process SDPA with all threads, paired per iteration
            for prov in ("hf_ring", "torch_ring", "hf_ring_contiguous"):
                if prov in t_ring:
                    eff = [a / b for a, b in zip(sdpa["sdpa"], t_ring[prov])]
                    add("efficiency", prov, "t_sdpa/t_ring", p, n, _stats(eff), "ratio",
                        note=note_of(p, f"t_sdpa: one process, whole sequence, {total_threads} threads; "
                                        "ratio paired per iteration; " + nt))  # fmt: skip
            if "sdpa_1thread" in sdpa:
                sc = [a / b for a, b in zip(sdpa["sdpa_1thread"], sdpa["sdpa"])]
                add(
                    "sdpa_thread_scaling",
                    "sdpa",
                    f"t_1thread/t_{total_threads}threads",
                    p,
                    n,
                    _stats(sc),
                    "ratio",
                    threads=total_threads,
                    note="paired per iteration; " + nt,
                )
            if "torch_ring" in t_ring:
                ratio = [a / b for a, b in zip(t_ring["torch_ring"], t_ring["hf_ring"])]  # same iteration
                add(
                    "vs_torch_ring",
                    "hf_ring",
                    "t_torch_ring/t_hf_ring",
                    p,
                    n,
                    _stats(ratio),
                    "ratio",
                    note=note_of(p, "paired per iteration; " + nt),
                )
            # CPU-time companions (robust to other processes sharing the cores): main-thread CPU
            # seconds, max over ranks, per iteration
            cpu = {}
            for prov in ("hf_ring", "torch_ring"):
                if prov in ranks[0] and "cpu" in ranks[0][prov][0]:
                    cpu[prov] = _per_iter_max([r[prov] for r in ranks], "cpu")
            if len(cpu) == 2:
                ratio = [a / b for a, b in zip(cpu["torch_ring"], cpu["hf_ring"])]
                add("vs_torch_ring_cpu", "hf_ring", "cpu_torch_ring/cpu_hf_ring", p, n, _stats(ratio), "ratio",
                    note=note_of(p, "main-thread CPU s, max over ranks, paired per iteration; " + nt))  # fmt: skip
            one = timing.get(1, {}).get(str(n))
            if p > 1 and one and "sdpa_1thread" in one[0] and "cpu" in one[0]["sdpa_1thread"][0]:
                ref = float(np.median([s["cpu"] for s in one[0]["sdpa_1thread"]]))
                for prov, c in cpu.items():
                    add("efficiency_cpu", prov, "cpu_sdpa_1thread/(P*max_rank_cpu)", p, n,
                        _stats([ref / (p * x) for x in c]), "ratio",
                        note=note_of(p, "work efficiency: CPU s of 1-thread SDPA over the whole sequence (P=1 "
                                        "run, median) / (P x max-rank main-thread CPU s of the ring); "
                                        "independent of thread scaling and of other processes; " + nt))  # fmt: skip
            # load balance: per-rank compute = main-thread CPU seconds of fwd+bwd
            if p > 1:
                for prov in ("hf_ring", "hf_ring_contiguous", "hf_ring_nocomm"):
                    per_rank = [r[prov] for r in ranks]
                    for rk, samp in enumerate(per_rank):
                        add(
                            "rank_compute",
                            prov,
                            f"cpu_s.rank{rk}",
                            p,
                            n,
                            _stats([s["cpu"] for s in samp]),
                            "s",
                            note=note_of(p, f"rank {rk}; main-thread CPU time of fwd+bwd; " + nt),
                        )
                    ratios = []
                    for i in range(iters):
                        c = [r[i]["cpu"] for r in per_rank]
                        ratios.append(max(c) / (sum(c) / len(c)))
                    add(
                        "load_balance",
                        prov,
                        "max/mean rank compute",
                        p,
                        n,
                        _stats(ratios),
                        "ratio",
                        note=note_of(p, f"ideal contiguous 2P/(P+1) = {2 * p / (p + 1):.3f}; " + nt),
                    )
                # communication hiding
                t_nc = t_ring["hf_ring_nocomm"]
                t_cm = _per_iter_max([r["comm_alone"] for r in ranks], "total")
                exposed = [a - b for a, b in zip(t_ring["hf_ring"], t_nc)]
                waits = [sum(r["hf_ring"][i]["wait"] for r in ranks) / p for i in range(iters)]
                e_med, e20, e80 = _stats(exposed)
                c_med, c20, c80 = _stats(t_cm)
                w_med, w20, w80 = _stats(waits)
                add("comm", "hf_ring", "t_ring", p, n, _stats(t_ring["hf_ring"]), "s", note=note_of(p, nt))
                add("comm", "hf_ring", "t_nocomm", p, n, _stats(t_nc), "s", note=note_of(p, nt))
                add("comm", "hf_ring", "t_comm_alone", p, n, (c_med, c20, c80), "s",
                    note=note_of(p, f"{p - 1} K/V hops fwd + the bwd hops, no compute; "
                                    f"{len(t_cm)} samples"))  # fmt: skip
                add(
                    "comm",
                    "hf_ring",
                    "exposed",
                    p,
                    n,
                    (e_med, e20, e80),
                    "s",
                    note=note_of(p, "t_ring - t_nocomm, paired per iteration; " + nt),
                )
                add(
                    "comm",
                    "hf_ring",
                    "wait",
                    p,
                    n,
                    (w_med, w20, w80),
                    "s",
                    note=note_of(p, "wall time inside RingComm.wait, mean over ranks; " + nt),
                )
                add(
                    "comm",
                    "hf_ring",
                    "hidden_fraction",
                    p,
                    n,
                    (1 - e_med / c_med, 1 - e80 / c_med, 1 - e20 / c_med),
                    "fraction",
                    note=note_of(p, "1 - (t_ring - t_nocomm)/t_comm_alone; p20/p80 from exposed p80/p20"),
                )
                add(
                    "comm",
                    "hf_ring",
                    "hidden_fraction_wait",
                    p,
                    n,
                    (1 - w_med / c_med, 1 - w80 / c_med, 1 - w20 / c_med),
                    "fraction",
                    note=note_of(p, "1 - (mean wait in RingComm.wait)/t_comm_alone"),
                )
                frac = [e / t for e, t in zip(exposed, t_ring["hf_ring"])]
                add("comm", "hf_ring", "exposed_fraction_of_t_ring", p, n, _stats(frac), "fraction",
                    note=note_of(p, "(t_ring - t_nocomm)/t_ring, paired per iteration: the ring's whole cost "
                                    "beyond its compute; " + nt))  # fmt: skip
                reps = max(1, len(t_cm) // max(1, iters))
                t_cm_it = [float(np.median(t_cm[i * reps : (i + 1) * reps])) for i in range(iters)]
                frac = [c / t for c, t in zip(t_cm_it, t_ring["hf_ring"])]
                add("comm", "hf_ring", "comm_alone_fraction_of_t_ring", p, n, _stats(frac), "fraction",
                    note=note_of(p, "t_comm_alone/t_ring: what there is to hide; " + nt))  # fmt: skip

    for p in cfg["Ps"]:
        if p in meta["load"]:
            v = meta["load"][p]
            add(
                "machine_load",
                "other_processes",
                "foreign_cpu_fraction",
                p,
                0,
                (v, v, v),
                "fraction",
                x=p,
                note="CPU used by processes outside this benchmark during the P run / (wall x cores)",
            )

    # memory, x = P
    base: dict = {}
    for p in cfg["Ps"]:
        for n in cfg["Ns"]:
            if str(n) not in memory.get(p, {}):
                continue
            ranks = memory[p][str(n)]
            for prov in ranks[0]:
                per = [r[prov] for r in ranks]
                growth = [max(s[i]["growth_kib"] for s in per) / 1024 for i in range(len(per[0]))]
                incl = [max(s[i]["growth_kib"] / 1024 + s[i]["input_bytes"] / 2**20 for s in per)
                        for i in range(len(per[0]))]  # fmt: skip
                ok = all(s[i]["hwm_reset"] for s in per for i in range(len(per[0])))
                mnote = "peak RSS growth across one fwd+bwd, max over ranks; MALLOC_MMAP_THRESHOLD_=65536" + (
                    "" if ok else "; WARNING: VmHWM reset failed, growth is since process start"
                )
                thr = total_threads if prov == "sdpa" else None
                add(
                    "peak_memory",
                    prov,
                    "rss_growth",
                    p,
                    n,
                    _stats(growth),
                    "MiB",
                    x=p,
                    threads=thr,
                    note=note_of(p, mnote) if prov != "sdpa" else mnote + "; whole sequence, one process",
                )
                add(
                    "peak_memory",
                    prov,
                    "rss_growth_incl_inputs",
                    p,
                    n,
                    _stats(incl),
                    "MiB",
                    x=p,
                    threads=thr,
                    note=note_of(p, mnote + " + local q,k,v,dout") if prov != "sdpa" else mnote,
                )
                if p == 1 and prov == "hf_ring":
                    base[n] = (float(np.median(growth)), float(np.median(incl)))
            for prov in ranks[0]:
                if prov == "sdpa" or n not in base:
                    continue
                per = [r[prov] for r in ranks]
                growth = float(np.median([max(s[i]["growth_kib"] for s in per) / 1024 for i in range(len(per[0]))]))
                incl = float(np.median([max(s[i]["growth_kib"] / 1024 + s[i]["input_bytes"] / 2**20 for s in per)
                                        for i in range(len(per[0]))]))  # fmt: skip
                r1 = growth * p / base[n][0]
                r2 = incl * p / base[n][1]
                add(
                    "memory_scaling",
                    prov,
                    "peak_P*P/peak_1(hf_ring)",
                    p,
                    n,
                    (r1, r1, r1),
                    "ratio",
                    x=p,
                    note=note_of(p, "RSS growth; target <= 1.1"),
                )
                add(
                    "memory_scaling",
                    prov,
                    "peak_incl_inputs_P*P/peak_1(hf_ring)",
                    p,
                    n,
                    (r2, r2, r2),
                    "ratio",
                    x=p,
                    note=note_of(p, "RSS growth + local inputs; target <= 1.1"),
                )
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/results/attention.jsonl")
    ap.add_argument("--quick", action="store_true", help="N=512, P in {1,2}, 1 iteration (smoke test)")
    ap.add_argument("--threads", type=int, default=None, help="total threads (default: all cores)")
    ap.add_argument("--Ns", type=int, nargs="*", default=None)
    ap.add_argument("--Ps", type=int, nargs="*", default=None)
    ap.add_argument("--iters", type=int, default=None, help="iterations for every N (default: by N)")
    ap.add_argument("--no-memory", action="store_true")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per spawned group")
    ap.add_argument(
        "--wait-idle",
        type=float,
        default=0.0,
        metavar="S",
        help="before each P, wait up to S seconds for other processes to leave the CPUs",
    )
    ap.add_argument("--resume", action="store_true", help="reuse the P already in <out>_raw.json (same config)")
    ap.add_argument("--redo", type=int, nargs="*", default=None, metavar="P", help="with --resume: run these P again")
    args = ap.parse_args(argv)

    cfg = dict(QUICK if args.quick else FULL)
    meta = {"machine": machine_info(), "versions": versions()}
    cfg["threads"] = cfg["total_threads"] = args.threads or meta["machine"]["cores"]
    meta["load"] = {}
    if args.Ns:
        cfg["Ns"] = args.Ns
    if args.Ps:
        cfg["Ps"] = sorted(set(args.Ps) | {1})
    its = cfg["iters"]
    cfg["iters"] = {str(n): args.iters or its.get(n, min(its.values())) for n in cfg["Ns"]}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    t_start = time.monotonic()
    cfg["memory"] = not args.no_memory
    raw = out.with_name(out.stem + "_raw.json")
    timing, memory, walls = {}, {}, {}
    if args.resume and raw.exists():
        old = json.loads(raw.read_text())
        same = {k: old["config"].get(k) for k in ("Ns", "iters", "threads", "memory")} == {
            k: cfg[k] for k in ("Ns", "iters", "threads", "memory")
        }
        if not same:
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

    for p in cfg["Ps"]:
        if p in timing:
            continue
        t0 = time.monotonic()
        c = {**cfg, "threads": cfg["threads"] if p == 1 else max(1, cfg["threads"] // p)}
        if args.wait_idle:
            wait_idle(args.wait_idle, cores=meta["machine"]["cores"])
        per_rank, meta["load"][p] = _launch(_worker, p, c, args.timeout)
        timing[p] = [r["timing"] for r in per_rank]
        memory[p] = [r["memory"] for r in per_rank]
        walls[p] = time.monotonic() - t0
        save_raw()  # after every P, so that an interrupted run can --resume
        print(f"[bench] P={p} done in {walls[p]:.1f} s (foreign CPU load {100 * meta['load'][p]:.0f}%)", flush=True)

    # reshape: [p][rank][n][provider][iter] -> [p][n][rank][provider][iter]
    tim = {p: {n: [timing[p][r][n] for r in range(p)] for n in timing[p][0]} for p in timing}
    mem = {p: {n: [memory[p][r][n] for r in range(p)] for n in memory[p][0]} for p in memory}
    meta["load"] = {int(k): v for k, v in meta["load"].items()}
    rows = build_rows(tim, mem, cfg, meta)
    with open(out, "w") as f:
        for r in rows:
            f.write(json.dumps({k: r[k] for k in FIELDS}) + "\n")
    save_raw()
    print(f"[bench] {len(rows)} rows -> {out} (raw samples: {raw}); total {time.monotonic() - t_start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
