"""Token mixers of hybrid models under context parallelism: per-rank time and bytes sent, against N.

    python -m benchmarks.bench_mixers --out benchmarks/results/mixers.jsonl --max-foreign 1   # ~2 min idle
    python -m benchmarks.bench_mixers --quick --out /tmp/mixers.jsonl           # smoke test, < 20 s
    python -m benchmarks.plot benchmarks/results/mixers.jsonl                  # redraw mixers.png
    python -m benchmarks.bench_mixers --mixers rg_lru --keep                    # rerun one family, keep the rest

Each mixer family that hf_ring runs under CP (``mixer_cases.MIXERS``: one entry per family) runs
forward + backward, fp32, B = 1, one thread per rank, on one sequence of N tokens:

* ``one_process``: the local kernel on the whole sequence in one process (what transformers runs),
  timed on rank 0 of each group in every iteration while the other ranks wait;
* ``hf_ring``: its context-parallel form (``hf_ring.ops.mixers``) on the zigzag shard of each of P
  gloo ranks (``--Ps 1 2``: also at P = 1, the form's own overhead).

Rows: ``fwd_bwd`` wall seconds (the slowest rank per iteration; median / p20 / p80 over iterations)
and ``fwd_bwd_cpu`` (main-thread CPU seconds, robust to other processes on a shared machine);
``efficiency`` = t_one_process / (P x t_hf_ring), paired per iteration, wall and CPU (1: P ranks
split the work perfectly);
``comm_bytes``: bytes a rank sends per layer, forward and backward, counted from the collectives it
actually calls (``probes.CommBytes`` wraps ``torch.distributed``'s collectives in the worker
process; hf_ring is not patched), the most of any rank, by direction; ``all_to_all`` rows give, for
reading them against, what a head-parallel all-to-all form (Megatron-Core's) would send: the
mixer's inputs and output, forward and backward, ``(P - 1) / P`` of each rank's rows.

An iteration during which other processes used more than ``--max-foreign`` of the machine (default
25%) is run again (at most once per kept iteration); on a machine that is never quiet, ``--max-foreign
1`` keeps every iteration and the CPU-time rows are the ones to read. The figure
(``benchmarks.plot``) goes next to the table, same name with ``.png``.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path

from benchmarks import harness as H
from benchmarks.mixer_cases import MIXERS, lengths
from benchmarks.probes import CommBytes

FULL = {"Ns": [2048, 8192, 16384], "Ps": [2], "iters": {2048: 3, 8192: 3, 16384: 3}, "warmup": 1}
QUICK = {"Ns": [512], "Ps": [2], "iters": {512: 1}, "warmup": 0}


# ============================================================================ worker side
def worker(rank: int, size: int, cfg: dict) -> dict:
    """On every rank: per mixer and N, each kept iteration's wall and CPU seconds per provider, and
    the bytes sent by kind (forward, backward) of the last iteration."""
    import torch
    import torch.distributed as dist

    from hf_ring.ops.layout import sequence_layout

    counter = CommBytes()
    meter = H.GroupLoad(None, rank, cfg["cores"])
    out: dict = {}
    for name in cfg["mixers"]:
        mixer = MIXERS[name]
        for n in lengths(mixer, cfg["Ns"]):
            g = torch.Generator().manual_seed(n)
            *full, dout = mixer.inputs(n, g)
            layout = sequence_layout(n, size)
            index = layout.index(1)[rank][0]  # [S_local]: the global rows this rank holds
            local = [x if d is None else x.index_select(d, index) for x, d in zip([*full, dout], mixer.seq_dims)]
            *xs, dlocal = local
            plan = mixer.plan(layout, rank)
            sent: dict[str, int] = {}

            def fwd_bwd(xs: list, dy, run: Callable, sync: bool, sent: dict = sent) -> tuple[float, float]:
                leaves = [x.detach().requires_grad_() for x in xs]
                if sync:
                    dist.barrier()
                t0, c0 = time.perf_counter(), time.thread_time()
                with counter.counting("forward"):
                    y = run(leaves)
                with counter.counting("backward"):
                    torch.autograd.grad(y, leaves, dy)
                t, c = time.perf_counter() - t0, time.thread_time() - c0
                if sync:
                    sent.update(counter.take())
                return t, c

            def one_iteration(xs=xs, full=full, dlocal=dlocal, dout=dout, plan=plan, mixer=mixer) -> dict:
                rec = {}
                rec["hf_ring"] = fwd_bwd(xs, dlocal, lambda ls: mixer.cp(ls, plan, None), True)
                if rank == 0:  # the others wait in measure's barrier
                    rec["one_process"] = fwd_bwd(full, dout, mixer.full, False)
                return rec

            kept, loads, redone = H.measure(one_iteration, meter, warmup=cfg["warmup"], iters=cfg["iters"][str(n)],
                                            max_foreign=cfg["max_foreign"], max_redo=1)  # fmt: skip
            out[f"{name}/{n}"] = {"times": kept, "loads": loads, "redone": redone, "sent": dict(sent)}
    return out


# ============================================================================ table
def build_rows(results: dict[int, list[dict]], cfg: dict, meta: dict) -> list[dict]:
    """The long table from ``{P: per-rank results}``."""
    table = H.Table(meta, lambda _: 1)
    for name in cfg["mixers"]:
        shape = ", ".join(f"{k} {v}" for k, v in MIXERS[name].shape.items())
        for n in lengths(MIXERS[name], cfg["Ns"]):
            key = f"{name}/{n}"
            for p, per_rank in sorted(results.items()):
                redone = max(r[key]["redone"] for r in per_rank)
                note = f"{name}: {shape}" + (f"; {redone} iteration(s) redone under load" if redone else "")
                its = len(per_rank[0][key]["times"])
                for m, i in (("time", 0), ("cpu_time", 1)):
                    one = [it["one_process"][i] for it in per_rank[0][key]["times"]]
                    table.add("fwd_bwd", "one_process", m, p, n, H.stats(one), "s", x=name,
                              note=f"{note}; on rank 0 of the P-rank group, the others waiting")  # fmt: skip
                    worst = [max(r[key]["times"][j]["hf_ring"][i] for r in per_rank) for j in range(its)]
                    table.add("fwd_bwd", "hf_ring", m, p, n, H.stats(worst), "s", note=note, x=name)
                    eff = [t1 / (p * t) for t1, t in zip(one, worst)]
                    table.add("efficiency", "hf_ring", "t_one/(P*t_rank)" + ("" if i == 0 else "(cpu)"), p, n,
                              H.stats(eff), "fraction", note=note, x=name)  # fmt: skip
                for kind in ("forward", "backward", "total"):
                    b = max(r[key]["sent"].get(kind, 0) for r in per_rank)
                    table.add("comm_bytes", "hf_ring", f"bytes_sent_per_rank.{kind}", p, n, (b, b, b), "B",
                              note=f"{name}: counted from the collectives", x=name)  # fmt: skip
                a2a = 4 * MIXERS[name].sent(n, p)
                table.add("comm_bytes", "all_to_all", "bytes_sent_per_rank.total", p, n, (a2a, a2a, a2a), "B",
                          note=f"{name}: a head-parallel all-to-all form, computed (fp32)", x=name)  # fmt: skip
    return table.rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="benchmarks/results/mixers.jsonl")
    ap.add_argument("--quick", action="store_true", help="N=512, P = 2, 1 iteration (smoke test)")
    ap.add_argument("--mixers", nargs="*", default=list(MIXERS), choices=list(MIXERS))
    ap.add_argument("--Ns", type=int, nargs="*", default=None)
    ap.add_argument("--Ps", type=int, nargs="*", default=None)
    ap.add_argument("--iters", type=int, default=None)
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per spawned group")
    ap.add_argument("--max-foreign", type=float, default=0.25, help="redo an iteration above this foreign load")
    ap.add_argument("--keep", action="store_true", help="keep the rows of the other mixers already in --out")
    args = ap.parse_args(argv)
    out = Path(args.out)
    meta = {"machine": H.machine_info(), "versions": H.versions(transformers=True), "load": {}}
    cfg = dict(QUICK if args.quick else FULL)
    cfg["Ns"] = args.Ns or cfg["Ns"]
    cfg["Ps"] = sorted(set(args.Ps or cfg["Ps"]))
    its = cfg["iters"]
    cfg["iters"] = {str(n): args.iters or its.get(n, min(its.values())) for n in cfg["Ns"]}
    cfg.update(mixers=args.mixers, cores=meta["machine"]["cores"], max_foreign=1.0 if args.quick else args.max_foreign)
    results = {}
    for p in cfg["Ps"]:
        t0 = time.monotonic()
        results[p], load = H.launch(worker, p, cfg, threads=1, timeout=args.timeout)
        print(f"[mixers] P={p} done in {time.monotonic() - t0:.1f} s (foreign CPU load {100 * load:.0f}%)", flush=True)
    rows = build_rows(results, cfg, meta)
    for r in rows:
        if r["P"] > 1 and (r["name"] == "efficiency" or r["metric"] == "bytes_sent_per_rank.total"):
            print(f"  {r['x']:15s} {r['provider']:10s} {r['metric']:28s} P={r['P']} N={r['N']:6d}: {r['median']:.4g}")
    out.parent.mkdir(parents=True, exist_ok=True)
    if args.keep and out.exists():  # each kept row carries its own run's machine, versions and load
        old = H.read_rows(out)
        rows = [r for r in old if r["x"] not in cfg["mixers"]] + rows
    H.write_rows(out, rows)
    print(f"wrote {len(rows)} rows to {out}")
    H.draw(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
