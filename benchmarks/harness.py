"""What every benchmark here shares: ranks, load control, statistics, the long table, resident set.

* **Ranks**: ``launch`` spawns P fresh gloo ranks (``testkit.spawn.spawn_ranks``) and measures the
  CPU that other processes used meanwhile; ``each_p`` runs a worker for every P of a configuration.
* **Load control** on a shared machine: ``GroupLoad`` measures, per iteration, the share of the
  machine used by processes outside the group; ``measure`` runs warm-up then timed iterations and
  runs again an iteration during which that share was too high; ``wait_idle`` waits for a quiet
  machine.
* **Statistics and the long table** (STYLE.md point 9): ``stats`` (median, p20, p80), ``Table``
  (``FIELDS``, with ``machine_info`` and ``versions``), ``write_rows``, the one writer of every
  ``benchmarks/results/*.jsonl``, and ``read_rows`` / ``one_row``, what every reader uses; ``draw``
  runs the one plotting command (``python -m benchmarks.plot TABLE``) on a table just written.
* **Rows in words**, for the figures' subtitles and the documents' regions (``benchmarks.report``):
  ``machine_text``, ``versions_text``, ``measured_line``, ``markdown_table``, ``pct``, ``size``,
  ``gib``, ``tokens``.
* **Resident set**: ``status_kib``, ``reset_hwm``, ``allocations_to_os``.

What a benchmark measures inside hf_ring's ops (time in kernel calls and ring waits, bytes sent by
collectives) is ``benchmarks.probes``.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import json
import os
import platform
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

FIELDS = ("name", "provider", "metric", "x", "P", "N", "median", "p20", "p80", "unit",
          "machine", "versions", "threads", "note")  # fmt: skip
ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"


# ============================================================================ statistics, the long table
def machine_info() -> dict:
    """CPU model, usable cores, platform, the CUDA device when there is one
    (``hf_ring.evaluation.runtime.machine_info``, what the evaluations and the demo record)."""
    from hf_ring.evaluation.runtime import machine_info as info

    return info()


def versions(transformers: bool = False) -> dict:
    """torch, hf_ring (read from its ``__init__``: importing hf_ring imports transformers), the git
    commit (``+dirty`` when hf_ring/ has uncommitted changes), python; transformers if asked."""
    import torch

    init = ROOT / "hf_ring" / "__init__.py"
    m = re.search(r'__version__ = "([^"]+)"', init.read_text()) if init.exists() else None
    commit = "unknown"
    with contextlib.suppress(Exception):
        git = dict(capture_output=True, text=True, cwd=ROOT, timeout=10)
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], **git).stdout.strip() or commit
        if subprocess.run(["git", "status", "--porcelain", "--", "hf_ring"], **git).stdout.strip():
            commit += "+dirty"
    out = {"torch": torch.__version__, "hf_ring": m.group(1) if m else "unknown", "hf_ring_commit": commit,
           "python": platform.python_version()}  # fmt: skip
    if transformers:
        import transformers as tf

        out["transformers"] = tf.__version__
    return out


def stats(xs) -> tuple[float, float, float]:
    """(median, 20th percentile, 80th percentile) of the samples ``xs``."""
    a = np.asarray(xs, dtype=float)
    return float(np.median(a)), float(np.percentile(a, 20)), float(np.percentile(a, 80))


def per_iter_max(per_rank: list[list[dict]], key: str) -> list[float]:
    """``[rank][iter]`` samples -> per iteration, the max over ranks of ``key`` (the slowest rank)."""
    return [max(r[i][key] for r in per_rank) for i in range(len(per_rank[0]))]


def threads_per_rank(total: int, p: int) -> int:
    """Threads of each of P ranks sharing ``total`` threads (P = 1: all of them)."""
    return total if p == 1 else max(1, total // p)


class Table:
    """The long table: one row per (name, provider, metric, P, N) with median/p20/p80 and the context
    (``machine``, ``versions``, ``threads``, ``note``). ``threads_of(P)`` gives a row's default threads;
    notes of oversubscribed P (more threads than cores) say so."""

    def __init__(self, meta: dict, threads_of: Callable[[int], int]) -> None:
        self.meta, self.threads_of, self.rows = meta, threads_of, []

    def note(self, p: int, extra: str = "") -> str:
        """``extra``, preceded by "oversubscribed: ..." when P ranks have more threads than the cores."""
        t, cores = self.threads_of(p), self.meta["machine"]["cores"]
        parts = [f"oversubscribed: {p} ranks x {t} thread(s) on {cores} cores"] if p * t > cores else []
        return "; ".join([*parts, extra] if extra else parts)

    def add(self, name, provider, metric, p, n, vals, unit, x=None, threads=None, note="") -> None:
        """One row; ``vals`` = (median, p20, p80); ``x`` defaults to N, ``threads`` to ``threads_of(P)``."""
        med, p20, p80 = vals
        self.rows.append({"name": name, "provider": provider, "metric": metric, "x": n if x is None else x,
                          "P": p, "N": n, "median": med, "p20": p20, "p80": p80, "unit": unit,
                          "machine": self.meta["machine"], "versions": self.meta["versions"],
                          "threads": self.threads_of(p) if threads is None else threads, "note": note})  # fmt: skip


def draw(table: str | Path) -> None:
    """Draw ``table``'s figures next to it with the one plotting command, ``python -m benchmarks.plot
    TABLE`` (run as a command: nothing here imports the figures), and say where; without matplotlib,
    say how to get them."""
    cmd = [sys.executable, "-m", "benchmarks.plot", str(Path(table).resolve())]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode == 0:
        print("".join(f"wrote {line}\n" for line in proc.stdout.splitlines()), end="")
    elif "No module named 'matplotlib'" in proc.stderr:
        print("matplotlib is not installed: no figure (pip install hf-ring[plots]; then python -m benchmarks.plot)")
    else:
        print(f"python -m benchmarks.plot {table} failed:\n{proc.stderr[-2000:]}")


def write_rows(path: str | Path, rows: list[dict]) -> None:
    """One JSON object per line, the ``FIELDS`` of each row: the one writer of ``benchmarks/results``."""
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps({k: r[k] for k in FIELDS}) + "\n")


def read_rows(table: str | Path) -> list[dict]:
    """The rows of a long table: a path, or the name of one in ``benchmarks/results`` (``"attention"``: no
    folder, no suffix)."""
    bare = isinstance(table, str) and "/" not in table and "." not in table
    path = RESULTS / f"{table}.jsonl" if bare else Path(table)
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def one_row(rows: list[dict], **kw: object) -> dict:
    """The one row whose fields equal ``kw`` (a ``KeyError`` when none or several do)."""
    hits = [r for r in rows if all(r.get(k) == v for k, v in kw.items())]
    if len(hits) != 1:
        raise KeyError(f"{len(hits)} rows match {kw}")
    return hits[0]


# ============================================================================ rows in words
def machine_text(machine: dict | None) -> str:
    """A row's ``machine`` (``machine_info``) in words, to follow "measured on": ``"Intel(R) Xeon(R)
    Processor, 2 cores"`` (its GPU when it has one), ``"2 cores (CPU model not recorded)"``, or
    ``"a machine not recorded"`` for a row without it."""
    if not machine:
        return "a machine not recorded"
    gpu = str(machine.get("gpu", ""))
    where = gpu if gpu and not gpu.startswith("none") else machine.get("cpu")
    cores = f"{machine.get('cores', '?')} cores"
    return f"{where}, {cores}" if where else f"{cores} (CPU model not recorded)"


def versions_text(versions: dict | None) -> str:
    """A row's ``versions`` in words: ``"torch 2.13.0+cpu, hf_ring 0.1.0 (254d6d4)"`` (what it recorded)."""
    v = versions or {}
    parts = [f"torch {v['torch']}"] if "torch" in v else []
    if "hf_ring" in v:
        parts.append(f"hf_ring {v['hf_ring']}" + (f" ({v['hf_ring_commit']})" if "hf_ring_commit" in v else ""))
    return ", ".join(parts)


def measured_line(rows: list[dict], command: str) -> str:
    """The line under a measured figure: the command that wrote its rows, the machine, the versions."""
    versions = versions_text(rows[0].get("versions"))
    return f"`{command}`; measured on {machine_text(rows[0].get('machine'))}" + (f"; {versions}." if versions else ".")


def markdown_table(head: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def pct(x: float) -> str:
    return f"{x:.0%}"


def size(b: float) -> str:
    return f"{b / 1024:.3g} KiB" if b < 2**20 else f"{b / 2**20:.3g} MiB"


def gib(b: float, digits: int = 1) -> str:
    return f"{b / 2**30:.{digits}f} GiB"


def tokens(n: int) -> str:
    """``131072`` -> ``"128K"``, ``2**20`` -> ``"1M"``, ``1000`` -> ``"1000"``."""
    if n and n % 2**20 == 0:
        return f"{n >> 20}M"
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


# ============================================================================ load of other processes
def cpu_busy_s() -> float:
    """Busy CPU seconds of the whole machine since boot (all cores), from /proc/stat."""
    with open("/proc/stat") as f:
        vals = [int(x) for x in f.readline().split()[1:]]
    idle = vals[3] + vals[4]  # idle + iowait
    return (sum(vals[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def own_cpu_s() -> float:
    """CPU seconds of this process and its reaped children."""
    import resource

    a, b = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return a.ru_utime + a.ru_stime + b.ru_utime + b.ru_stime


class GroupLoad:
    """The share of the machine that processes outside a group of gloo ranks used during an iteration:
    ``start()`` on every rank, then ``stop()`` on every rank (two all-reduces over ``group``) gives
    rank 0's measurement (/proc/stat busy time minus the group's own CPU time, over wall x cores)
    on every rank."""

    def __init__(self, group, rank: int, cores: int) -> None:
        self.group, self.rank, self.cores = group, rank, cores

    def start(self) -> None:
        """Start an iteration: machine busy time, this process's CPU time, wall clock."""
        self.b0, self.c0, self.t0 = cpu_busy_s(), time.process_time(), time.monotonic()

    def stop(self) -> float:
        """End the iteration (collective): the foreign share of the machine, rank 0's, on every rank."""
        import torch
        import torch.distributed as dist

        own = torch.tensor([time.process_time() - self.c0], dtype=torch.float64)
        dist.all_reduce(own, group=self.group)
        load = torch.tensor([0.0], dtype=torch.float64)
        if self.rank == 0:
            busy = cpu_busy_s() - self.b0
            load[0] = max(0.0, busy - own.item()) / ((time.monotonic() - self.t0) * self.cores)
        dist.all_reduce(load, group=self.group)  # rank 0's value on every rank
        return load.item()


def measure(one_iteration: Callable[[], Any], meter: GroupLoad, *, warmup: int, iters: int, max_foreign: float,
            max_redo: int) -> tuple[list[Any], list[float], int]:  # fmt: skip
    """``warmup`` untimed then ``iters`` kept calls of ``one_iteration()`` on every rank of the meter's
    group, each between two barriers under ``meter``. A timed iteration during which other processes
    used more than ``max_foreign`` of the machine is run again, at most ``max_redo * iters`` times.
    Returns (the kept iterations' results, their foreign loads, the number redone)."""
    import torch.distributed as dist

    kept, loads, redone = [], [], 0
    done = 0
    while done < warmup + iters:
        dist.barrier(group=meter.group)
        meter.start()
        rec = one_iteration()
        dist.barrier(group=meter.group)
        load = meter.stop()
        warm = done < warmup
        if not warm and load > max_foreign and redone < max_redo * iters:
            redone += 1
            continue
        done += 1
        if not warm:
            kept.append(rec)
            loads.append(load)
        gc.collect()
    return kept, loads, redone


def wait_idle(max_wait: float, threshold: float = 0.15, cores: int = 1) -> float:
    """Wait (up to ``max_wait`` s) until other processes use < ``threshold`` of the machine over
    2 s; returns the last measured foreign load fraction."""
    deadline = time.monotonic() + max_wait
    while True:
        b0, o0, t0 = cpu_busy_s(), own_cpu_s(), time.monotonic()
        time.sleep(2.0)
        load = ((cpu_busy_s() - b0) - (own_cpu_s() - o0)) / ((time.monotonic() - t0) * cores)
        if load < threshold or time.monotonic() > deadline:
            return load
        print(f"[bench] machine busy ({100 * load:.0f}% foreign load); waiting", flush=True)
        time.sleep(10.0)


# ============================================================================ ranks
def launch(fn: Callable, size: int, *args: Any, threads: int, timeout: float,
           env: dict | None = None) -> tuple[list[Any], float]:  # fmt: skip
    """Run ``fn(rank, size, *args)`` on ``size`` fresh gloo ranks (``threads`` each). Returns (the
    per-rank results, the share of the machine's CPU that other processes used meanwhile)."""
    from testkit.spawn import spawn_ranks

    b0, o0, t0 = cpu_busy_s(), own_cpu_s(), time.monotonic()
    res = spawn_ranks(fn, size, *args, threads=threads, env=env, timeout=timeout)
    foreign = (cpu_busy_s() - b0) - (own_cpu_s() - o0)
    return res, max(0.0, foreign) / ((time.monotonic() - t0) * (os.cpu_count() or 1))


def each_p(fn: Callable, cfg: dict, meta: dict, *, timeout: float, wait_idle_s: float = 0.0, skip=(),
           tag: str = "bench") -> Iterator[tuple[int, list[Any], float]]:  # fmt: skip
    """For every P of ``cfg["Ps"]`` not in ``skip``: optionally wait for a quiet machine, then run
    ``fn(rank, P, cfg_P)`` on P fresh ranks, where ``cfg_P["threads"]`` shares ``cfg["threads"]``
    out. Records the run's foreign load in ``meta["load"][P]``; yields (P, per-rank results, wall s)."""
    for p in cfg["Ps"]:
        if p in skip:
            continue
        t0 = time.monotonic()
        c = {**cfg, "threads": threads_per_rank(cfg["threads"], p)}
        if wait_idle_s:
            wait_idle(wait_idle_s, cores=meta["machine"]["cores"])
        per_rank, meta["load"][p] = launch(fn, p, c, threads=c["threads"], timeout=timeout)
        wall = time.monotonic() - t0
        print(f"[{tag}] P={p} done in {wall:.1f} s (foreign CPU load {100 * meta['load'][p]:.0f}%)", flush=True)
        yield p, per_rank, wall


def add_grid_args(ap: argparse.ArgumentParser, out: str) -> None:
    """The options every multi-rank CPU benchmark takes (output, grid, threads, load control)."""
    ap.add_argument("--out", default=out)
    ap.add_argument("--quick", action="store_true", help="N=512, P in {1,2}, 1 iteration (smoke test)")
    ap.add_argument("--threads", type=int, default=None, help="total threads (default: all cores)")
    ap.add_argument("--Ns", type=int, nargs="*", default=None)
    ap.add_argument("--Ps", type=int, nargs="*", default=None, help="P=1 is always run (the reference)")
    ap.add_argument("--iters", type=int, default=None, help="iterations for every N (default: by N)")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per spawned group")
    ap.add_argument("--wait-idle", type=float, default=0.0, metavar="S",
                    help="before each P, wait up to S seconds for other processes to leave the CPUs")  # fmt: skip


def grid_config(args: argparse.Namespace, full: dict, quick: dict, cores: int) -> dict:
    """The configuration for ``add_grid_args``'s options: threads, Ns, Ps (with 1), iters by N (str keys)."""
    cfg = dict(quick if args.quick else full)
    cfg["threads"] = cfg["total_threads"] = args.threads or cores
    if args.Ns:
        cfg["Ns"] = args.Ns
    if args.Ps:
        cfg["Ps"] = sorted(set(args.Ps) | {1})
    its = cfg["iters"]
    cfg["iters"] = {str(n): args.iters or its.get(n, min(its.values())) for n in cfg["Ns"]}
    return cfg


# ============================================================================ resident set
def status_kib(key: str) -> int:
    """A field of /proc/self/status in KiB (VmRSS, VmHWM)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise KeyError(key)


def reset_hwm() -> bool:
    """Reset VmHWM to the current resident set (/proc/self/clear_refs = 5); False where refused."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc mallopt parameters


@contextlib.contextmanager
def allocations_to_os() -> Iterator[None]:
    """Within the block glibc serves every allocation >= 64 KiB with its own mmap and unmaps it on
    free (M_MMAP_THRESHOLD = 64 KiB, M_TRIM_THRESHOLD = 0), so that the resident set follows the live
    tensors; afterwards the thresholds go to glibc's dynamic maxima (32 MiB / 64 MiB, what the
    default settles at once large blocks have been freed)."""
    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(_M_MMAP_THRESHOLD, 64 * 1024)
    libc.mallopt(_M_TRIM_THRESHOLD, 0)
    libc.malloc_trim(0)
    try:
        yield
    finally:
        libc.mallopt(_M_MMAP_THRESHOLD, 32 * 1024 * 1024)
        libc.mallopt(_M_TRIM_THRESHOLD, 64 * 1024 * 1024)
        libc.malloc_trim(0)
