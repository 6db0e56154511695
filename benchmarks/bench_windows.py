"""A sliding-window layer under context parallelism: per-rank time against one process, bytes against N.

    python -m benchmarks.bench_windows --out benchmarks/results/windows.jsonl      # ~10-20 min on 2 cores
    python -m benchmarks.bench_windows --quick --out /tmp/windows.jsonl             # smoke test, ~20 s

One windowed attention layer (keys ``i - W < j <= i``), forward + backward, B 1, Hq 4, Hkv 2, D 64,
fp32, one thread per rank:

* ``cp_border``: N tokens on P = 4 gloo ranks (``hf_ring.ops.windows.masked_attention`` with the
  automatic plan: W - 1 fits a zigzag chunk, so each rank fetches the W - 1 rows of K/V before each
  of its two chunks and attends locally; slowest rank per iteration);
* ``one_process_N_over_P``: one process running the same windowed attention over N / P tokens (the
  work a rank would do if the sequence were cut without any border): what ``cp_border`` costs over it
  is the price of context parallelism.

Wall time (``fwd_bwd``) on a shared or oversubscribed machine mostly measures the CPU share each
process got; ``fwd_bwd_cpu`` rows give the CPU seconds of the busiest rank (and of the one process),
the work itself.

``bytes_sent`` rows: the bytes one rank sends per layer (forward + backward), from the plans (the rows
they exchange, exactly), for N from 16K to 256K: the border route (W - 1 rows of K and V per run out,
as many rows of dK/dV back) against the ring route over the same window (every hop of K/V, and the
dK/dV accumulators in float32). ``benchmarks.plot`` draws both tables (``windows.png``).
"""

from __future__ import annotations

import argparse
import time

from benchmarks import harness as H

SHAPE = dict(B=1, Hq=4, Hkv=2, D=64)
BYTES = 4  # fp32


def _inputs(n: int, seed: int):
    import torch

    g = torch.Generator().manual_seed(seed)
    return [torch.randn(SHAPE["B"], n, SHAPE[h], SHAPE["D"], generator=g) for h in ("Hq", "Hkv", "Hkv", "Hq")]


def _step(plan, q, k, v, dout) -> dict[str, float]:
    """Wall and CPU seconds of one forward + backward."""
    import torch

    from hf_ring.ops.windows import masked_attention

    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    t0, c0 = time.perf_counter(), time.process_time()
    torch.autograd.grad(masked_attention(q, k, v, plan), (q, k, v), dout)
    return {"t": time.perf_counter() - t0, "cpu": time.process_time() - c0}


def cp_worker(rank: int, size: int, cfg: dict) -> list[dict]:
    """On every rank of P: per W, this rank's fwd+bwd seconds of each kept iteration."""
    import torch.distributed as dist

    from hf_ring.ops.layout import sequence_layout
    from hf_ring.ops.windows import mask_plan
    from hf_ring.ops.zigzag import shard

    n = cfg["N"]
    meter = H.GroupLoad(None, rank, cfg["cores"])
    full = _inputs(n, 0)
    local = [shard(x, dim=1) for x in full]
    out = []
    for w in cfg["Ws"]:
        plan = mask_plan(sequence_layout(n, size), SHAPE["B"], rank, window=w)
        kept, loads, redone = H.measure(lambda plan=plan: _step(plan, *local), meter, warmup=1,
                                        iters=cfg["iters"], max_foreign=0.35, max_redo=0)  # fmt: skip
        out.append({"W": w, "route": plan.route, "times": [k["t"] for k in kept], "cpu": [k["cpu"] for k in kept],
                    "loads": loads})  # fmt: skip
        dist.barrier()
    return out


def one_worker(rank: int, size: int, cfg: dict) -> list[dict]:
    """One process: the same layer over N / P tokens, per W."""
    from hf_ring.ops.layout import sequence_layout
    from hf_ring.ops.windows import mask_plan

    n = cfg["N"] // cfg["P"]
    x = _inputs(n, 1)
    out = []
    for w in cfg["Ws"]:
        plan = mask_plan(sequence_layout(n, 1), SHAPE["B"], 0, window=w)
        _step(plan, *x)  # warm-up
        runs = [_step(plan, *x) for _ in range(cfg["iters"])]
        out.append({"W": w, "times": [r["t"] for r in runs], "cpu": [r["cpu"] for r in runs]})
    return out


def plan_bytes(n: int, p: int, w: int, rank: int = 1) -> dict[str, int]:
    """Bytes rank ``rank`` sends per layer (forward + backward) on each route, from the plans."""
    from hf_ring.ops.layout import sequence_layout
    from hf_ring.ops.windows import mask_plan

    layout = sequence_layout(n, p)
    row = SHAPE["Hkv"] * SHAPE["D"] * BYTES  # one row of K (or V, dK, dV)
    border = mask_plan(layout, 1, rank, window=w, route="border")
    ring = mask_plan(layout, 1, rank, window=w, route="ring")
    hops = len(ring.schedule) - 1
    kv = 2 * layout.local * row  # a K/V message
    return {
        "border": 2 * border.sent_rows * 2 * row,  # K and V rows out, dK and dV rows back
        "ring": hops * kv + hops * kv + len(ring.schedule) * kv,  # K/V fwd, K/V bwd, dK/dV accumulators
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="benchmarks/results/windows.jsonl")
    ap.add_argument("--quick", action="store_true", help="N = 2048, W in {64, 256}, 1 iteration")
    ap.add_argument("--P", type=int, default=4)
    ap.add_argument("--N", type=int, default=None)
    ap.add_argument("--Ws", type=int, nargs="*", default=None)
    ap.add_argument("--iters", type=int, default=None)
    ap.add_argument("--timeout", type=float, default=3600.0)
    args = ap.parse_args()
    meta = {"machine": H.machine_info(), "versions": H.versions()}
    p = args.P
    n = args.N or (2048 if args.quick else 64 * 1024)
    ws = args.Ws or ([64, 256] if args.quick else [1024, 4096])
    iters = args.iters or (1 if args.quick else 2)
    cfg = {"N": n, "P": p, "Ws": ws, "iters": iters, "cores": meta["machine"]["cores"]}
    table = H.Table(meta, lambda _: 1)
    per_rank, load = H.launch(cp_worker, p, cfg, threads=1, timeout=args.timeout)
    print(f"[windows] P={p} done (foreign CPU load {100 * load:.0f}%)", flush=True)
    (one,), _ = H.launch(one_worker, 1, cfg, threads=1, timeout=args.timeout)
    for i, w in enumerate(ws):
        samples = [max(r[i]["times"][j] for r in per_rank) for j in range(iters)]
        busy = max(per_rank[0][i]["loads"])
        route = per_rank[0][i]["route"]
        note = table.note(p, f"route {route}; other processes used up to {100 * busy:.0f}% of the CPUs")
        table.add("fwd_bwd", "cp_border", "time_slowest_rank", p, n, H.stats(samples), "s", x=w, note=note)
        table.add("fwd_bwd", "one_process_N_over_P", "time", p, n, H.stats(one[i]["times"]), "s", x=w, threads=1,
                  note=f"one process, {n // p} tokens")  # fmt: skip
        cpu = [max(r[i]["cpu"][j] for r in per_rank) for j in range(iters)]
        table.add("fwd_bwd_cpu", "cp_border", "cpu_time_busiest_rank", p, n, H.stats(cpu), "s", x=w, note=note)
        table.add("fwd_bwd_cpu", "one_process_N_over_P", "cpu_time", p, n, H.stats(one[i]["cpu"]), "s", x=w,
                  threads=1, note=f"one process, {n // p} tokens")  # fmt: skip
        t_one, c_one = H.stats(one[i]["times"])[0], H.stats(one[i]["cpu"])[0]
        print(
            f"  W={w:5d} cp_border {H.stats(samples)[0]:7.2f} s ({H.stats(cpu)[0]:7.2f} s CPU)   "
            f"one process N/P {t_one:7.2f} s ({c_one:7.2f} s CPU)"
        )
    for nn in [2048, 4096, 8192] if args.quick else [16384, 32768, 65536, 131072, 262144]:
        for w in ws:
            for route, b in plan_bytes(nn, p, w).items():
                table.add("bytes_sent", route, "bytes_sent_per_rank_per_layer", p, nn, (b, b, b), "B", x=w,
                          note="from the plan: fwd + bwd")  # fmt: skip
                print(f"  N={nn:7d} W={w:5d} {route:7s} {b / 2**20:9.3f} MiB")
    H.write_rows(args.out, table.rows)
    print(f"wrote {len(table.rows)} rows to {args.out}")
    H.draw(args.out)


if __name__ == "__main__":
    main()
