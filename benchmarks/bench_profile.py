"""Where the time of one hf_ring fwd+bwd goes, between and inside the kernel calls.

    python -m benchmarks.bench_profile --out benchmarks/results/profile_p2_n8192.txt [--P 2 --N 8192]
    python -m benchmarks.bench_profile --quick --out /tmp/profile.txt                # P=2, N=512: smoke test

Spawns P gloo ranks (1 thread each, or all cores for P=1), warms up, then runs one fwd+bwd under
torch.profiler on every rank. The op gets a ``probes.TimedKernel`` and a ``probes.TimedRing``
(``backend=``, ``ring=``), which open labelled ranges around the block kernels and the channels'
``commit`` and ``wait``; the forward runs inside a range ``hf_ring.forward`` (``workloads.HfRing``).
hf_ring is not patched, so ``merge_`` has no range of its own: the LSE merge is the forward's
element-wise ops outside the kernels (``MERGE_OPS``, by name), without the Python time inside
``merge_``. Every other aten op is assigned to one category by the innermost labelled range that
holds it, or by its name; the rest of the wall time is Python / autograd overhead. Writes a text
report with the per-rank breakdown and the top ops by self time.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

from benchmarks import harness as H

LABELS = {
    "hf_ring.kernel.forward": "kernel fwd",
    "hf_ring.kernel.backward": "kernel bwd",
    "hf_ring.comm.commit": "comm commit (batch_isend_irecv)",
    "hf_ring.comm.wait": "comm wait",
}
FORWARD = "hf_ring.forward"  # the range around the op's forward (workloads.HfRing.fwd_bwd)
MERGE = "merge_ (fwd LSE merge, its aten ops)"
MERGE_OPS = {"aten::logaddexp", "aten::sub", "aten::exp", "aten::nan_to_num_", "aten::unsqueeze", "aten::mul_",
             "aten::mul", "aten::add_", "aten::copy_"}  # fmt: skip
COUNTED = ("aten::_scaled_dot_product_flash_attention_for_cpu",
           "aten::_scaled_dot_product_flash_attention_for_cpu_backward",
           "aten::logaddexp",  # one per merge_ call
           "hf_ring.comm.wait", "aten::add_")  # fmt: skip
ALLOC = {"aten::zeros", "aten::full", "aten::empty", "aten::empty_like", "aten::zero_", "aten::fill_",
         "aten::empty_strided", "aten::zeros_like"}  # fmt: skip
COPY = {"aten::stack", "aten::cat", "aten::copy_", "aten::to", "aten::_to_copy", "aten::contiguous", "aten::clone"}
ACCUM = {"aten::add_", "aten::add"}


def _categorise(events, wall_us: float) -> dict:
    """Self time per category from a flat list of profiler events on the main thread."""
    main_tid = max(
        {e.thread for e in events}, key=lambda t: sum(e.self_cpu_time_total for e in events if e.thread == t)
    )
    evs = [e for e in events if e.thread == main_tid]
    labelled = [e for e in evs if e.name in LABELS]
    fwd = [e for e in evs if e.name == FORWARD]
    evs = [e for e in evs if e.name != FORWARD]
    cats: dict = defaultdict(float)
    for e in evs:
        if e.name in LABELS:
            continue
        start, end = e.time_range.start, e.time_range.end
        owner = None
        for lab in labelled:  # innermost labelled range containing this op
            if lab.time_range.start <= start and end <= lab.time_range.end:
                if owner is None or lab.time_range.start >= owner.time_range.start:
                    owner = lab
        if owner is not None:
            cats[LABELS[owner.name]] += e.self_cpu_time_total
        elif e.name in MERGE_OPS and any(f.time_range.start <= start and end <= f.time_range.end for f in fwd):
            cats[MERGE] += e.self_cpu_time_total
        elif e.name in ALLOC:
            cats["allocation / zero-fill"] += e.self_cpu_time_total
        elif e.name in COPY:
            cats["copies (stack, to, contiguous)"] += e.self_cpu_time_total
        elif e.name in ACCUM:
            cats["gradient accumulation (add_)"] += e.self_cpu_time_total
        else:
            cats["other aten ops"] += e.self_cpu_time_total
    for lab in labelled:  # time in the labelled range not covered by aten ops (Python, gloo calls)
        inner = sum(
            e.self_cpu_time_total
            for e in evs
            if e.name not in LABELS
            and lab.time_range.start <= e.time_range.start
            and e.time_range.end <= lab.time_range.end
        )
        cats[LABELS[lab.name]] += max(0.0, lab.time_range.elapsed_us() - inner)
    cats["Python / autograd / untraced"] = max(0.0, wall_us - sum(cats.values()))
    return dict(cats)


def _worker(rank: int, size: int, cfg: dict) -> dict:
    """Warm-up, then one profiled fwd+bwd: this rank's categories, top ops and call counts."""
    import torch
    import torch.distributed as dist

    from benchmarks import workloads as W

    hf = W.HfRing.on(None)
    zz = W.local_inputs(cfg["N"], rank, size)
    for _ in range(cfg["warmup"]):
        dist.barrier()
        hf.fwd_bwd(*zz)
    dist.barrier()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        c0 = time.thread_time()
        r = hf.fwd_bwd(*zz)
        wall_us = (time.perf_counter() - t0) * 1e6
        cpu_us = (time.thread_time() - c0) * 1e6
    events = prof.events()
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18, max_name_column_width=48)
    counts = defaultdict(int)
    for e in events:
        counts[e.name] += 1
    return {"rank": rank, "wall_us": wall_us, "cpu_us": cpu_us, "cats": _categorise(events, wall_us), "table": table,
            "probe": r, "calls": {k: counts[k] for k in COUNTED}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/results/profile_p2_n8192.txt")
    ap.add_argument("--P", type=int, default=2)
    ap.add_argument("--N", type=int, default=8192)
    ap.add_argument("--threads", type=int, default=None, help="total threads (default: all cores)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--quick", action="store_true", help="N=512 (smoke test)")
    args = ap.parse_args(argv)
    if args.quick:
        args.N = 512
    total = args.threads or len(os.sched_getaffinity(0))
    cfg = {"N": args.N, "threads": max(1, total // args.P), "warmup": args.warmup}
    parts, _ = H.launch(_worker, args.P, cfg, threads=cfg["threads"], timeout=1800.0)

    lines = [
        f"hf_ring fwd+bwd profile: P={args.P}, N={args.N}, causal, B=1, Hq=8, Hkv=2, D=64, fp32, "
        f"{cfg['threads']} thread(s)/rank, gloo on {total} cores",
        "",
    ]
    cat_names = sorted({c for p in parts for c in p["cats"]}, key=lambda c: -parts[0]["cats"].get(c, 0))
    head = f"{'category (self time, main thread)':<40}" + "".join(f"{'rank ' + str(p['rank']):>18}" for p in parts)
    lines += [head, "-" * len(head)]
    for c in cat_names:
        cells = ""
        for p in parts:
            v = p["cats"].get(c, 0.0)
            cells += f"{v / 1e3:>10.1f} ms {100 * v / p['wall_us']:>4.1f}%"
        lines.append(f"{c:<40}{cells}")
    lines.append(f"{'wall (profiled, fwd+bwd)':<40}" + "".join(f"{p['wall_us'] / 1e3:>10.1f} ms      " for p in parts))
    lines.append(f"{'main-thread CPU':<40}" + "".join(f"{p['cpu_us'] / 1e3:>10.1f} ms      " for p in parts))
    lines.append("")
    lines.append("calls per rank: " + json.dumps(parts[0]["calls"]))
    for p in parts:
        lines += ["", f"== rank {p['rank']}: top ops by self CPU time (torch.profiler) ==", p["table"]]
    text = "\n".join(lines) + "\n"
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
