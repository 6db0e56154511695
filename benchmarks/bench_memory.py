"""Measured peak memory per rank of one training step of a small ring model, against the planner (issue 5).

    python -m benchmarks.bench_memory                         # ~2 min: writes benchmarks/results/memory.{jsonl,png}
    python -m benchmarks.bench_memory --quick --out /tmp/m.jsonl

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

Rows (the long table of ``benchmarks.harness``, name ``peak_memory``, provider the configuration, x = N):
``measured``, ``planned``, ``measured/planned``, ``rss_growth``, ``host`` and ``planned_host``, in MiB
(the ratio as such); the note gives the dtype, the vocabulary, the tokens per rank, the model and the
planner's peak phase, and for a case with head groups or tiled layers (``TILED_MARK``) those options.
docs/memory.md shows them (``benchmarks.report_memory``, the tiled cases ``benchmarks.report_tiled``).
"""

from __future__ import annotations

import argparse
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


def options_note(c: dict) -> str:
    """The head groups, tiled layers, loss chunk and offload stride of case ``c``, as its rows' note ends
    (``""`` for the cases without them); ``TILED_MARK`` begins it."""
    parts = [f"{c['groups']} head groups"] if c["groups"] > 1 else []
    parts += [f"tiled layers of {c['layers']} tokens"] if c["layers"] else []
    parts += [f"the loss in chunks of {c['loss_chunk']} tokens"] if c["loss_chunk"] else []
    parts += ["offload of every other layer's input"] if c["every"] > 1 else []
    return f"; {TILED_MARK}{', '.join(parts)}" if c["groups"] > 1 or c["layers"] else ""


TILED_MARK = "head groups / tiled layers: "  # what a row's note says of a case with head groups or tiled layers


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

    table = H.Table({"machine": H.machine_info(), "versions": H.versions(transformers=True)}, lambda _: 1)
    model = (f"4-layer Llama (hidden {SHAPE['hidden_size']}, MLP {SHAPE['intermediate_size']}, "
             f"{SHAPE['num_attention_heads']} / {SHAPE['num_key_value_heads']} heads)")  # fmt: skip
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
            vals = {"measured": peak / 2**20, "planned": pl.activation_peak / 2**20,
                    "measured/planned": peak / pl.activation_peak,
                    "rss_growth": max(rss) / 2**20 if None not in rss else None,
                    "host": host / 2**20, "planned_host": sum(pl.host.values()) / 2**20}  # fmt: skip
            note = (f"{c['dtype']}, vocabulary {c['vocab']}, {pl.tokens_per_rank} tokens per rank; {model}; the "
                    f"planner's peak phase: {pl.peak_phase}{options_note(c)}")  # fmt: skip
            for metric, v in vals.items():
                unit = "ratio" if metric == "measured/planned" else "MiB"
                table.add("peak_memory", c["name"], metric, p, c["N"], (v, v, v), unit, note=note)
            print(f"{c['name']:<26} N={c['N']:>6} P={p}  measured {vals['measured']:8.2f} MiB  planned "
                  f"{vals['planned']:8.2f}  ratio {vals['measured/planned']:.3f}  rss "
                  f"{vals['rss_growth'] or float('nan'):8.2f}  host {vals['host']:.2f}", flush=True)  # fmt: skip
    return table.rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="benchmarks/results/memory.jsonl")
    ap.add_argument("--quick", action="store_true", help="a tiny grid, for tests")
    a = ap.parse_args(argv)
    grid = QUICK if a.quick else GRID
    rows = measure(grid, (2048, 2) if a.quick else (8192, 2), TILED_QUICK if a.quick else TILED_GRID)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    H.write_rows(out, rows)
    print(f"wrote {out}")
    H.draw(out)


if __name__ == "__main__":
    main()
