"""A GPT-OSS-shaped model step under context parallelism on CPU/gloo: CPU time per rank against one process.

    python -m benchmarks.bench_gptoss --out benchmarks/results/gptoss.jsonl    # N 8K, 16K; P 2
    python -m benchmarks.bench_gptoss --Ns 8192 --Ps 2 4 --out /tmp/gptoss.jsonl  # P = 4 too
    python -m benchmarks.bench_gptoss --quick --out /tmp/gptoss.jsonl           # N 1K, P 2: < 1 min

Model: ``transformers.GptOssConfig`` shrunk (hidden 256, 4 layers alternating sliding windows of 128
tokens and full attention, 8 query / 2 K/V heads of dim 32, attention sinks, 8 experts with 2 active,
router load-balancing loss on with coefficient 0.01, vocabulary 1024, float32; random weights from one
seed; nothing downloaded). One sequence of N tokens (batch 1; labels the tokens, the first fifth masked)
through ``hf_ring.shard_batch``; a step is forward (the loss, router loss included) + backward, one
thread per process:

* ``hf_ring``: attn_implementation="ring" on P gloo ranks (the sliding layers take the border route:
  127 rows of K/V fetched before each zigzag chunk; the full layers the ring; sinks applied after the
  merge; the router loss summed over the CP group);
* ``one_process``: the same model and batch with attn_implementation="ring" on one process (CP = 1:
  the same kernels, no communication).

Rows: ``fwd_bwd_cpu`` (CPU seconds of the busiest rank, and of the one process), ``fwd_bwd`` (wall
seconds, slowest rank), and ``cpu_ratio`` = busiest rank's CPU seconds / the one process's (1 / P would
be perfect division of the work). On a shared machine the CPU seconds stand for the work; wall time
mostly measures the share of the cores each process got.
"""

from __future__ import annotations

import argparse
import time

from benchmarks import harness as H

MODEL = dict(
    vocab_size=1024,
    hidden_size=256,
    intermediate_size=256,
    num_hidden_layers=4,
    layer_types=["sliding_attention", "full_attention"] * 2,
    sliding_window=128,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=32,
    num_local_experts=8,
    num_experts_per_tok=2,
    output_router_logits=True,
    router_aux_loss_coef=0.01,
    tie_word_embeddings=False,
)


def _model_and_batch(n: int):
    import torch
    from transformers import AutoModelForCausalLM, GptOssConfig

    torch.manual_seed(0)
    cfg = GptOssConfig(max_position_embeddings=max(n, 4096), **MODEL)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="ring").float().train()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, MODEL["vocab_size"], (1, n), generator=g)
    labels = ids.clone()
    labels[:, : n // 5] = -100
    return model, {"input_ids": ids, "labels": labels}


def _step(model, kwargs: dict) -> dict[str, float]:
    """Forward (the loss) + backward, timed from a barrier: wall and CPU seconds of this process."""
    import torch.distributed as dist

    model.zero_grad(set_to_none=True)
    dist.barrier()
    t0, c0 = time.perf_counter(), time.process_time()
    loss = model(**kwargs).loss
    loss.backward()
    return {"t": time.perf_counter() - t0, "cpu": time.process_time() - c0, "loss": float(loss.detach())}


def worker(rank: int, size: int, cfg: dict) -> list[dict]:
    """Per N: this rank's wall and CPU seconds of forward + backward, per kept iteration."""
    import hf_ring

    out = []
    for n in cfg["Ns"]:
        model, batch = _model_and_batch(n)
        kwargs = hf_ring.shard_batch(batch)
        _step(model, kwargs)  # warm-up
        runs = [_step(model, kwargs) for _ in range(cfg["iters"])]
        out.append({"N": n, "t": [r["t"] for r in runs], "cpu": [r["cpu"] for r in runs], "loss": runs[-1]["loss"]})
        del model
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="benchmarks/results/gptoss.jsonl")
    ap.add_argument("--quick", action="store_true", help="N = 1024, P = 2, 1 iteration")
    ap.add_argument("--Ns", type=int, nargs="*", default=None)
    ap.add_argument("--Ps", type=int, nargs="*", default=None)
    ap.add_argument("--iters", type=int, default=None)
    ap.add_argument("--timeout", type=float, default=3600.0)
    args = ap.parse_args(argv)
    meta = {"machine": H.machine_info(), "versions": H.versions(transformers=True)}
    ns = args.Ns or ([1024] if args.quick else [8192, 16384])
    ps = args.Ps or [2]
    iters = args.iters or (1 if args.quick else 2)
    cfg = {"Ns": ns, "iters": iters}
    table = H.Table(meta, lambda _: 1)
    (one,), _ = H.launch(worker, 1, cfg, threads=1, timeout=args.timeout)
    for p in ps:
        per_rank, load = H.launch(worker, p, cfg, threads=1, timeout=args.timeout)
        note = table.note(p, f"other processes used {100 * load:.0f}% of the CPUs")
        for i, n in enumerate(ns):
            wall = [max(r[i]["t"][j] for r in per_rank) for j in range(iters)]
            cpu = [max(r[i]["cpu"][j] for r in per_rank) for j in range(iters)]
            c_one = H.stats(one[i]["cpu"])
            table.add("fwd_bwd_cpu", "hf_ring", "cpu_time_busiest_rank", p, n, H.stats(cpu), "s", note=note)
            table.add("fwd_bwd", "hf_ring", "time_slowest_rank", p, n, H.stats(wall), "s", note=note)
            ratio = [c / c_one[0] for c in cpu]
            table.add("cpu_ratio", "hf_ring", "cpu_rank/cpu_one_process", p, n, H.stats(ratio), "x", note=note)
            print(
                f"[gptoss] N={n:6d} P={p}: busiest rank {H.stats(cpu)[0]:7.2f} s CPU ({H.stats(wall)[0]:7.2f} s wall), "
                f"one process {c_one[0]:7.2f} s CPU: ratio {H.stats(ratio)[0]:.3f} (1/P = {1 / p:.3f}); "
                f"loss {per_rank[0][i]['loss']:.6f} vs {one[i]['loss']:.6f}",
                flush=True,
            )
    for i, n in enumerate(ns):
        table.add("fwd_bwd_cpu", "one_process", "cpu_time", 1, n, H.stats(one[i]["cpu"]), "s", note="CP = 1")
        table.add("fwd_bwd", "one_process", "time", 1, n, H.stats(one[i]["t"]), "s", note="CP = 1")
    H.write_rows(args.out, table.rows)
    print(f"wrote {len(table.rows)} rows to {args.out}")


if __name__ == "__main__":
    main()
