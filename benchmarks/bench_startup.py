"""How long the command line takes to answer, and what ``import hf_ring`` adds to its dependencies.

    python -m benchmarks.bench_startup --before 055246b [--out /tmp/startup.jsonl]   # ~4-7 min

Each sample is a fresh interpreter, timed from start to exit (what a user waits for):

* ``hf-ring --help``, ``hf-ring train --list``, ``hf-ring plan llama-3.1-8b-128k`` (the console
  script of this environment);
* ``import torch, transformers, accelerate, peft`` (the baseline), the same with ``hf_ring`` after
  them and with ``hf_ring`` before them; ``import hf_ring overhead`` is the difference to the
  baseline, paired per repetition (both orders: registering the ring costs the same either way);
* ``import hf_ring`` alone, timed inside an interpreter that has imported the others (the least
  noisy figure of what it adds: no second interpreter start to subtract).

Each sample is taken twice: ``seconds`` (wall clock, what a user waits for) and ``cpu_seconds``
(user + system CPU time of the process, ``getrusage``), which other processes on a shared machine
disturb far less than the wall clock; the overheads are given in both.

``--before REV`` measures the same commands on the sources of that commit too (``git archive`` into
a temporary folder, put first on ``PYTHONPATH``), interleaved with this checkout's in every
repetition so both see the same machine load. It prints one line per row; ``--out`` writes them as a
long table too (``name`` the command, ``provider`` the code, ``this`` or ``before REV``, ``metric``
``seconds`` or ``cpu_seconds``, median / p20 / p80 over the repetitions). No page shows these figures,
so nothing is kept in ``benchmarks/results``.
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

from benchmarks import harness as H

HF_RING = str(Path(sys.executable).with_name("hf-ring"))
COMMANDS = {
    "hf-ring --help": [HF_RING, "--help"],
    "hf-ring train --list": [HF_RING, "train", "--list"],
    "hf-ring plan llama-3.1-8b-128k": [HF_RING, "plan", "llama-3.1-8b-128k"],
}
DEPS = "import torch, transformers, accelerate, peft"
IMPORTS = {
    "import torch, transformers, accelerate, peft": [sys.executable, "-c", DEPS],
    "... then import hf_ring": [sys.executable, "-c", f"{DEPS}; import hf_ring"],
    "import hf_ring, then ...": [sys.executable, "-c", f"import hf_ring; {DEPS}"],
}


METRICS = ("seconds", "cpu_seconds")  # wall clock; user + system CPU time

# in one interpreter: the seconds of `import hf_ring` alone, once its dependencies are loaded
IN_PROCESS = "import hf_ring, in-process, after the others"
TIME_IT = (
    f"{DEPS}; import time; t, c = time.perf_counter(), time.process_time(); import hf_ring; "
    "print(time.perf_counter() - t, time.process_time() - c)"
)


def _cpu_of_children() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def timed(cmd: list[str], pythonpath: str | None) -> tuple[float, float]:
    """(wall, CPU) seconds from start to exit of ``cmd`` (which must succeed); for ``TIME_IT``, the
    times it prints."""
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    t, c = time.perf_counter(), _cpu_of_children()
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tempfile.gettempdir(), timeout=300)
    seconds, cpu = time.perf_counter() - t, _cpu_of_children() - c
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {out.stderr[-2000:]}")
    if cmd[-1] == TIME_IT:
        wall, inside = out.stdout.split()[-2:]
        return float(wall), float(inside)
    return seconds, cpu


def sources_of(rev: str, into: Path) -> Path:
    """The ``hf_ring`` package of commit ``rev`` (``git archive``), under ``into``."""
    tar = into / "src.tar"
    subprocess.run(["git", "archive", "-o", str(tar), rev, "hf_ring"], cwd=H.ROOT, check=True)
    with tarfile.open(tar) as f:
        f.extractall(into, filter="data")
    return into


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="also write the long table here")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--before", help="a commit to measure too (its hf_ring sources), e.g. the one before a change")
    args = ap.parse_args()
    meta = {"machine": H.machine_info(), "versions": H.versions(transformers=True)}
    table = H.Table(meta, threads_of=lambda p: os.cpu_count() or 1)
    with tempfile.TemporaryDirectory() as tmp:
        variants = {"this": None}
        if args.before:
            variants[f"before {args.before}"] = str(sources_of(args.before, Path(tmp)))
        jobs = {**COMMANDS, **IMPORTS, IN_PROCESS: [sys.executable, "-c", TIME_IT]}
        samples: dict[tuple[str, str, str], list[float]] = {
            (v, name, m): [] for v in variants for name in jobs for m in METRICS
        }
        for rep in range(args.reps):
            for name, cmd in jobs.items():
                for variant, path in variants.items():
                    for metric, value in zip(METRICS, timed(cmd, path)):
                        samples[(variant, name, metric)].append(value)
            print(f"repetition {rep + 1}/{args.reps} done", flush=True)
    for (variant, name, metric), xs in samples.items():
        table.add(name, variant, metric, 1, 0, H.stats(xs), "s", x=0, note=" ".join(jobs[name][1:]))
    base = "import torch, transformers, accelerate, peft"
    for variant in variants:
        for metric in METRICS:
            for order, where in (("... then import hf_ring", "after"), ("import hf_ring, then ...", "before")):
                diffs = [a - b for a, b in zip(samples[(variant, order, metric)], samples[(variant, base, metric)])]
                name, note = f"import hf_ring overhead, hf_ring {where} the others", f"{order!r} minus {base!r}"
                table.add(name, variant, metric, 1, 0, H.stats(diffs), "s", x=0, note=f"{note}, paired per repetition")
    if args.out:
        H.write_rows(args.out, table.rows)
    for r in table.rows:
        print(f"{r['provider']:<16} {r['metric']:<12} {r['name']:<55} {r['median']:6.2f} s  "
              f"(p20 {r['p20']:.2f}, p80 {r['p80']:.2f})")  # fmt: skip


if __name__ == "__main__":
    main()
