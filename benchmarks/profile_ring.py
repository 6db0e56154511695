"""Where the time of one hf_ring fwd+bwd goes, between and inside the kernel calls.

    python -m benchmarks.profile_ring --out benchmarks/results/profile_p2_n8192.txt [--P 2 --N 8192]

Spawns P gloo ranks (1 thread each, or all cores for P=1), warms up, then runs one fwd+bwd under
torch.profiler on every rank, with labelled ranges around the block kernels, ``merge_``,
``RingComm.commit`` and ``RingComm.wait`` (wrappers installed in this process only; hf_ring is not
edited). Every aten op is assigned to one category by the innermost labelled range that holds it,
or by its name; the rest of the wall time is Python / autograd overhead. Writes a text report
with the per-rank breakdown and the top ops by self time.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

LABELS = {
    "hf_ring.kernel.forward": "kernel fwd",
    "hf_ring.kernel.backward": "kernel bwd",
    "hf_ring.merge_": "merge_ (fwd LSE merge)",
    "hf_ring.comm.commit": "comm commit (batch_isend_irecv)",
    "hf_ring.comm.wait": "comm wait",
}
ALLOC = {"aten::zeros", "aten::full", "aten::empty", "aten::empty_like", "aten::zero_", "aten::fill_",
         "aten::empty_strided", "aten::zeros_like"}  # fmt: skip
COPY = {"aten::stack", "aten::cat", "aten::copy_", "aten::to", "aten::_to_copy", "aten::contiguous", "aten::clone"}
ACCUM = {"aten::add_", "aten::add"}


def _install_labels() -> None:
    import torch

    import hf_ring.ops.comm as hcomm
    import hf_ring.ops.ring as hring
    from benchmarks import workloads as W

    W.install_probes()  # kernel + wait ranges
    orig_merge, orig_commit = hring.merge_, hcomm.RingComm.commit

    def merge_(*a, **kw):
        with torch.profiler.record_function("hf_ring.merge_"):
            return orig_merge(*a, **kw)

    def commit(self):
        with torch.profiler.record_function("hf_ring.comm.commit"):
            return orig_commit(self)

    hring.merge_ = merge_
    hcomm.RingComm.commit = commit


def _categorise(events, wall_us: float) -> dict:
    """Self time per category from a flat list of profiler events on the main thread."""
    main_tid = max(
        {e.thread for e in events}, key=lambda t: sum(e.self_cpu_time_total for e in events if e.thread == t)
    )
    evs = [e for e in events if e.thread == main_tid]
    labelled = [e for e in evs if e.name in LABELS]
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


def _worker(rank: int, size: int, init_file: str, cfg: dict, out_path: str) -> None:
    import torch
    import torch.distributed as dist

    from benchmarks import workloads as W

    torch.set_num_threads(cfg["threads"])
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=size)
    try:
        _install_labels()
        zz = W.local_inputs(cfg["N"], rank, size)
        for _ in range(cfg["warmup"]):
            dist.barrier()
            W.hf_ring_fwd_bwd(*zz, group=None)
        dist.barrier()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            t0 = time.perf_counter()
            c0 = time.thread_time()
            r = W.hf_ring_fwd_bwd(*zz, group=None)
            wall_us = (time.perf_counter() - t0) * 1e6
            cpu_us = (time.thread_time() - c0) * 1e6
        events = prof.events()
        cats = _categorise(events, wall_us)
        table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18, max_name_column_width=48)
        counts = defaultdict(int)
        for e in events:
            counts[e.name] += 1
        parts = [None] * size
        dist.all_gather_object(
            parts,
            {"rank": rank, "wall_us": wall_us, "cpu_us": cpu_us, "cats": cats, "table": table, "probe": r,
             "calls": {k: counts[k] for k in ("aten::_scaled_dot_product_flash_attention_for_cpu",
                                              "aten::_scaled_dot_product_flash_attention_for_cpu_backward",
                                              "hf_ring.merge_", "hf_ring.comm.wait", "aten::add_")}},
        )  # fmt: skip
        if rank == 0:
            with open(out_path, "w") as f:
                json.dump(parts, f)
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    import torch.multiprocessing as mp

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/results/profile_p2_n8192.txt")
    ap.add_argument("--P", type=int, default=2)
    ap.add_argument("--N", type=int, default=8192)
    ap.add_argument("--threads", type=int, default=None, help="total threads (default: all cores)")
    ap.add_argument("--warmup", type=int, default=1)
    args = ap.parse_args(argv)
    total = args.threads or len(os.sched_getaffinity(0))
    cfg = {"N": args.N, "threads": max(1, total // args.P), "warmup": args.warmup}
    tmp = tempfile.mkdtemp(prefix="hf_ring_prof_")
    try:
        res_path = os.path.join(tmp, "res.json")
        mp.start_processes(
            _worker, args=(args.P, os.path.join(tmp, "rdzv"), cfg, res_path), nprocs=args.P, start_method="spawn"
        )
        with open(res_path) as f:
            parts = json.load(f)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

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
