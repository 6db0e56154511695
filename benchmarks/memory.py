"""Measured peak memory per rank of one training step of a small ring model, against the planner (issue 5).

    python -m benchmarks.memory                         # ~2 min: writes benchmarks/results/memory.{jsonl,png}
    python -m benchmarks.memory --quick --out /tmp/m.jsonl

A 4-layer Llama (hidden 64, MLP 224 -- the 3.5x ratio of Llama-3.1-8B --, 4 query / 2 K/V heads,
vocabulary 256, float32) runs one forward + backward with attn_implementation="ring" on P gloo
ranks (spawned processes), sequence N, batch 1, activation checkpointing and the chunked loss on
(the hf_ring training path). Variants at N = 8192, P = 2: no checkpointing; offload; bfloat16;
vocabulary 32K with the chunked and with the full-logits loss; the MLP over tiles of 512 tokens,
without and with offload; LoRA (rank 16, all linear layers, PEFT defaults) on the bf16 model, plain
and with offload + tiled MLP. Head groups and tiled layers (``TILED``: 2 head groups, tiles of 256
tokens, the loss in chunks of 512): N in 4K-16K at P = 2 and 4, and at N = 8192, P = 2 each option
alone, with offload (of every layer's input, of every other one's), LoRA on bf16 with offload, tiles of
1024. Gradients are allocated before the measured step (as from an earlier micro-batch), so the figures are
the activations and working sets the step adds.

Two measures per rank, the worst rank kept:
  * ``measured``: allocator-style peak of the tensor storage that the step creates
    (``testkit.live_tensors.LiveTensorBytes``, a TorchDispatchMode that counts each storage from creation
    to free; on CPU there are no allocator statistics). Offloaded activations are counted apart
    (``host``). Repeatable to the byte.
  * ``rss``: growth of the process's resident set across the step (VmHWM after resetting it through
    /proc/self/clear_refs, minus VmRSS before), with glibc returning every allocation >= 64 KiB to
    the OS (MALLOC_MMAP_THRESHOLD_=65536): an independent cross-check that includes what the
    tracker cannot see (gloo buffers, allocator overhead). Linux only; null elsewhere.
``planned``: ``hf_ring.planner.plan(...).activation_peak`` for the same case.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from benchmarks import harness as H

SHAPE = dict(hidden_size=64, intermediate_size=224, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2)
GRID = {"Ns": [2048, 4096, 8192, 16384], "Ps": [1, 2, 4]}
QUICK = {"Ns": [1024, 2048], "Ps": [1, 2]}


def _case(n, dtype="float32", ckpt=True, offload=False, chunked=True, vocab=256, tiled=None, lora=False,
          name="ckpt+chunked", groups=1, layers=None, loss_chunk=None, every=1):  # fmt: skip
    return dict(N=n, dtype=dtype, ckpt=ckpt, offload=offload, chunked=chunked, vocab=vocab, tiled=tiled, lora=lora,
                name=name, groups=groups, layers=layers, loss_chunk=loss_chunk, every=every)  # fmt: skip


# head groups and tiled layers (issue 38): 2 head groups (one K/V head each), tiles of 256 tokens, the loss in
# chunks of 512 tokens (what Llama 3's vocabulary gets by default: 523), so that a layer's backward is the peak
TILED = dict(groups=2, layers=256, loss_chunk=512)
TILED_GRID = {"Ns": [4096, 8192, 16384], "Ps": [2, 4]}
TILED_QUICK = {"Ns": [2048], "Ps": [2]}


def tiled_case(n: int, name: str = "tiled+groups", **kw) -> dict:
    return _case(n, name=name, **{**TILED, **kw})


def tiled_variants(n: int) -> list[dict]:
    """At N = ``n``, P = 2: each option alone, with offload, LoRA on bf16, a larger tile."""
    return [
        _case(n, groups=2, loss_chunk=512, name="head groups only"),
        tiled_case(n, groups=1, name="tiled layers only"),
        tiled_case(n, offload=True, name="tiled+groups+offload"),
        tiled_case(n, offload=True, every=2, name="tiled+groups+offload every 2nd"),
        tiled_case(n, dtype="bfloat16", lora=True, offload=True, name="LoRA bf16 tiled+groups+offload"),
        tiled_case(n, layers=1024, name="tiled+groups (1024)"),
    ]


def variants(n: int) -> list[dict]:
    return [
        _case(n, ckpt=False, name="no checkpointing"),
        _case(n, offload=True, name="ckpt+offload"),
        _case(n, dtype="bfloat16", name="ckpt+chunked bf16"),
        _case(n, vocab=32000, name="ckpt+chunked V=32K"),
        _case(n, vocab=32000, chunked=False, name="ckpt+full logits V=32K"),
        _case(n, tiled=512, name="ckpt+tiled MLP (512)"),
        _case(n, tiled=512, offload=True, name="ckpt+offload+tiled MLP"),
        _case(n, dtype="bfloat16", lora=True, name="LoRA r16 bf16 ckpt+chunked"),
        _case(n, dtype="bfloat16", lora=True, offload=True, tiled=512, name="LoRA bf16 offload+tiled"),
    ]


# ============================================================================ worker side
def _worker(rank: int, size: int, cases: list[dict]) -> list[dict]:
    """Per case, one training step on this rank: the ``LiveTensorBytes`` peak (device and host) and
    the resident-set growth of a step without the tracker (None where VmHWM cannot be reset)."""
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM, LlamaConfig

    import hf_ring
    from testkit.live_tensors import LiveTensorBytes
    from testkit.models import prepare_step_model

    out = []
    for c in cases:
        conf = LlamaConfig(**SHAPE, vocab_size=c["vocab"], max_position_embeddings=1 << 20, tie_word_embeddings=False)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(conf, attn_implementation="ring").to(getattr(torch, c["dtype"]))
        model = prepare_step_model(model, c, lora_rank=16)
        g = torch.Generator().manual_seed(1)
        ids = torch.randint(0, c["vocab"], (1, c["N"]), generator=g)
        kwargs = hf_ring.shard_batch({"input_ids": ids, "labels": ids})
        rss = None
        for step in ("warm-up", "rss", "tracked"):  # the RSS pass runs without the tracker's bookkeeping
            if size > 1:
                dist.barrier()
            if step == "warm-up":  # one-time allocations (thread pools, kernels) out of the way
                model(**kwargs).loss.backward()
            elif step == "tracked":
                with LiveTensorBytes() as mem:
                    res = model(**kwargs)
                    res.loss.backward()
                    del res
            else:
                before = H.status_kib("VmRSS") * 1024 if H.reset_hwm() else None
                res = model(**kwargs)
                res.loss.backward()
                del res
                rss = H.status_kib("VmHWM") * 1024 - before if before is not None else None
        out.append({"peak": mem.peak, "host_peak": mem.host_peak, "rss": rss})
        del model
    return out


def run_p(p: int, cases: list[dict]) -> list[list[dict]]:
    """Every case on ``p`` fresh gloo ranks (one thread each), glibc returning allocations >= 64 KiB
    to the OS (``MALLOC_MMAP_THRESHOLD_``); per rank, ``_worker``'s list."""
    from testkit.spawn import spawn_ranks

    env = {"MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    return spawn_ranks(_worker, p, cases, threads=1, env=env)


# ============================================================================ driver
def measure(grid: dict, variant_at: tuple[int, int] | None, tiled_grid: dict | None = None) -> list[dict]:
    from hf_ring.planner import PlanSettings, model_shape, plan

    rows = []
    meta = {"machine": H.machine_info(), "versions": H.versions(transformers=True)}
    tiled_grid = tiled_grid or {"Ns": [], "Ps": []}
    for p in sorted(set(grid["Ps"]) | set(tiled_grid["Ps"])):
        cases = [_case(n) for n in grid["Ns"]] if p in grid["Ps"] else []
        cases += [tiled_case(n) for n in tiled_grid["Ns"]] if p in tiled_grid["Ps"] else []
        if variant_at and variant_at[1] == p:
            cases += variants(variant_at[0]) + tiled_variants(variant_at[0])
        per_rank = run_p(p, cases)
        for i, c in enumerate(cases):
            peak = max(r[i]["peak"] for r in per_rank)
            host = max(r[i]["host_peak"] for r in per_rank)
            rss = [r[i]["rss"] for r in per_rank]
            config = dict(model_type="llama", **SHAPE, vocab_size=c["vocab"])
            dtype = "fp32" if c["dtype"] == "float32" else "bf16"
            mode = "lora" if c["lora"] else "full"
            settings = PlanSettings(seq_len=c["N"], gpus=p, cp=p, mode=mode, dtype=dtype, checkpointing=c["ckpt"],
                                    offload=c["offload"], chunked_loss=c["chunked"], tiled_mlp=c["tiled"],
                                    reserve_gib=0, head_groups=c["groups"], tiled_layers=c["layers"],
                                    loss_chunk=c["loss_chunk"], offload_every=c["every"])  # fmt: skip
            pl = plan(model_shape(config), settings)
            rows.append({
                "config": c["name"], "N": c["N"], "P": p, "tokens_per_rank": pl.tokens_per_rank, "dtype": c["dtype"],
                "vocab": c["vocab"], "measured_mib": peak / 2**20, "planned_mib": pl.activation_peak / 2**20,
                "ratio": peak / pl.activation_peak, "peak_phase": pl.peak_phase,
                "rss_mib": max(rss) / 2**20 if None not in rss else None,
                "host_mib": host / 2**20, "planned_host_mib": sum(pl.host.values()) / 2**20,
                "head_groups": c["groups"], "tiled_layers": c["layers"], "loss_chunk": c["loss_chunk"],
                "offload_every": c["every"],
                "model": SHAPE, **meta,
            })  # fmt: skip
            r = rows[-1]
            print(f"{c['name']:<26} N={c['N']:>6} P={p}  measured {r['measured_mib']:8.2f} MiB  planned "
                  f"{r['planned_mib']:8.2f}  ratio {r['ratio']:.3f}  rss {r['rss_mib'] or float('nan'):8.2f}  "
                  f"host {r['host_mib']:.2f}", flush=True)  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="benchmarks/results/memory.jsonl")
    ap.add_argument("--quick", action="store_true", help="a tiny grid, for tests")
    ap.add_argument("--table", action="store_true", help="print the planner tables of docs/memory.md and exit")
    a = ap.parse_args(argv)
    if a.table:
        print(planner_tables())
        return
    grid = QUICK if a.quick else GRID
    rows = measure(grid, (2048, 2) if a.quick else (8192, 2), TILED_QUICK if a.quick else TILED_GRID)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"wrote {out}")
    H.draw(out)


# ============================================================================ planner tables (docs/memory.md)
PLANNER_COLUMNS = {
    "LoRA": dict(mode="lora"),
    "LoRA + offload": dict(mode="lora", offload=True),
    "LoRA + offload + tiled MLP": dict(mode="lora", offload=True, tiled_mlp=8192),
    "full FT": dict(mode="full"),
    "full FT + offload + tiled MLP": dict(mode="full", offload=True, tiled_mlp=8192),
}
_FLAGS = {"mode": lambda v: "--mode full" if v == "full" else "", "offload": lambda v: "--offload" if v else "",
          "tiled_mlp": lambda v: f"--tiled-mlp {v // 1024}K"}  # fmt: skip


def planner_grid() -> str:
    """Markdown: per-GPU peak of Llama-3.1-8B and Qwen2.5-7B at 128K/512K/1M on 8 and 16 x 80 GiB, and
    the ``hf-ring plan`` command that gives each cell."""
    from hf_ring.planner import GiB, PlanSettings, model_shape, plan

    lines = ["| model | N | GPUs (CP) | tokens/GPU | " + " | ".join(PLANNER_COLUMNS) + " |",
             "|---|---|---|---|" + "---|" * len(PLANNER_COLUMNS)]  # fmt: skip
    for model in ("Llama-3.1-8B", "Qwen2.5-7B"):
        for n, label in ((2**17, "128K"), (2**19, "512K"), (2**20, "1M")):
            for g in (8, 16):
                cells = []
                for kw in PLANNER_COLUMNS.values():
                    p = plan(model_shape(model), PlanSettings(seq_len=n, gpus=g, cp=g, sharding="fsdp", **kw))
                    cells.append(f"{p.peak / GiB:.1f}{'' if p.fits else ' ✗'}")
                lines.append(f"| {model} | {label} | {g} ({g}) | {n // g // 1024}K | " + " | ".join(cells) + " |")
    def column_flags(kw: dict) -> str:
        flags = " ".join(f for k, v in kw.items() if (f := _FLAGS[k](v)))
        return f"`{flags}`" if flags else "none"

    flags = "; ".join(f"{col}: {column_flags(kw)}" for col, kw in PLANNER_COLUMNS.items())
    return "\n".join(lines) + (
        "\n\nEach cell is `hf-ring plan MODEL --seq-len N --gpus G --cp G --sharding fsdp` plus the column's "
        f"flags ({flags}); LoRA rank 16, bf16, checkpointing and the chunked loss are `hf-ring plan`'s defaults."
    )


def planner_longest() -> str:
    """Markdown: the longest sequence that fits, per setup (the planner's ``max_seq_len``)."""
    from hf_ring.planner import PlanSettings, max_seq_len, model_shape

    longest = ["| setup | longest sequence that fits (planner) |", "|---|---|"]
    for model, g, kw, what in (
        ("Llama-3.1-8B", 1, dict(mode="lora"), "LoRA, 1 GPU"),
        ("Llama-3.1-8B", 1, dict(mode="lora", offload=True, tiled_mlp=8192), "LoRA + offload + tiled MLP, 1 GPU"),
        ("Llama-3.1-8B", 8, dict(mode="lora"), "LoRA, 8 GPUs"),
        ("Llama-3.1-8B", 8, dict(mode="lora", offload=True, tiled_mlp=8192), "LoRA + offload + tiled MLP, 8 GPUs"),
        ("Llama-3.1-8B", 8, dict(mode="full", offload=True, tiled_mlp=8192), "full FT + offload + tiled MLP, 8 GPUs"),
        ("Llama-3.1-8B", 16, dict(mode="lora", offload=True, tiled_mlp=8192), "LoRA + offload + tiled MLP, 16 GPUs"),
        ("Llama-3.1-8B", 32, dict(mode="full", offload=True, tiled_mlp=8192), "full FT + offload + tiled MLP, 32 GPUs"),
        ("Qwen2.5-7B", 8, dict(mode="lora", offload=True, tiled_mlp=8192), "LoRA + offload + tiled MLP, 8 GPUs"),
    ):
        n = max_seq_len(model_shape(model), PlanSettings(seq_len=0, gpus=g, sharding="fsdp", **kw))
        longest.append(f"| {model}, {what} | {n / 2**20:.2f}M ({n:,}) |")
    return "\n".join(longest)


def planner_tables() -> str:
    """Markdown: ``planner_grid`` and ``planner_longest`` (``--table``)."""
    return planner_grid() + "\n\n" + planner_longest()


if __name__ == "__main__":
    main()
