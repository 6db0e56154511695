"""The planner's measured kernel rates from ``benchmarks.bench_gpu`` rows: ``hf_ring/planner/gpu_rates.json``.

    python -m benchmarks.gpu_rates benchmarks/results/gpu.jsonl            # update the GPU kind it ran on
    python -m benchmarks.gpu_rates $OUT/gpu.jsonl --rates /tmp/rates.json  # elsewhere

For the GPU kind of the rows (``machine.gpu`` -> ``hf_ring.planner.gpu_kind``): each kernel's attention TFLOP/s
(``gpu_kernel_tflops``, emulated ranks where measured, else causal blocks; the median over the longest half of
the lengths), the GEMM TFLOP/s (``gpu_gemm_tflops``) and memory GB/s (``gpu_memory_GBps``), with the date and
the model step's estimate/measured ratios. ``hf-ring plan --gpu KIND`` then prices steps with them and no longer
marks its time an estimate from default rates.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from benchmarks.harness import read_rows
from hf_ring.planner import gpu_kind
from hf_ring.planner.gpus import GPU_KINDS
from hf_ring.planner.timing import RATES_FILE


def rates_of(rows: list[dict]) -> tuple[str, dict]:
    """``(GPU kind, its entry)`` from one run's rows."""
    gpu = str(rows[0]["machine"].get("gpu", ""))
    kind = gpu_kind(gpu)
    key = next(k for k, v in GPU_KINDS.items() if v is kind)
    attention = {}
    for name in sorted({r["provider"] for r in rows if r["name"] == "gpu_kernel_tflops"}):
        mine = [r for r in rows if r["name"] == "gpu_kernel_tflops" and r["provider"] == name]
        pick = [r for r in mine if r["metric"] == "rank"] or mine
        xs = sorted({r["x"] for r in pick})
        longest = [r["median"] for r in pick if r["x"] in xs[len(xs) // 2 :]]
        attention[name] = round(statistics.median(longest), 1)
    one = {r["name"]: r["median"] for r in rows if r["name"] in ("gpu_gemm_tflops", "gpu_memory_GBps")}
    if not attention or "gpu_gemm_tflops" not in one:
        raise SystemExit("no gpu_kernel_tflops / gpu_gemm_tflops rows: run python -m benchmarks.bench_gpu on a GPU")
    entry = {
        "attention": attention,
        "gemm": round(one["gpu_gemm_tflops"], 1),
        "memory": round(one.get("gpu_memory_GBps", kind.hbm_GBps * 0.8), 0),
        "date": time.strftime("%Y-%m-%d"),
        "source": f"bench_gpu on {gpu}",
        "model_estimate_over_measured": {
            str(r["x"]): round(r["median"], 3) for r in rows if r["name"] == "gpu_model_estimate"
        },
    }
    return key, entry


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("rows", help="bench_gpu's JSON lines")
    ap.add_argument("--rates", default=str(RATES_FILE), help="the rates file to update")
    args = ap.parse_args(argv)
    rows = read_rows(Path(args.rows))
    if not rows:
        raise SystemExit(f"{args.rows}: no rows")
    key, entry = rates_of(rows)
    path = Path(args.rates)
    table = json.loads(path.read_text() or "{}") if path.is_file() else {}
    table[key] = entry
    path.write_text(json.dumps(table, indent=2, sort_keys=True) + "\n")
    print(f"{path}: {key} <- {json.dumps(entry)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
