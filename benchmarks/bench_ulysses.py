"""Ring vs Ulysses vs hybrid: one attention layer's forward + backward on P gloo ranks.

    python -m benchmarks.bench_ulysses --out benchmarks/results/ulysses.jsonl      # ~5 min idle
    python -m benchmarks.bench_ulysses --quick --out /tmp/ulysses.jsonl              # smoke test
    python -m benchmarks.bench_ulysses --plot-only                                   # redraw ulysses.png

Causal attention, B=1, Hq=8, Hkv=2, D=64, fp32, total N in {4096, 8192}, P=4 ranks, one thread
each (on 2 cores: oversubscribed; the rows say so). Providers, all over the same P ranks in the
layout each needs (``hf_ring.shard`` after ``setup_context_parallel(P, ulysses_size=U)``):

* ``ring`` (U=1): the zigzag ring over P ranks;
* ``hybrid_U2`` (U=2 x R=P/2): all-to-all inside pairs of ranks, ring over P/2 on half the heads;
* ``ulysses`` (U=P): all-to-all only, one kernel call per rank on Hq/P heads (K/V heads replicated
  when P does not divide Hkv: here 2x).

Each iteration runs every provider from its own barrier; a row keeps the slowest rank per
iteration, then median / p20 / p80 over iterations (``harness.measure``: iterations during which
other processes used too much of the machine are run again). ``comm_bytes`` rows give the bytes a
rank sends per layer (``hf_ring.planner.attention_comm_bytes``), for reading the times against.
The figure (``plot``: time per provider and N, bytes sent beside it) goes next to the table, same
name with ``.png``; it needs matplotlib.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from benchmarks import harness as H

PROVIDERS = {"ring": 1, "hybrid_U2": 2, "ulysses": 0}  # 0: U = P
SHAPE = dict(B=1, Hq=8, Hkv=2, D=64)


def worker(rank: int, size: int, cfg: dict) -> dict:
    """On every rank: per N, per provider, this rank's fwd+bwd seconds of each kept iteration."""
    import torch

    import hf_ring
    from hf_ring.ops.ring import ring_attention
    from hf_ring.ops.ulysses import ulysses_ring_attention
    from hf_ring.ops.zigzag import shard

    groups = {name: hf_ring.setup_context_parallel(size, ulysses_size=u or size) for name, u in PROVIDERS.items()}
    meter = H.GroupLoad(groups["ring"].cp_group, rank, cfg["cores"])
    out: dict = {}
    for n in cfg["Ns"]:
        g = torch.Generator().manual_seed(n)
        full = [torch.randn(SHAPE["B"], n, SHAPE[h], SHAPE["D"], generator=g) for h in ("Hq", "Hkv", "Hkv", "Hq")]
        inputs = {name: [shard(x, group=cp.cp_group, ulysses_size=cp.ulysses_size) for x in full]
                  for name, cp in groups.items()}  # fmt: skip

        def attend(cp, q, k, v):
            if cp.ulysses_size == 1:
                return ring_attention(q, k, v, group=cp.cp_group)
            return ulysses_ring_attention(q, k, v, ulysses_group=cp.ulysses_group, ring_group=cp.ring_group)

        def one_iteration(inputs: dict = inputs) -> dict:
            times = {}
            for name, cp in groups.items():
                q, k, v, dout = inputs[name]
                q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
                torch.distributed.barrier(group=cp.cp_group)
                t0 = time.perf_counter()
                o = attend(cp, q, k, v)
                torch.autograd.grad(o, (q, k, v), dout)
                times[name] = time.perf_counter() - t0
            return times

        kept, loads, redone = H.measure(one_iteration, meter, warmup=1, iters=cfg["iters"], max_foreign=0.25,
                                        max_redo=2)  # fmt: skip
        out[n] = {"times": kept, "loads": loads, "redone": redone}
    return out


LABELS = {"ring": "ring (U=1)", "hybrid_U2": "hybrid U=2 x R=2", "ulysses": "Ulysses (U=P)"}


def plot(rows: list[dict], path: Path) -> Path:
    """``path``: the median fwd+bwd seconds per provider and N (p20..p80 bars) and the bytes a rank
    sends per layer, from this benchmark's rows (one P)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    times = [r for r in rows if r["name"] == "fwd_bwd"]
    sent = [r for r in rows if r["name"] == "comm_bytes"]
    ns = sorted({r["N"] for r in times})
    (p,) = {r["P"] for r in times}
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3.8))
    width = 0.8 / len(PROVIDERS)
    for i, name in enumerate(PROVIDERS):
        x = [j + (i - (len(PROVIDERS) - 1) / 2) * width for j in range(len(ns))]
        t = [next(r for r in times if r["provider"] == name and r["N"] == n) for n in ns]
        a1.bar(x, [r["median"] for r in t], width, label=LABELS[name],
               yerr=[[r["median"] - r["p20"] for r in t], [r["p80"] - r["median"] for r in t]], capsize=3)  # fmt: skip
        b = [next(r for r in sent if r["provider"] == name and r["N"] == n) for n in ns]
        a2.bar(x, [r["median"] / 2**20 for r in b], width, label=LABELS[name])
    for ax, title in ((a1, f"attention fwd+bwd per layer, P = {p} (s, slowest rank)"),
                      (a2, "bytes sent per rank per layer (MiB, planner)")):  # fmt: skip
        ax.set_xticks(range(len(ns)), [f"N = {n}" for n in ns])
        ax.set_title(title, fontsize=10)
        ax.grid(True, axis="y", alpha=0.3)
    a1.legend(fontsize=8)
    m, v = times[0]["machine"], times[0]["versions"]
    fig.suptitle(f"causal, Hq {SHAPE['Hq']}, Hkv {SHAPE['Hkv']}, D {SHAPE['D']}, fp32, gloo; {m['cpu']}, {m['cores']} "
                 f"cores, {times[0].get('threads', 1)} thread per rank; torch {v['torch']}, hf_ring "
                 f"{v.get('hf_ring_commit', '?')}", fontsize=7, color="dimgray")  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="benchmarks/results/ulysses.jsonl")
    ap.add_argument("--quick", action="store_true", help="N=512, 1 iteration (smoke test)")
    ap.add_argument("--P", type=int, default=4)
    ap.add_argument("--Ns", type=int, nargs="*", default=None)
    ap.add_argument("--iters", type=int, default=None)
    ap.add_argument("--timeout", type=float, default=1800.0)
    ap.add_argument("--plot-only", action="store_true", help="only redraw the figure from --out")
    args = ap.parse_args()
    out = Path(args.out)
    if args.plot_only:
        rows = [json.loads(line) for line in out.read_text().splitlines() if line.strip()]
        print(f"wrote {plot(rows, out.with_suffix('.png'))}")
        return
    from hf_ring.planner import ModelShape, attention_comm_bytes

    meta = {"machine": H.machine_info(), "versions": H.versions()}
    cores = meta["machine"]["cores"]
    ns = args.Ns or ([512] if args.quick else [4096, 8192])
    iters = args.iters or (1 if args.quick else 5)
    cfg = {"Ns": ns, "iters": iters, "cores": cores}
    p = args.P
    per_rank, load = H.launch(worker, p, cfg, threads=1, timeout=args.timeout)
    print(f"[ulysses] P={p} done (foreign CPU load {100 * load:.0f}%)", flush=True)
    table = H.Table(meta, lambda _: 1)
    shape = ModelShape("bench", hidden=SHAPE["Hq"] * SHAPE["D"], intermediate=1, layers=1, heads=SHAPE["Hq"],
                       kv_heads=SHAPE["Hkv"], head_dim=SHAPE["D"], vocab=1)  # fmt: skip
    for n in ns:
        redone = max(r[n]["redone"] for r in per_rank)
        note = table.note(p, f"{redone} iteration(s) redone under load" if redone else "")
        for name, u in PROVIDERS.items():
            u = u or p
            samples = [max(r[n]["times"][i][name] for r in per_rank) for i in range(iters)]
            table.add("fwd_bwd", name, "time", p, n, H.stats(samples), "s", note=note)
            comm = attention_comm_bytes(shape, 4, n, p, u)["total"]
            table.add("comm_bytes", name, "bytes_sent_per_rank", p, n, (comm, comm, comm), "B", note=f"U={u}")
            print(f"  N={n:6d} {name:10s} U={u}: {H.stats(samples)[0] * 1e3:8.1f} ms, {comm / 2**20:6.2f} MiB sent")
    H.write_rows(args.out, table.rows)
    print(f"wrote {len(table.rows)} rows to {args.out}")
    try:
        print(f"wrote {plot(table.rows, out.with_suffix('.png'))}")
    except ImportError:
        print("matplotlib is not installed: no figure (pip install hf-ring[plots])")


if __name__ == "__main__":
    main()
