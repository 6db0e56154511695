"""``hf-ring`` command line. ``hf-ring plan MODEL --seq-len 1M --gpus 8``: per-rank memory table,
the smallest CP size that fits, and whether the ring's transfers hide behind compute."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from typing import Any

from .memory import (
    KNOWN_MODELS,
    GiB,
    _recipe_path,
    max_seq_len,
    plan,
    recipe_plan,
    smallest_cp,
    write_recipe_memory,
)


def tokens(text: str) -> int:
    """``131072``, ``128K`` (x1024), ``1M`` (x1024^2), ``1.5M``."""
    t = text.strip().upper()
    mult = {"K": 2**10, "M": 2**20, "G": 2**30}.get(t[-1:], 1)
    return int(float(t[:-1] if mult > 1 else t) * mult)


def _plan_args(a: argparse.Namespace) -> dict[str, Any]:
    return dict(
        gpu_gib=a.gpu_mem or 80.0,
        mode=a.mode,
        lora_rank=a.lora_rank,
        lora_fp32=not a.lora_bf16_adapters,
        dtype=a.dtype,
        checkpointing=not a.no_checkpointing,
        offload=a.offload,
        sharding=a.sharding,
        chunked_loss=not a.no_chunked_loss,
        loss_chunk=a.loss_chunk,
        micro_batch=a.micro_batch,
        tiled_mlp=a.tiled_mlp,
        reserve_gib=2.0 if a.reserve is None else a.reserve,
        flops=a.tflops * 1e12,
        intra_GBps=a.link_gbs,
        inter_GBps=a.inter_gbs,
        gpus_per_node=a.gpus_per_node,
    )


def _plan_json(p: Any) -> dict[str, Any]:
    return {
        "model": asdict(p.model),
        "seq_len": p.seq_len,
        "gpus": p.gpus,
        "cp": p.cp,
        "tokens_per_rank": p.tokens_per_rank,
        "settings": p.settings,
        "rows_gib": {k: v / GiB for k, v in p.rows.items()},
        "phases_gib": {k: v / GiB for k, v in p.phases.items()},
        "host_gib": {k: v / GiB for k, v in p.host.items()},
        "peak_gib": p.peak / GiB,
        "gpu_gib": p.gpu_bytes / GiB,
        "fits": p.fits,
        "overlap": p.overlap,
    }


def cmd_plan(a: argparse.Namespace) -> int:
    recipe = _recipe_path(a.model) if a.seq_len is None else None
    if recipe is not None:
        if a.write:
            print(f"{recipe}: {write_recipe_memory(recipe)}")
        given = {"gpus": a.gpus, "gpu_gib": a.gpu_mem, "cp": a.cp}
        kw = {k: v for k, v in given.items() if v is not None}
        kw.update(reserve_gib=a.reserve or 0.0, flops=a.tflops * 1e12, intra_GBps=a.link_gbs, inter_GBps=a.inter_gbs)
        p = recipe_plan(recipe, **kw)
        kw.pop("cp", None)
        fitting = [c for c in range(1, p.gpus + 1) if p.gpus % c == 0 and recipe_plan(recipe, cp=c, **kw).fits]
        best = fitting[0] if fitting else None
        a.max_len = False
    else:
        if a.write:
            raise SystemExit("hf-ring plan: --write needs a recipe as MODEL (and no --seq-len)")
        a.gpus = a.gpus or 8
        kw = _plan_args(a)
        if a.seq_len is None:
            raise SystemExit("hf-ring plan: --seq-len is required unless MODEL is a recipe")
        best = smallest_cp(a.model, a.seq_len, a.gpus, **kw)
        p = plan(a.model, a.seq_len, a.gpus, cp=a.cp or best or a.gpus, **kw)
    if a.json:
        out = _plan_json(p)
        out["smallest_fitting_cp"] = best
        if a.max_len:
            out["max_seq_len"] = max_seq_len(a.model, a.gpus, **kw)
        print(json.dumps(out, indent=2))
        return 0
    print(p.table())
    if best is None:
        print(f"  no CP size up to {p.gpus} fits: add GPUs, or try --offload, --tiled-mlp 8K, --sharding fsdp, LoRA")
    else:
        print(f"  smallest CP size that fits: {best}")
    if a.max_len:
        print(f"  longest sequence that fits with CP={a.gpus}: {max_seq_len(a.model, a.gpus, **kw):,} tokens")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="hf-ring", description="hf_ring: ring attention for long-context fine-tuning")
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser(
        "plan",
        help="per-rank memory of a long-context fine-tuning run",
        description="Per-rank memory table, smallest CP size that fits, and the ring overlap check. MODEL: a "
        f"known name ({', '.join(KNOWN_MODELS)}), a config.json or a directory with one, or a recipe "
        "(recipes/NAME.yaml; then its sequence length, CP size, LoRA and checkpointing settings are used).",
    )
    p.add_argument("model")
    p.add_argument("--seq-len", type=tokens, default=None, help="tokens per sequence: 131072, 128K, 1M")
    p.add_argument("--gpus", type=int, default=None, help="number of GPUs (default 8; a recipe states its own)")
    p.add_argument("--gpu-mem", type=float, default=None, help="GiB per GPU (default 80)")
    p.add_argument("--cp", type=int, default=None, help="CP size (default: the smallest that fits)")
    p.add_argument("--mode", choices=("lora", "full"), default="lora")
    p.add_argument("--lora-rank", type=int, default=16)
    p.add_argument(
        "--lora-bf16-adapters",
        action="store_true",
        help="adapters in the model dtype (PEFT autocast_adapter_dtype=False): no float32 input copies",
    )
    p.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16")
    p.add_argument("--no-checkpointing", action="store_true", help="keep every layer's activations")
    p.add_argument("--offload", action="store_true", help="checkpointed activations in host memory")
    p.add_argument("--sharding", choices=("none", "zero1", "zero2", "zero3", "fsdp"), default="none")
    p.add_argument("--no-chunked-loss", action="store_true", help="materialise the full logits")
    p.add_argument("--loss-chunk", type=int, default=None, help="tokens per chunk of the chunked loss")
    p.add_argument("--micro-batch", type=int, default=1, help="sequences per micro-batch")
    p.add_argument("--tiled-mlp", type=tokens, default=None, metavar="TOKENS", help="MLP over tiles of TOKENS")
    p.add_argument(
        "--reserve",
        type=float,
        default=None,
        help="GiB for CUDA context, NCCL, fragmentation (default 2; 0 for a recipe)",
    )
    p.add_argument("--tflops", type=float, default=400.0, help="achieved attention TFLOP/s per GPU")
    p.add_argument("--link-gbs", type=float, default=300.0, help="GB/s per direction between ring neighbours")
    p.add_argument("--inter-gbs", type=float, default=45.0, help="GB/s per direction across nodes")
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--max-len", action="store_true", help="also search the longest sequence that fits")
    p.add_argument("--json", action="store_true")
    p.add_argument("--write", action="store_true", help="write the figures into the recipe's memory_gb line")
    p.set_defaults(func=cmd_plan)
    a = ap.parse_args(argv)
    return a.func(a)


if __name__ == "__main__":
    sys.exit(main())
