"""Per-rank memory of long-context fine-tuning: a planner, and a live-tensor tracker to check it.

``plan(model, seq_len, gpus, ...)`` returns the memory of one rank of a context-parallel (CP)
group: model states (weights, gradients, optimizer state, after FSDP/ZeRO sharding), the
activations kept through the step (checkpointed layer inputs, possibly offloaded to host memory),
the working sets of the backward pass (the recompute of one layer, the ring's buffers, the chunked
loss), the smallest CP size that fits, and whether the ring's transfers hide behind attention
compute. ``hf-ring plan`` prints the same (``hf_ring.cli``).

The activation terms follow the tensors that transformers' Llama/Qwen/Mistral layers save for
backward (RMSNorm in float32, the ring attention Function, a gated MLP) and were checked with
``LiveTensorBytes`` on small models (``tests/test_memory.py``, ``benchmarks/memory.py``).
Everything is per token of the rank's shard (``T = micro_batch * seq_len / cp``) except the
chunked loss's per-chunk buffers and the model states.
"""

from __future__ import annotations

import json
import math
import os
import threading
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

GiB = 2**30

# --- model shapes -----------------------------------------------------------------------------

# Plain dicts of the published config.json fields that matter here (nothing is downloaded).
KNOWN_MODELS: dict[str, dict[str, Any]] = {
    "Llama-3.2-1B": dict(model_type="llama", hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=64, vocab_size=128256,
                         tie_word_embeddings=True),
    "Llama-3.2-3B": dict(model_type="llama", hidden_size=3072, intermediate_size=8192, num_hidden_layers=28,
                         num_attention_heads=24, num_key_value_heads=8, head_dim=128, vocab_size=128256,
                         tie_word_embeddings=True),
    "Llama-3.1-8B": dict(model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=128256,
                         tie_word_embeddings=False),
    "Llama-3.1-70B": dict(model_type="llama", hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                          num_attention_heads=64, num_key_value_heads=8, head_dim=128, vocab_size=128256,
                          tie_word_embeddings=False),
    "Qwen2.5-1.5B": dict(model_type="qwen2", hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                         num_attention_heads=12, num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "Qwen2.5-7B": dict(model_type="qwen2", hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                       num_attention_heads=28, num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False),
    "Qwen2.5-14B": dict(model_type="qwen2", hidden_size=5120, intermediate_size=13824, num_hidden_layers=48,
                        num_attention_heads=40, num_key_value_heads=8, vocab_size=152064, tie_word_embeddings=False),
    "Qwen3-8B": dict(model_type="qwen3", hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                     tie_word_embeddings=False),
    "Mistral-7B-v0.3": dict(model_type="mistral", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                            num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=32768,
                            tie_word_embeddings=False),
}  # fmt: skip

_ALIASES = {k.lower(): k for k in KNOWN_MODELS}
_ALIASES.update({f"meta-llama/{k}".lower(): k for k in KNOWN_MODELS if k.startswith("Llama")})
_ALIASES.update({f"meta-llama/meta-{k}".lower(): k for k in KNOWN_MODELS if k.startswith("Llama")})
_ALIASES.update({f"qwen/{k}".lower(): k for k in KNOWN_MODELS if k.startswith("Qwen")})
_ALIASES.update({f"mistralai/{k}".lower(): k for k in KNOWN_MODELS if k.startswith("Mistral")})

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a decoder-only transformer that decide its memory."""

    name: str = field(compare=False)
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm on each head's q and k
    qkv_bias: bool = False  # Qwen2

    @classmethod
    def from_config(cls, config: dict[str, Any], name: str = "model") -> ModelShape:
        c = dict(config)
        heads = c["num_attention_heads"]
        return cls(
            name=name,
            hidden=c["hidden_size"],
            intermediate=c["intermediate_size"],
            layers=c["num_hidden_layers"],
            heads=heads,
            kv_heads=c.get("num_key_value_heads") or heads,
            head_dim=c.get("head_dim") or c["hidden_size"] // heads,
            vocab=c["vocab_size"],
            tied=bool(c.get("tie_word_embeddings", False)),
            qk_norm=c.get("model_type") in ("qwen3", "qwen3_moe"),
            qkv_bias=bool(c.get("attention_bias", c.get("model_type") == "qwen2")),
        )

    # parameter counts
    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """``(in, out)`` of the linear layers of one decoder layer, by name."""
        h, q, kv, i = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim, self.intermediate
        return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
                "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}  # fmt: skip

    @property
    def layer_params(self) -> int:
        n = sum(a * b for a, b in self.linear_shapes().values()) + 2 * self.hidden
        if self.qkv_bias:
            n += (self.heads + 2 * self.kv_heads) * self.head_dim
        if self.qk_norm:
            n += 2 * self.head_dim
        return n

    @property
    def params(self) -> int:
        emb = self.vocab * self.hidden
        return self.layers * self.layer_params + emb * (1 if self.tied else 2) + self.hidden

    def lora_params(self, rank: int, targets: tuple[str, ...] = LORA_TARGETS) -> int:
        shapes = self.linear_shapes()
        return self.layers * rank * sum(a + b for t, (a, b) in shapes.items() if t in targets)


def _read_yaml(path: Path) -> dict[str, Any]:
    import yaml

    with open(path) as f:
        return yaml.safe_load(f)


RECIPES_DIR = Path(__file__).resolve().parent.parent / "recipes"


def _recipe_path(source: str) -> Path | None:
    p = Path(source)
    if p.suffix in (".yaml", ".yml") and p.exists():
        return p
    for cand in (RECIPES_DIR / source, RECIPES_DIR / f"{source}.yaml"):
        if cand.suffix in (".yaml", ".yml") and cand.exists():
            return cand
    return None


def _recipe_model(recipe: dict[str, Any], where: Path) -> ModelShape:
    """The model of a recipe: its inline config, a saved model's config.json, a known name, or, for
    ``init_from`` a run that does not exist yet, the model of the recipe that writes that run."""
    m = recipe["model"]
    if "config" in m:
        return ModelShape.from_config({**m["config"], **m.get("overrides", {})}, name=where.stem)
    ref = m.get("init_from") or m.get("name_or_path")
    cfg = Path(ref) / "config.json"
    if not cfg.is_absolute():
        cfg = Path.cwd() / cfg if (Path.cwd() / cfg).exists() else where.parent.parent / cfg
    if cfg.exists():
        return ModelShape.from_config(json.loads(cfg.read_text()), name=ref)
    for other in sorted(where.parent.glob("*.yaml")):
        r = _read_yaml(other)
        out = r.get("output_dir") if isinstance(r, dict) else None
        if out and other != where and str(Path(ref)).startswith(str(Path(out))):
            return _recipe_model(r, other)
    return model_shape(ref)


def model_shape(source: str | dict[str, Any] | ModelShape) -> ModelShape:
    """A ``ModelShape`` from a known name (``KNOWN_MODELS``, e.g. ``Llama-3.1-8B``), a local
    ``config.json`` (or a directory holding one), a recipe (path or name under ``recipes/``), or a
    config dict."""
    if isinstance(source, ModelShape):
        return source
    if isinstance(source, dict):
        return ModelShape.from_config(source)
    key = _ALIASES.get(str(source).lower())
    if key is not None:
        return ModelShape.from_config(KNOWN_MODELS[key], name=key)
    recipe = _recipe_path(str(source))
    if recipe is not None:
        return _recipe_model(_read_yaml(recipe), recipe)
    p = Path(source)
    if p.is_dir():
        p = p / "config.json"
    if p.name.endswith(".json") and p.exists():
        return ModelShape.from_config(json.loads(p.read_text()), name=str(source))
    raise ValueError(
        f"unknown model {source!r}: give a known name ({', '.join(KNOWN_MODELS)}), a config.json (or a "
        "directory with one), or a recipe"
    )


# --- the plan -----------------------------------------------------------------------------------

_DTYPE_BYTES = {"bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2, "fp32": 4, "float32": 4}


@dataclass
class Plan:
    """Memory of one rank (bytes). ``rows``: model states and activation components; ``phases``:
    the activation bytes live at each candidate peak of a step; ``peak``: the largest total."""

    model: ModelShape
    seq_len: int
    gpus: int
    cp: int
    tokens_per_rank: int
    settings: dict[str, Any]
    rows: dict[str, float]
    phases: dict[str, float]
    host: dict[str, float]
    overlap: dict[str, Any]
    gpu_bytes: float
    notes: list[str] = field(default_factory=list)

    @property
    def model_states(self) -> float:
        return self.rows["weights"] + self.rows["gradients"] + self.rows["optimizer state"]

    @property
    def activation_peak(self) -> float:
        return max(self.phases.values())

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=self.phases.get)  # type: ignore[arg-type]

    @property
    def peak(self) -> float:
        return self.model_states + self.activation_peak + self.rows["runtime reserve"]

    @property
    def fits(self) -> bool:
        return self.peak <= self.gpu_bytes

    def summary_gib(self) -> dict[str, float]:
        """The figures a recipe states (GiB): model states, activation peak, total."""
        return {
            "model_states": round(self.model_states / GiB, 3),
            "activations": round(self.activation_peak / GiB, 3),
            "total": round((self.model_states + self.activation_peak) / GiB, 3),
        }

    def table(self) -> str:
        lines = [
            f"{self.model.name}: {self.seq_len:,} tokens on {self.gpus} GPUs, CP={self.cp} "
            f"(DP={self.gpus // self.cp}), {self.tokens_per_rank:,} tokens per rank; "
            + ", ".join(f"{k}={v}" for k, v in self.settings.items()),
            f"{'per rank':<44}{'GiB':>10}",
        ]
        for k, v in self.rows.items():
            lines.append(f"  {k:<42}{v / GiB:>10.2f}")
        lines.append("  activation peak, by phase of the step:")
        for k, v in self.phases.items():
            mark = "  <- peak" if k == self.peak_phase else ""
            lines.append(f"    {k:<40}{v / GiB:>10.2f}{mark}")
        lines.append(f"  {'peak (model states + activation peak + reserve)':<42}{self.peak / GiB:>10.2f}")
        lines.append(f"  {'fits in':<42}{self.gpu_bytes / GiB:>10.2f}  {'yes' if self.fits else 'NO'}")
        if any(self.host.values()):
            lines.append(f"  host memory per rank (offloaded): {sum(self.host.values()) / GiB:.2f} GiB")
        o = self.overlap
        lines.append(
            f"  ring overlap: {self.tokens_per_rank:,} tokens per rank vs threshold {o['threshold_tokens']:,} "
            f"(forward {o['forward_threshold']:,}, backward {o['backward_threshold']:,}; "
            f"{o['link']} {o['link_GBps']:g} GB/s, {o['flops'] / 1e12:g} TFLOP/s, GQA {self.model.heads}/"
            f"{self.model.kv_heads}): {'hidden' if o['hidden'] else 'NOT hidden'}"
        )
        lines.extend(f"  note: {n}" for n in self.notes)
        return "\n".join(lines)


def activation_terms(
    m: ModelShape,
    b: int,
    tiled_mlp: bool = False,
    lora: tuple[int, tuple[str, ...]] | None = None,
    lora_fp32: bool = True,
) -> dict[str, float]:
    """Bytes per token of the rank's shard saved for backward, by part (``b``: activation dtype bytes).

    RMSNorm (transformers): upcasts its input to float32 (the input itself when it is float32),
    saves that, ``rsqrt`` (4 B) and, when its weight is trained, the normalised value in the model
    dtype; its output is saved by the next linear layer. Attention: RoPE saves only ``cos``/``sin``;
    the ring Function saves q, k, v, its output and a float32 log-sum-exp. MLP: gate, silu(gate), up
    and their product. LoRA (``lora = (rank, targets)``, frozen base weights and norms): the
    normalised values are not saved, each adapter saves its ``rank``-wide intermediate, and the
    MLP's product is saved only if ``down_proj`` has an adapter. With float32 adapters on a 16-bit
    model (``lora_fp32``: PEFT's default ``autocast_adapter_dtype=True``) every adapter also saves a
    float32 copy of its input.
    """
    h, i, d = m.hidden, m.intermediate, m.head_dim
    f32 = b == 4
    normed = 0 if lora else b * h  # saved for the norm weight's gradient
    norm_io = 4 * h + b * h + normed + 4  # a norm whose input nothing else saves
    norm1 = (0 if f32 else 4 * h) + b * h + normed + 4  # input = the layer input (kept anyway in float32)
    attn = b * (2 * m.heads * d + 2 * m.kv_heads * d) + 4 * m.heads
    if m.qk_norm:
        attn += (4 + b) * (m.heads + m.kv_heads) * d + 4 * (m.heads + m.kv_heads)
    mlp = 4 * i * b
    adapters = {"attn": 0, "mlp": 0}
    if lora:
        rank, targets = lora
        for t, (fan_in, _) in m.linear_shapes().items():
            if t in targets:
                part = "mlp" if t in ("gate_proj", "up_proj", "down_proj") else "attn"
                adapters[part] += 4 * (fan_in + rank) if lora_fp32 and not f32 else rank * b
        if "down_proj" not in targets:
            mlp -= i * b
    mlp_total = mlp + adapters["mlp"]  # per token of the MLP, saved for its backward
    return {
        "layer_input": h * b,
        # all a layer saves besides its input (tiled MLP: only its input, the norm's output)
        "layer_saved": norm1 + attn + adapters["attn"] + norm_io + (0 if tiled_mlp else mlp_total),
        "layer_saved_attn": norm1 + attn + adapters["attn"],
        "mlp_saved": mlp_total,
        "rope": 2 * d * b,
        "final_norm": norm_io,
        # backward transients of the MLP phase: dL/d(gate), dL/d(up) in flight, and dL/dx
        # (tiled: the MLP's dL/dx accumulator instead; the tile's own tensors are counted apart)
        "mlp_backward": (h * b if tiled_mlp else 2 * i * b) + h * b + 24,
    }


def ring_buffer_bytes(m: ModelShape, b: int, cp: int) -> float:
    """Per-token bytes of the ring's working set in attention backward (``hf_ring.ring``), beyond the
    tensors the layer saves (``b``: bytes per element of the model's dtype)."""
    q, kv = m.heads * m.head_dim, m.kv_heads * m.head_dim
    kernel_grads = b * (q + 2 * kv)  # one kernel call's dq, dk, dv
    if cp == 1:  # one kernel call over the whole shard
        return kernel_grads
    return (
        4 * q  # dQ accumulator (fp32)
        + 2 * 2 * kv * b  # the K/V message and its receive buffer
        + 2 * 2 * kv * 4  # the dK/dV accumulator travelling the ring (fp32) and its receive buffer
        + kernel_grads  # of the block in flight (each step's are freed before the next kernel call)
        + b * q  # dOut made contiguous
    )


def plan(
    model: str | dict[str, Any] | ModelShape,
    seq_len: int,
    gpus: int,
    *,
    cp: int | None = None,
    gpu_gib: float = 80.0,
    mode: str = "lora",
    lora_rank: int = 16,
    lora_targets: tuple[str, ...] = LORA_TARGETS,
    lora_fp32: bool = True,
    dtype: str = "bf16",
    checkpointing: bool = True,
    offload: bool = False,
    sharding: str = "none",
    chunked_loss: bool = True,
    loss_chunk: int | None = None,
    micro_batch: int = 1,
    tiled_mlp: int | None = None,
    reserve_gib: float = 2.0,
    flops: float = 400e12,
    intra_GBps: float = 300.0,
    inter_GBps: float = 45.0,
    gpus_per_node: int = 8,
) -> Plan:
    """Per-rank memory of fine-tuning ``model`` on ``seq_len``-token sequences on ``gpus`` GPUs.

    Args:
        cp: CP group size (default: the smallest divisor of ``gpus`` that fits, see ``smallest_cp``).
        mode: ``"lora"`` (frozen base weights, fp32 adapters with AdamW) or ``"full"`` (AdamW; for
            bf16, fp32 master weights and moments in the optimizer: 2 + 2 + 12 bytes per parameter).
        lora_fp32: the adapters are float32 on a 16-bit model (PEFT's ``autocast_adapter_dtype=True``,
            its default), so each saves a float32 copy of its input for backward.
        sharding: ``"none"``, ``"zero1"`` (optimizer state), ``"zero2"`` (+ gradients),
            ``"zero3"``/``"fsdp"`` (+ weights) over all ``gpus`` ranks (CP ranks hold the same
            weights, so they shard them too).
        offload: checkpointed activations (everything the decoder saves for backward) live in host
            memory (``hf_ring.enable_activation_checkpointing(model, offload=True)``).
        chunked_loss: ``hf_ring.enable_chunked_loss`` (no full logits); ``loss_chunk`` tokens per chunk.
        tiled_mlp: ``hf_ring.enable_tiled_mlp(model, tiled_mlp)``: the MLP over tiles of this many tokens.
        reserve_gib: CUDA context, NCCL buffers and allocator slack.
        flops, intra_GBps, inter_GBps: achieved attention FLOP/s and per-direction link bandwidth
            between ring neighbours inside a node and across nodes, for the overlap condition.
    """
    from .ops.cross_entropy import default_chunk_size

    m = model_shape(model)
    if cp is None:
        cp = smallest_cp(m, seq_len, gpus, gpu_gib=gpu_gib, mode=mode, lora_rank=lora_rank, lora_targets=lora_targets,
                         lora_fp32=lora_fp32,
                         dtype=dtype, checkpointing=checkpointing, offload=offload, sharding=sharding,
                         chunked_loss=chunked_loss, loss_chunk=loss_chunk, micro_batch=micro_batch,
                         tiled_mlp=tiled_mlp, reserve_gib=reserve_gib) or gpus  # fmt: skip
    if gpus % cp:
        raise ValueError(f"cp={cp} must divide the number of GPUs ({gpus})")
    levels = {"none": 0, "zero1": 1, "zero2": 2, "zero3": 3, "fsdp": 3}
    if sharding not in levels:
        raise ValueError(f"sharding must be none, zero1, zero2, zero3 or fsdp, not {sharding!r}")
    level = levels[sharding]
    if mode not in ("lora", "full"):
        raise ValueError(f"mode must be 'lora' or 'full', not {mode!r}")
    b = _DTYPE_BYTES[dtype]
    f32 = b == 4
    t = micro_batch * -(-seq_len // (2 * cp)) * 2  # tokens per rank after padding to a multiple of 2P
    shard_opt, shard_grad, shard_w = (gpus if level >= k else 1 for k in (1, 2, 3))
    notes: list[str] = []

    # model states
    n_all = m.params
    if mode == "full":
        weights = n_all * b / shard_w
        grads = n_all * b / shard_grad
        optim = n_all * (12 if not f32 else 8) / shard_opt
        head_trainable = True
    else:
        n_lora = m.lora_params(lora_rank, lora_targets)
        weights = n_all * b / shard_w + n_lora * 4
        grads = n_lora * 4
        optim = n_lora * 8
        head_trainable = False
    if level == 3:
        # gathered while in use: two decoder layers, and the root unit (embedding, head)
        weights += 2 * m.layer_params * b + (1 if m.tied else 2) * m.vocab * m.hidden * b
    rows: dict[str, float] = {"weights": weights, "gradients": grads, "optimizer state": optim}

    # activations kept through the step
    tile = min(tiled_mlp, t) if tiled_mlp else 0
    lora = (lora_rank, tuple(lora_targets)) if mode == "lora" else None
    a = activation_terms(m, b, tiled_mlp=bool(tile), lora=lora, lora_fp32=lora_fp32)
    per_layer_kept = a["layer_input"] if checkpointing else (a["layer_input"] if f32 else 0) + a["layer_saved"]
    decoder_kept = t * (m.layers * per_layer_kept + a["rope"] + a["final_norm"])
    vocab_row = m.vocab  # the loss's per-token bytes are per vocabulary entry
    if chunked_loss:
        chunk = min(t, loss_chunk or default_chunk_size(m.vocab))
        loss_kept = t * (m.hidden * b + 20)  # rows with a target, their targets, index, float32 LSE
        loss_bwd = t * 2 * m.hidden * b + chunk * vocab_row * (4 + (0 if f32 else b))
        if head_trainable:
            loss_bwd += m.vocab * m.hidden * 4  # float32 sum of the head's gradient over the chunks
    else:
        loss_kept = t * vocab_row * (b + 4)  # returned logits, float32 log-softmax
        loss_bwd = t * vocab_row * 8  # float32 gradients of the log-softmax and of the logits
    if offload and not checkpointing:
        raise ValueError("offload moves checkpointed activations to host memory: it needs checkpointing=True")
    # offloaded: the layer inputs and the final norm's tensors (RoPE's cos/sin stay, held by the layers' calls)
    offloaded = t * (m.layers * per_layer_kept + a["final_norm"]) if offload else 0.0
    host = {"checkpointed activations": offloaded}
    kept = decoder_kept - offloaded + loss_kept
    rows["checkpointed activations" if checkpointing else "saved activations"] = decoder_kept - offloaded
    rows["loss (kept for backward)"] = loss_kept

    # working sets, each at its own time in the backward pass
    unpacked = t * a["layer_input"] if offload else 0.0  # the input of the layer being recomputed, back
    ring = ring_buffer_bytes(m, b, cp)
    dx = t * m.hidden * b
    # decoder state once the loss's backward is done (and the full logits, which the output holds)
    base = t * a["rope"] + (unpacked if offload else t * m.layers * per_layer_kept)
    if not chunked_loss:
        base += t * vocab_row * b
    # one MLP tile recomputed in backward: what it saves, two gradients; the tile's weight gradients
    # and their float32 sums
    tile_ws = tile * (a["mlp_saved"] + 2 * m.intermediate * b)
    if tile and mode == "full":
        tile_ws += 3 * m.hidden * m.intermediate * (4 + b)
    if checkpointing:
        mlp_ws = t * (a["layer_saved"] + a["mlp_backward"]) + dx + tile_ws
        attn_ws = t * (a["layer_saved_attn"] + ring) + dx
    else:
        mlp_ws = t * a["mlp_backward"] + dx + tile_ws
        attn_ws = t * ring + dx
    rows["recompute working set (one layer)" if checkpointing else "backward working set (one layer)"] = mlp_ws
    rows["ring buffers (attention backward)"] = t * ring
    rows["loss working set (backward)"] = loss_bwd
    rows["runtime reserve"] = reserve_gib * GiB
    phases = {
        "loss backward": kept + loss_bwd,
        "layer backward, MLP": base + mlp_ws,
        "layer backward, attention + ring": base + attn_ws,
    }

    # ring overlap: per hop, 2 T^2 Hq d FLOPs forward (half a block, zigzag) vs K/V of T tokens
    link, bw = ("NVLink", intra_GBps) if cp <= gpus_per_node else ("inter-node", inter_GBps)
    gqa = m.kv_heads / m.heads
    fwd_thr = flops / (bw * 1e9) * b * gqa  # T >= F * b * Hkv / (BW * Hq)
    bwd_thr = flops / (bw * 1e9) * (b + 4) / 2.5 * gqa  # 2.5x compute; K/V plus fp32 dK/dV travel
    thr = math.ceil(max(fwd_thr, bwd_thr))
    tpr = t // micro_batch
    overlap = {
        "threshold_tokens": thr,
        "forward_threshold": math.ceil(fwd_thr),
        "backward_threshold": math.ceil(bwd_thr),
        "hidden": cp == 1 or tpr >= thr,
        "link": link if cp > 1 else "none",
        "link_GBps": bw,
        "flops": flops,
    }
    if mode == "lora" and level in (1, 2):
        notes.append("ZeRO-1/2 shard only trainable state; with LoRA that is the adapters")
    settings = {
        "mode": mode, "dtype": dtype, "checkpointing": checkpointing, "offload": offload,
        "sharding": sharding, "chunked_loss": chunked_loss, "tiled_mlp": tiled_mlp,
    }  # fmt: skip
    return Plan(m, seq_len, gpus, cp, t, settings, rows, phases, host, overlap, gpu_gib * GiB, notes)


def smallest_cp(model: str | dict[str, Any] | ModelShape, seq_len: int, gpus: int, **kwargs: Any) -> int | None:
    """The smallest CP size (a divisor of ``gpus``) whose plan fits; ``None`` if none does."""
    for cp in range(1, gpus + 1):
        if gpus % cp == 0 and plan(model, seq_len, gpus, cp=cp, **kwargs).fits:
            return cp
    return None


def max_seq_len(model: str | dict[str, Any] | ModelShape, gpus: int, *, cp: int | None = None, **kwargs: Any) -> int:
    """The longest sequence (a multiple of 1024 tokens) whose plan fits on ``gpus`` GPUs with CP size
    ``cp`` (default: all GPUs in one CP group); 0 if not even 1024 tokens fit."""
    cp = cp or gpus
    lo, hi = 0, 1024
    while plan(model, hi * 1024, gpus, cp=cp, **kwargs).fits:
        lo, hi = hi, hi * 2
        if hi > 2**20:
            break
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if plan(model, mid * 1024, gpus, cp=cp, **kwargs).fits else (lo, mid)
    return lo * 1024


def recipe_plan(path: str | os.PathLike, **kwargs: Any) -> Plan:
    """The plan of a recipe YAML: its model, longest stage, ``cp_size``, ``batch_size``, dtype, LoRA or
    full fine-tuning, checkpointing and offload settings. The number of GPUs and the sharding come
    from the launch configuration, which the recipe states in ``memory_gb: {gpus, sharding}``
    (default: ``cp_size`` GPUs, no sharding); ``kwargs`` override anything."""
    p = Path(path)
    r = _read_yaml(p)
    lora = r.get("lora")
    cp = int(r.get("cp_size", 1))
    stated = r.get("memory_gb") or {}
    settings: dict[str, Any] = dict(
        cp=cp,
        mode="lora" if lora else "full",
        lora_rank=(lora or {}).get("r", 16),
        lora_targets=tuple((lora or {}).get("target_modules", LORA_TARGETS)),
        dtype=r["model"].get("dtype", "float32"),
        checkpointing=bool(r.get("gradient_checkpointing", False)),
        offload=bool(r.get("activation_offload", False)),
        chunked_loss=bool(r.get("chunked_loss", True)),
        micro_batch=int(r.get("batch_size", 1)),
        tiled_mlp=r.get("tiled_mlp"),
        sharding=stated.get("sharding", "none"),
        gpu_gib=float(stated.get("gpu", 80)),
        reserve_gib=0.0,
    )
    gpus = int(kwargs.pop("gpus", stated.get("gpus", cp)))
    settings.update(kwargs)
    seq_len = max(s["seq_len"] for s in r["stages"])
    return plan(_recipe_model(r, p), seq_len, gpus, **settings)


def recipe_memory(path: str | os.PathLike) -> dict[str, Any]:
    """What a recipe's ``memory_gb`` states: the launch inputs it already names (``gpus``,
    ``sharding``, ``gpu``) and the planner's per-GPU figures in GiB (``model_states``,
    ``activations``, ``total`` = the two; ``host`` when activations are offloaded)."""
    r = _read_yaml(Path(path))
    stated = r.get("memory_gb") or {}
    p = recipe_plan(path)
    out: dict[str, Any] = {k: stated[k] for k in ("gpus", "sharding", "gpu") if k in stated}
    out.update(p.summary_gib())
    if any(p.host.values()):
        out["host"] = round(sum(p.host.values()) / GiB, 3)
    return out


def write_recipe_memory(path: str | os.PathLike) -> str:
    """Rewrite the ``memory_gb:`` line of a recipe with ``recipe_memory`` (one flow-style line,
    comments elsewhere kept); returns the new line."""
    p = Path(path)
    values = recipe_memory(p)
    line = "memory_gb: {" + ", ".join(f"{k}: {v}" for k, v in values.items()) + "}"
    lines = p.read_text().splitlines(keepends=True)
    comment = "  # per GPU, GiB: hf-ring plan " + p.name + "\n"
    for i, old in enumerate(lines):
        if old.startswith("memory_gb:"):
            if old.split("#")[0].rstrip().endswith(":"):
                raise ValueError(f"{p}: write memory_gb on one line (memory_gb: {{...}}) to have it rewritten")
            lines[i] = line + comment
            break
    else:
        lines.append(line + comment)
    p.write_text("".join(lines))
    return line


# --- measuring: live tensor bytes -------------------------------------------------------------------

try:
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves
except ImportError:  # pragma: no cover - the planner works without torch
    TorchDispatchMode = object  # type: ignore[assignment,misc]


_HOST = threading.local()


def host_allocations() -> Any:
    """Context manager: storages created inside count as host memory for ``LiveTensorBytes``
    (used by the activation offload on machines whose "device" is the CPU itself)."""
    from contextlib import contextmanager

    @contextmanager
    def cm() -> Any:
        depth = getattr(_HOST, "depth", 0)
        _HOST.depth = depth + 1
        try:
            yield
        finally:
            _HOST.depth = depth

    return cm()


class LiveTensorBytes(TorchDispatchMode):  # type: ignore[misc,valid-type]
    """Allocator-style accounting on any device, CPU included: inside ``with LiveTensorBytes() as m``,
    every tensor storage that an operation creates is counted from its creation until it is freed;
    ``m.peak`` is the largest total seen, ``m.live`` the current one (bytes). Storages created under
    ``host_allocations()`` (offloaded activations) count in ``m.host_live``/``m.host_peak`` instead.

    Tensors that existed before the block (parameters, the batch) are not counted, nor views or
    in-place results of them; gradients and optimizer state created inside it are. Views share
    their storage and count once. Operations the autograd engine runs in backward are seen too.
    """

    active = 0

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = self.host_live = self.host_peak = 0
        self._sizes: dict[int, tuple[int, bool]] = {}
        self._lock = threading.Lock()

    def __enter__(self) -> LiveTensorBytes:
        LiveTensorBytes.active += 1
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        LiveTensorBytes.active -= 1
        return super().__exit__(*exc)

    def reset_peak(self) -> None:
        self.peak, self.host_peak = self.live, self.host_live

    def _free(self, key: int) -> None:
        with self._lock:
            n, host = self._sizes.pop(key)
            if host:
                self.host_live -= n
            else:
                self.live -= n

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        # outputs that alias an input made outside (views, in-place ops): not new memory
        inputs = {id(x.untyped_storage()) for x in tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)}
        host = getattr(_HOST, "depth", 0) > 0
        for x in tree_leaves(out):
            if not isinstance(x, torch.Tensor) or x.device.type == "meta":
                continue
            s = x.untyped_storage()
            key, n = id(s), s.nbytes()
            with self._lock:
                old = self._sizes.get(key)
                if old is None:
                    if key in inputs:
                        continue
                    self._sizes[key] = (n, host)
                    weakref.finalize(s, self._free, key)
                    old_n, host_k = 0, host
                else:
                    old_n, host_k = old
                    self._sizes[key] = (n, host_k)
                if host_k:
                    self.host_live += n - old_n
                    self.host_peak = max(self.host_peak, self.host_live)
                else:
                    self.live += n - old_n
                    self.peak = max(self.peak, self.live)
        return out
