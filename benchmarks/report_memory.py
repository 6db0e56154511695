"""Memory, as docs/memory.md shows it: the peak per rank of a small model's training step measured against
the planner (``benchmarks/results/memory.jsonl``, ``benchmarks.bench_memory``), the chunked loss's errors under
bf16 autocast (``autocast_errors.jsonl``), and the planner's own figures, computed by ``hf_ring.planner``
each time the documents are rendered: what the tools remove, the MLP's share of one layer's recompute, the
LoRA adapters' float32 copies, the ring's overlap threshold, the host memory of offload, per-GPU peaks and
the longest sequences next to published figures. Measured figures end with the command that wrote their
rows and the machine; planned ones name the setup they price. ``benchmarks.report`` puts them in the
documents' marked regions.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from .bench_memory import TILED_MARK
from .harness import gib, measured_line, one_row, read_rows, tokens
from .harness import markdown_table as table

if TYPE_CHECKING:
    from hf_ring.planner import ModelShape

LLAMA = "Llama-3.1-8B"
MAIN = "ckpt+chunked"  # the grid's configuration; the variants are measured at N = 8192, P = 2
MEMORY = "python -m benchmarks.bench_memory"  # the command that writes memory.jsonl


# ------------------------------------------------------------------------------------------ measured
def _mib(rows: list[dict], config: str, n: int, p: int, metric: str = "measured") -> float:
    return one_row(rows, provider=config, N=n, P=p, metric=metric)["median"]


def memory_grid() -> str:
    rows = read_rows("memory")
    main = [r for r in rows if r["provider"] == MAIN]
    ns, ps = sorted({r["N"] for r in main}), sorted({r["P"] for r in main})
    cells = [[str(n), *(f"{_mib(main, MAIN, n, p):.2f} ({_mib(main, MAIN, n, p, 'planned'):.2f})" for p in ps)]
             for n in ns]  # fmt: skip
    return table(["N", *(f"P = {p}" for p in ps)], cells) + "\n\n" + measured_line(main, MEMORY)


def tiled(row: dict) -> bool:
    """A row of a case with head groups or tiled layers (``benchmarks.report_tiled`` shows those)."""
    return TILED_MARK in row["note"]


def memory_variants() -> str:
    rows = read_rows("memory")
    n, p = 8192, 2
    sel = [r for r in rows if r["N"] == n and r["P"] == p and not tiled(r)]
    head = ["configuration", "measured MiB", "planned MiB", "measured / planned", "RSS growth MiB",
            "host (offloaded) MiB"]  # fmt: skip
    cells = [[c, *(format(_mib(sel, c, n, p, metric), fmt) for metric, fmt in (
        ("measured", ".2f"), ("planned", ".2f"), ("measured/planned", ".3f"), ("rss_growth", ".2f"), ("host", ".2f")))]
        for c in dict.fromkeys(r["provider"] for r in sel)]  # fmt: skip
    return table(head, cells) + "\n\n" + measured_line(sel, MEMORY)


def memory_fit() -> str:
    """The grid's scaling in N / P and how close the planner comes, from ``memory.jsonl``."""
    rows = read_rows("memory")
    main = [r for r in rows if r["provider"] == MAIN and r["metric"] == "measured"]
    same = [(2048 * p, p) for p in (1, 2, 4)]
    halves = [_mib(rows, MAIN, r["N"], r["P"] // 2) / r["median"] for r in main if r["P"] > 1]
    ratios = [r for r in rows if r["metric"] == "measured/planned"]
    worst = max(abs(1 - r["median"]) for r in ratios)
    worst_main = max(abs(1 - r["median"]) for r in ratios if r["provider"] == MAIN)
    where = ", ".join(f"({n}, {p})" for n, p in same)
    peaks = sorted({f"{_mib(rows, MAIN, n, p):.1f}" for n, p in same})
    factor = sorted({f"{h:.2f}" for h in halves})
    return (
        f"Peak memory per rank is a function of N / P alone: {'the same ' if len(peaks) == 1 else ''}"
        f"{' / '.join(peaks)} MiB at (N, P) = {where}, and at a fixed N doubling P divides it by "
        f"{factor[0] if len(factor) == 1 else factor[0] + '-' + factor[-1]}. The planner predicts every case within "
        f"{worst:.0%} ({worst_main:.1%} for the main grid). " + measured_line(rows, MEMORY)
    )


def lora_ratio() -> float:
    """Measured / planned peak of the small model's ``LoRA r16 bf16 ckpt+chunked`` variant."""
    return one_row(read_rows("memory"), provider="LoRA r16 bf16 ckpt+chunked", metric="measured/planned")["median"]


def autocast_errors() -> str:
    """The chunked loss's default chunk and its errors under bf16 autocast, from ``autocast_errors.jsonl``."""
    from hf_ring.ops.cross_entropy import LOGITS_CHUNK_BYTES, default_chunk_size

    rows = read_rows("autocast_errors")

    def err(provider: str, metric: str = "worst_param") -> float:
        return one_row(rows, provider=provider, metric=metric)["median"]

    before = next(r["provider"] for r in rows if r["provider"].startswith("chunked@")).split("@")[1]
    prob = float(re.search(r"median target probability ([\d.]+)", rows[0]["note"]).group(1))  # type: ignore[union-attr]
    vocab = 128_256
    return (
        f"The chunk size defaults to {LOGITS_CHUNK_BYTES >> 20} MiB of float32 logits ({default_chunk_size(vocab)} "
        f"tokens for Llama 3's vocabulary of {vocab:,}). `python -m benchmarks.bench_autocast` measures the autocast "
        f"path on a tiny Llama that predicts its targets with median probability {prob:.2f}: "
        f"worst parameter-gradient error against float64 {err('chunked'):.3f} for the chunked loss and "
        f"{err('plain'):.3f} for transformers' loss ({err('chunked@' + before):.2f} at commit {before}, when the "
        f"recompute ran in float32 against a bf16 log-sum-exp). Logits kept in float32 in both passes would be closer "
        f"still ({err('chunked_fp32_logits'):.3f}, the head's gradient "
        f"{err('chunked', 'lm_head') / err('chunked_fp32_logits', 'lm_head'):.0f}x closer) at the price of float32 "
        "GEMMs. "
        + measured_line(rows, "python -m benchmarks.bench_autocast --out benchmarks/results/autocast_errors.jsonl")
    )


# ------------------------------------------------------------------------------------------- planned
def _kib(b: float) -> str:
    return f"{b / 1024:.0f} KiB"


def _mlp_part(m: ModelShape, b: int, lora: bool) -> float:
    """Bytes per token of the MLP's part of one layer's recompute: what it saves for backward (the LoRA
    adapters' float32 input copies included) and its two gradients in flight."""
    from hf_ring.planner import LORA_TARGETS, activation_terms

    a = activation_terms(m, b, lora=(16, LORA_TARGETS) if lora else None)
    return a["mlp_saved"] + 2 * m.intermediate * b


# ------------------------------------------------------------------------------------- docs/memory.md
def memory_tools() -> str:
    """The table of the four tools, with what the chunked loss and checkpointing remove (planner)."""
    from hf_ring.planner import activation_terms, model_shape

    m = model_shape(LLAMA)
    n = 2**17
    logits = n * n * 4
    saved = activation_terms(m, 2)["layer_saved"]
    rows = [
        ["chunked loss", f"the `[tokens, vocab]` logits: {logits / 2**30:.0f} GiB in float32 at {tokens(n)} tokens x "
         f"{tokens(n)} vocabulary", "`hf_ring.enable_chunked_loss(model)`; on by default in `RingTrainingArguments` "
         "(`chunked_loss: true`)"],
        ["activation checkpointing", f"every layer's activations except its input ({_kib(saved)} per token for "
         f"{LLAMA} in bf16, `hf_ring.planner.activation_terms`)", "`hf_ring.enable_activation_checkpointing(model)`; "
         "`gradient_checkpointing: true`"],
        ["offload", "the checkpointed layer inputs, to host memory",
         "`enable_activation_checkpointing(model, offload=True)`; `activation_offload: true`"],
        ["tiled MLP", "the MLP's `[tokens, intermediate]` tensors in the recompute",
         "`hf_ring.enable_tiled_mlp(model, 8192)`; `tiled_mlp: 8192`"],
        ["head groups", "the ring's float32 accumulators, K/V messages and dK/dV accumulators (and with tiled layers "
         "q, k, v and their gradients) for all heads at once: one group of `Hq / G` heads at a time, GQA groups "
         "whole, the same bytes sent", "`hf_ring.enable_head_groups(model, 8)`; `head_groups: 8`"],
        ["tiled layers", "every full-length temporary of a layer's recompute and backward but its input, the "
         "attention output and the gradients flowing in and out: norms (their float32 copies), projections, LoRA "
         "adapters' float32 input copies, RoPE, the MLP over tiles; the final norm over tiles",
         "`hf_ring.enable_tiled_layers(model, 8192)`; `tiled_layers: 8192`"],
        ["offload every other layer's input", "half the host memory of the offload: the inputs between are made "
         "again in backward (one more forward of half the layers)",
         "`enable_tiled_layers(model, 8192, offload_every=2)`; `offload_every: 2`"],
    ]  # fmt: skip
    return table(["tool", "what it removes", "how to turn it on"], rows)


def mlp_recompute() -> str:
    """The MLP's share of one layer's recompute: Llama-3.1-8B with LoRA at 128K tokens per rank, and the
    small model of ``benchmarks.bench_memory``."""
    from hf_ring.planner import PlanSettings, model_shape, plan

    from .bench_memory import SHAPE

    m = model_shape(LLAMA)
    t = 2**17
    cmd = f"hf-ring plan {LLAMA} --seq-len 1M --gpus 8 --cp 8 --sharding fsdp"
    plain = plan(m, PlanSettings(seq_len=8 * t, gpus=8, cp=8, sharding="fsdp"))
    off = plan(m, PlanSettings(seq_len=8 * t, gpus=8, cp=8, sharding="fsdp", offload=True))
    mlp = t * _mlp_part(m, 2, lora=True)
    small = model_shape(dict(model_type="llama", **SHAPE, vocab_size=256))
    sp = plan(small, PlanSettings(seq_len=8192, gpus=2, cp=2, mode="full", dtype="fp32"))
    s_mlp = sp.tokens_per_rank * _mlp_part(small, 4, lora=False)
    return (
        f"For {LLAMA} (intermediate {m.intermediate} = {m.intermediate / m.hidden:g} x hidden) with LoRA at "
        f"{tokens(t)} tokens per rank, the recompute of one layer holds "
        f"{gib(plain.rows['recompute working set (one layer)'])}, of which the MLP's four saved "
        f"`[T, {m.intermediate}]` tensors, its two gradients in flight and the float32 input copies of the three MLP "
        f"LoRA adapters make {gib(mlp, 0)}; with offload that is {mlp / off.activation_peak:.0%} of the activation "
        f"peak ({gib(off.activation_peak)}). In the small model measured below (MLP "
        f"{SHAPE['intermediate_size'] / SHAPE['hidden_size']:g} x hidden; N = 8192, P = 2, fp32) the MLP's part is "
        f"{s_mlp / sp.activation_peak:.0%} of the planned peak ({sp.activation_peak / 2**20:.2f} MiB). "
        f"(`{cmd}`, and `--offload`.)"
    )


def ring_overlap() -> str:
    """The overlap threshold for Llama-3.1-8B inside a node and across nodes."""
    from hf_ring.planner import PlanSettings, model_shape, plan

    m = model_shape(LLAMA)
    inside = plan(m, PlanSettings(seq_len=2**20, gpus=8, cp=8)).overlap
    across = plan(m, PlanSettings(seq_len=2**20, gpus=16, cp=16)).overlap
    return (
        f"For {LLAMA} (`Hq / Hkv` = {m.heads // m.kv_heads}) the ring hides its transfers from "
        f"{inside['forward_threshold']:,} tokens per rank on NVLink and {across['forward_threshold']:,} across nodes "
        f"in forward, {inside['backward_threshold']:,} and {across['backward_threshold']:,} in backward (`hf-ring plan "
        f"{LLAMA} --seq-len 1M --gpus 8`, and `--gpus 16`: its overlap line)."
    )


def lora_fp32() -> str:
    """The two planner findings: the LoRA adapters' float32 input copies, the MLP's working set."""
    from hf_ring.planner import LORA_TARGETS, PlanSettings, activation_terms, model_shape, plan

    m = model_shape(LLAMA)
    lora = (16, LORA_TARGETS)
    fp32 = activation_terms(m, 2, lora=lora)
    bf16 = activation_terms(m, 2, lora=lora, lora_fp32=False)
    copies = fp32["layer_saved"] - bf16["layer_saved"]
    ratio = lora_ratio()  # measured / planned
    p = plan(m, PlanSettings(seq_len=2**20, gpus=8, cp=8, sharding="fsdp", offload=True))
    largest = p.peak_phase
    phases = "; ".join(f"{k}: {gib(v)}" for k, v in sorted(p.phases.items(), key=lambda kv: -kv[1]))
    return (
        "- PEFT's default `autocast_adapter_dtype=True` keeps LoRA adapters in float32 on a bf16 model, and each "
        f"adapter then saves a float32 copy of its input: {_kib(copies)} per token per layer for {LLAMA} with all "
        f"seven projections adapted, on top of the layer's own {_kib(bf16['layer_saved'])} of bf16 activations, so the "
        f"recompute of one layer costs {_kib(fp32['layer_saved'])} instead of {_kib(bf16['layer_saved'])} per token. "
        f"Measured on the small model (`LoRA r16 bf16 ckpt+chunked` above): {abs(1 - ratio):.0%} "
        f"{'below' if ratio < 1 else 'above'} the planner. `--lora-bf16-adapters` plans without it (PEFT's "
        "`autocast_adapter_dtype=False`).\n"
        f"- Without tiling, the MLP part of one layer's recompute is the largest single working set: {LLAMA} at 1M "
        f"on 8 GPUs with LoRA and offload peaks in \"{largest}\" (phases: {phases})."
    )


def planner_host() -> str:
    """The host memory that offload takes (Llama-3.1-8B, 1M tokens on 8 GPUs)."""
    from hf_ring.planner import PlanSettings, model_shape, plan

    p = plan(model_shape(LLAMA), PlanSettings(seq_len=2**20, gpus=8, cp=8, sharding="fsdp", offload=True))
    host = sum(p.host.values())
    return (
        f"With offload, each GPU also holds `layers x tokens/GPU x hidden x 2` bytes of host memory ({LLAMA} at 1M on "
        f"8 GPUs: {gib(host, 0)} per GPU, {gib(8 * host, 0)} per node)."
    )


PUBLISHED = (  # (system, setup, link; what it reports) as published, and the planner's closest setup
    ("Hugging Face + FlashAttention-2, Llama-3.1-8B QLoRA, 1 x 80 GB ([Unsloth](https://unsloth.ai/blog/llama3-3))",
     "28K", None),
    ("Unsloth (offloaded checkpointing, cut cross-entropy), Llama-3.1-8B QLoRA, 1 x 80 GB "
     "([Unsloth](https://unsloth.ai/blog/llama3-3))", "342K", ("lora", 1)),
    ("EasyContext (ring attention, ZeRO-3 offload, checkpointing), Llama-2-7B full fine-tuning, 8 x A100 80 GB "
     "([README](https://github.com/jzhang38/EasyContext))", "700K", ("full", 8)),
    ("Arctic Long Sequence Training (Ulysses, tiled loss and MLP, offload), Llama-8B full fine-tuning, 8 x H100 "
     "([arXiv 2506.13996](https://arxiv.org/abs/2506.13996))", "3.7M", ("full", 8)),
    ("the same, 32 x H100 (4 nodes)", "15M", ("full", 32)),
)  # fmt: skip


def planner_published() -> str:
    """Published longest sequences next to the planner's for the closest setup (``max_seq_len``)."""
    from hf_ring.planner import PlanSettings, max_seq_len, model_shape

    m = model_shape(LLAMA)
    rows = []
    for system, published, setup in PUBLISHED:
        cell = "-"
        if setup:
            mode, g = setup
            n = max_seq_len(m, PlanSettings(seq_len=0, gpus=g, sharding="fsdp", mode=mode, offload=True,
                                            tiled_mlp=8192))  # fmt: skip
            what = "LoRA" if mode == "lora" else "full FT"
            size = f"{n / 2**20:.2f}M" if n >= 2**20 else f"{n // 1024}K"
            cell = f"{what} + offload + tiled MLP, {g} GPU{'s' if g > 1 else ''}: {size}"
        rows.append([system, published, cell])
    return table(["system, setup", "published", "hf_ring planner, closest setup"], rows)


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
