"""What head groups and tiled layers cost in time and save in memory, as ratios measured in one run (issue 38).

    python -m benchmarks.bench_tiled --out benchmarks/results/tiled.jsonl     # ~20 min on 2 cores
    python -m benchmarks.bench_tiled --quick --out /tmp/tiled.jsonl          # smoke test

A 2-layer Llama (hidden 256, 4 query / 2 K/V heads of 64, MLP 704, vocabulary 1024, float32) trains one
step (forward and backward with activation checkpointing and the chunked loss) on P = 2 gloo ranks, one
thread each, on sequences of N = 8K, 16K and 32K tokens, in four configurations of the same weights:

* ``base``: ring attention (``attn_implementation="ring"``), nothing else;
* ``head_groups``: ``hf_ring.enable_head_groups(model, 2)`` (one K/V head per group);
* ``tiled_layers``: ``hf_ring.enable_tiled_layers(model, 2048)`` (tiles of 2048 tokens);
* ``both``: the two together.

Each round runs the four in turn, so that the machine's drift falls on all of them alike; a configuration's
ratio is its step time over ``base``'s in the same round (median and p20..p80 over rounds), the slower rank's
time each. The peak per rank of one more step of each (``testkit.live_tensors.LiveTensorBytes``) and the
largest relative difference of its loss from ``base``'s are recorded too. Rows: ``step_time`` (seconds),
``step_ratio`` (``ratio_to_base``), ``peak_memory`` (MiB), ``loss_difference``; figure ``tiled.png``.
"""

from __future__ import annotations

import argparse
import time

from benchmarks import harness as H

SHAPE = dict(hidden_size=256, intermediate_size=704, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=1024)  # fmt: skip
CONFIGS = {"base": {}, "head_groups": {"groups": 2}, "tiled_layers": {"tiled": True},
           "both": {"groups": 2, "tiled": True}}  # fmt: skip
FULL = {"Ns": [8192, 16384, 32768], "rounds": {8192: 5, 16384: 3, 32768: 3}, "P": 2, "tile": 2048}
QUICK = {"Ns": [1024], "rounds": {1024: 1}, "P": 2, "tile": 128}


def _model(options: dict, tile: int):
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    import hf_ring

    torch.manual_seed(0)
    conf = LlamaConfig(**SHAPE, max_position_embeddings=1 << 20, tie_word_embeddings=False)
    model = AutoModelForCausalLM.from_config(conf, attn_implementation="ring")
    hf_ring.enable_activation_checkpointing(model)
    hf_ring.enable_chunked_loss(model)
    if options.get("groups"):
        hf_ring.enable_head_groups(model, options["groups"])
    if options.get("tiled"):
        hf_ring.enable_tiled_layers(model, tile)
    model.train()
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    return model


def worker(rank: int, size: int, cfg: dict) -> dict:
    """Per N: each configuration's step times (slower rank), peak bytes and loss."""
    import torch
    import torch.distributed as dist

    import hf_ring
    from testkit.live_tensors import LiveTensorBytes

    hf_ring.setup_context_parallel(size)
    models = {name: _model(opts, cfg["tile"]) for name, opts in CONFIGS.items()}
    out: dict = {}
    for n in cfg["Ns"]:
        g = torch.Generator().manual_seed(1)
        ids = torch.randint(0, SHAPE["vocab_size"], (1, n), generator=g)
        kwargs = hf_ring.shard_batch({"input_ids": ids, "labels": ids})

        def step(name: str, kwargs: dict = kwargs) -> float:
            loss = models[name](**kwargs).loss
            loss.backward()
            return float(loss.detach())

        losses = {name: step(name) for name in CONFIGS}  # warm-up, and the losses to compare
        times: dict[str, list[float]] = {name: [] for name in CONFIGS}
        for _ in range(cfg["rounds"][n]):
            for name in CONFIGS:
                dist.barrier()
                t0 = time.perf_counter()
                step(name)
                dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
                dist.all_reduce(dt, op=dist.ReduceOp.MAX)
                times[name].append(dt.item())
        peaks = {}
        for name in CONFIGS:
            dist.barrier()
            with LiveTensorBytes() as mem:
                step(name)
            peak = torch.tensor([mem.peak], dtype=torch.float64)
            dist.all_reduce(peak, op=dist.ReduceOp.MAX)
            peaks[name] = peak.item()
        out[n] = {"times": times, "peaks": peaks, "losses": losses}
        if rank == 0:
            print(f"[tiled] N={n}: " + ", ".join(f"{k} {min(v):.2f} s" for k, v in times.items()), flush=True)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/results/tiled.jsonl")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args(argv)
    cfg = QUICK if args.quick else FULL
    meta = {"machine": H.machine_info(), "versions": H.versions(transformers=True)}
    table = H.Table(meta, lambda p: 1)
    per_rank, foreign = H.launch(worker, cfg["P"], cfg, threads=1, timeout=6 * 3600)
    res, p = per_rank[0], cfg["P"]
    note = f"foreign CPU load {100 * foreign:.0f}%"
    for n in cfg["Ns"]:
        r = res[n]
        base = r["times"]["base"]
        for name, ts in r["times"].items():
            table.add("step_time", name, "seconds", p, n, H.stats(ts), "s", note=note)
            table.add("step_ratio", name, "ratio_to_base", p, n, H.stats([t / b for t, b in zip(ts, base)]), "x",
                      note=note)  # fmt: skip
            mib = r["peaks"][name] / 2**20
            table.add("peak_memory", name, "MiB", p, n, (mib, mib, mib), "MiB", note="LiveTensorBytes, worst rank")
            diff = abs(r["losses"][name] - r["losses"]["base"]) / abs(r["losses"]["base"])
            table.add("loss_difference", name, "relative", p, n, (diff, diff, diff), "")
            print(f"N={n:6d} {name:13s} {H.stats(ts)[0]:8.2f} s  x{H.stats([t / b for t, b in zip(ts, base)])[0]:.3f}"
                  f"  peak {mib:8.1f} MiB  loss diff {diff:.1e}")  # fmt: skip
    H.write_rows(args.out, table.rows)
    print(f"wrote {args.out}")
    H.draw(args.out)


if __name__ == "__main__":
    main()
