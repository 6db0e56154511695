"""The planner's figures in the prose of docs/memory.md and docs/multimodal.md, computed by
``hf_ring.planner`` each time the documents are rendered (``benchmarks.report`` puts them in the marked
regions): what the tools remove, the MLP's share of one layer's recompute, the LoRA adapters' float32
copies, the ring's overlap threshold, the longest sequences next to published figures, the vision
tower's cost with and without spreading its frames over the CP group, and the long-video recipe's plan.
Each names the setup it prices.
"""

from __future__ import annotations

from typing import TYPE_CHECKING
from unittest import mock

from .report_measured import table, tokens

if TYPE_CHECKING:
    from hf_ring.planner import ModelShape

LLAMA = "Llama-3.1-8B"


def _kib(b: float) -> str:
    return f"{b / 1024:.0f} KiB"


def _gib(b: float, digits: int = 1) -> str:
    return f"{b / 2**30:.{digits}f} GiB"


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
    small model of ``benchmarks.memory``."""
    from hf_ring.planner import PlanSettings, model_shape, plan

    from .memory import SHAPE

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
        f"{_gib(plain.rows['recompute working set (one layer)'])}, of which the MLP's four saved "
        f"`[T, {m.intermediate}]` tensors, its two gradients in flight and the float32 input copies of the three MLP "
        f"LoRA adapters make {_gib(mlp, 0)}; with offload that is {mlp / off.activation_peak:.0%} of the activation "
        f"peak ({_gib(off.activation_peak)}). In the small model measured below (MLP "
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

    from .report_measured import lora_ratio

    m = model_shape(LLAMA)
    lora = (16, LORA_TARGETS)
    fp32 = activation_terms(m, 2, lora=lora)
    bf16 = activation_terms(m, 2, lora=lora, lora_fp32=False)
    copies = fp32["layer_saved"] - bf16["layer_saved"]
    ratio = lora_ratio()  # measured / planned
    p = plan(m, PlanSettings(seq_len=2**20, gpus=8, cp=8, sharding="fsdp", offload=True))
    largest = p.peak_phase
    phases = "; ".join(f"{k}: {_gib(v)}" for k, v in sorted(p.phases.items(), key=lambda kv: -kv[1]))
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
        f"8 GPUs: {_gib(host, 0)} per GPU, {_gib(8 * host, 0)} per node)."
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


# --------------------------------------------------------------------------------- docs/multimodal.md
VIDEO = "Qwen3.5-9B"
VIDEO_CMD = (f"hf-ring plan {VIDEO} --seq-len 256K --gpus 8 --cp 8 --sharding fsdp --offload --tiled-mlp 8K "
             "--visual-fraction 0.9")  # fmt: skip


def _every_rank(visual_tokens: float, cp: int) -> float:
    """``hf_ring.planner.vision.encoded_tokens`` as it was before the encoder was spread: every frame."""
    return visual_tokens


def vision_spread() -> str:
    """Qwen3.5-9B on 256K tokens of long video: the tower encoded on every rank or spread over the CP group."""
    from hf_ring.planner import PlanSettings, model_shape, plan

    m = model_shape(VIDEO)
    v = m.vision
    assert v is not None
    n, frac, cp = 2**18, 0.9, 8
    visual = frac * n
    base = dict(seq_len=n, gpus=8, cp=cp, sharding="fsdp", offload=True, tiled_mlp=8192, visual_fraction=frac)
    rows = []
    for what, kw in (("frozen (LoRA on the decoder)", {}), ("trained (full fine-tuning)",
                                                          dict(mode="full", train_vision=True))):
        for where in ("every rank", f"1/{cp} of the frames per rank"):
            s = PlanSettings(**base, **kw)
            if where == "every rank":  # the encoder before it was spread: each rank encodes every frame
                with mock.patch("hf_ring.planner.vision.encoded_tokens", _every_rank), \
                        mock.patch("hf_ring.planner.timing.encoded_tokens", _every_rank):
                    p = plan(m, s)
            else:
                p = plan(m, s)
            assert p.time is not None
            peak = f"{p.peak / 2**30:.2f}" + ("" if p.fits else " (does not fit)")
            rows.append([what, where, peak, f"{p.time.total_s:.2f}", f"{p.time.vision_s:.2f}"])
    features = visual * v.out_hidden * 2 * v.mergers
    intro = (
        f"**Why spread.** {VIDEO}'s encoder has {v.params / 1e9:.2f}B parameters and {v.patches_per_token} patches "
        f"per visual token. On {tokens(n)} tokens of which {frac:.0%} are video ({visual:,.0f} visual tokens, "
        f"{v.patches(visual):,.0f} patches), on 8 x 80 GB at CP = {cp} with FSDP, offload and 8K MLP tiles, the "
        "planner prices:"
    )
    outro = (
        f"Spread, the step's start holds one block's working set over a rank's eighth of the patches plus all the "
        f"visual features (`V x H x 2` bytes: {_gib(features)} for {visual:,.0f} tokens at H = {m.hidden} in "
        f"bf16) and the whole merged sequence before its cut ({_gib(n * m.hidden * 2)}); trained, the gathered "
        f"features' gradient comes back in backward. (Estimates from `{VIDEO_CMD}`, adding `--mode full "
        "--train-vision` for the trained rows; the \"every rank\" rows are the same plan with every rank encoding "
        "every frame, as before the encoder was spread. No GPU has run this yet.)"
    )
    head = ["vision tower", "encoded on", "peak per GPU (GiB)", "step (s)", "of which the tower (s)"]
    return intro + "\n\n" + table(head, rows) + "\n\n" + outro


VIDEO_RECIPE = "qwen3.5-9b-video-256k"


def vision_recipe_plan() -> str:
    """The planner's figures for the long-video recipe (what ``hf-ring plan RECIPE`` prints, condensed), and
    its peak with every rank encoding every frame."""
    from dataclasses import replace

    from hf_ring.planner import GiB, plan, smallest_cp
    from hf_ring.recipes.reader import recipe_model, recipe_path, recipe_settings

    recipe = recipe_path(VIDEO_RECIPE)
    m, s = recipe_model(recipe), recipe_settings(recipe)
    p = plan(m, s)
    with mock.patch("hf_ring.planner.vision.encoded_tokens", _every_rank), \
            mock.patch("hf_ring.planner.timing.encoded_tokens", _every_rank):
        whole = plan(m, s)
    best = smallest_cp(m, replace(s, cp=None))
    t = p.time
    assert t is not None
    g = GiB
    phases = ", ".join(f"{k.replace('layer backward, ', '')} {v / g:.2f}" + ("  <- peak" if k == p.peak_phase else "")
                       for k, v in p.phases.items())  # fmt: skip
    opts = (f"mode={s.mode}, dtype={s.dtype}, checkpointing={s.checkpointing}, offload={s.offload}, "
            f"sharding={s.sharding}, chunked_loss={s.chunked_loss}, tiled_mlp={s.tiled_mlp}")  # fmt: skip
    lines = [
        f"{m.name}: {p.seq_len:,} tokens on {p.gpus} GPUs, CP={p.cp} (DP={p.gpus // p.cp}), {p.tokens_per_rank:,} "
        f"tokens per rank; {opts}",
        f"  weights {p.rows['weights'] / g:.2f}, gradients {p.rows['gradients'] / g:.2f}, optimizer state "
        f"{p.rows['optimizer state'] / g:.2f} GiB",
        f"  activation peak, by phase: {phases}",
        f"  peak (model states + activation peak + reserve)     {p.peak / g:.2f} of {p.gpu_bytes / g:.2f}: "
        f"{'fits' if p.fits else 'does not fit'}; host {sum(p.host.values()) / g:.2f} GiB per rank (offloaded)",
        f"  step time per micro-batch (estimate): {t.total_s:.2f} s = attention {t.attention_s:.2f} + GEMMs "
        f"{t.gemm_s:.2f} + memory-bound {t.memory_s:.2f} + exposed communication {t.exposed_comm_s:.3f} + vision "
        f"tower {t.vision_s:.2f}; {t.tokens_per_s:,.0f} tokens/s per GPU, MFU {t.mfu:.0%} (estimate)",
        *(f"  {n}" for n in p.notes if n.startswith("vision tower")),
        f"  smallest CP size that fits: {best}",
    ]
    return (
        f"The planner's figures (`hf-ring plan {VIDEO_RECIPE}`; `--write` writes its `memory_gb`), condensed:\n\n"
        "```\n" + "\n".join(lines) + "\n```\n\n"
        f"With the encoder on every rank (before its frames were spread) the peak would be {whole.peak / g:.2f} GiB "
        f"per GPU, in the phase \"{whole.peak_phase}\". The recipe keeps CP = {p.cp} for the step time (the smallest "
        f"CP that fits is {best})."
    )
