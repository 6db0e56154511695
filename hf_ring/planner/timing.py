"""How long one training step takes: FLOPs of the step, kernel rates per GPU kind, the ring's exposed time.

``step_time(model, settings, cp, ulysses, rates)`` prices one optimizer micro-step of one rank:

- **attention** per layer and rank, causal over ``N`` tokens split over ``P`` ranks (zigzag: every rank the same
  work): forward ``4 Hq d N^2 / 2 / P`` FLOPs (a windowed layer: ``4 Hq d (W N - W (W - 1) / 2) / P``), the
  backward 2.5 times the forward, and the forward once more under activation checkpointing; at the kernel's
  achieved rate (``Rates.attention``);
- **GEMMs** per token: every linear layer ``2 in out`` forward; backward ``2x`` that for full fine-tuning (dX
  and dW), ``1x`` with LoRA (dX only; the adapters' own small GEMMs ``3 x 2 r (in + out)``); recomputed
  forward under checkpointing (but a layer's last linear layer, which the recompute stops before); an MoE
  layer's active experts and router; the LM head (forward twice with the chunked loss, which recomputes it);
  the MLP's forward once more with a tiled MLP or tiled layers, and with tiled layers q, k, v's twice more and
  o_proj's once more (their tiles' backward re-runs them); ``(k - 1) / k`` of the layers' forward once more with
  ``offload_every = k`` (their inputs made again in backward); at ``Rates.gemm``;
- **memory-bound work** per token and layer (``elementwise_bytes``): the two RMSNorms (about five passes over the
  hidden state each), RoPE on q and k (five passes), the gated activation (five passes over the intermediate
  size), the residual adds; the backward twice the forward's traffic, the recompute once more; at
  ``Rates.memory`` bytes/s;
- **communication** nothing hides: ``grids.grid_cost``'s exposed ring hops and all-to-alls, at the ring's
  link bandwidth and the attention rate (the overlap it allows).

``tokens/s = B N / P / t`` per rank and MFU ``= model FLOPs / (t x peak)``, model FLOPs being the step's without
the recompute. Rates: ``rates_for(gpu, kernel)`` reads measured rows for that GPU kind and kernel from
``gpu_rates.json`` (written by ``python -m benchmarks.gpu_rates`` from ``scripts/gpu_check.sh``'s benchmark),
else defaults (``DEFAULT_ATTENTION``, ``DEFAULT_GEMM``: fractions of the bf16 peak from published kernel
benchmarks), and says which (``Rates.measured``). Imports neither torch nor transformers.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from .gpus import GPU_KINDS, GPUKind, gpu_kind
from .grids import grid_cost
from .models import ModelShape
from .settings import PlanSettings
from .terms import DTYPE_BYTES
from .vision import encoded_tokens

__all__ = ["DEFAULT_ATTENTION", "DEFAULT_GEMM", "Rates", "StepTime", "auto_kernel", "elementwise_bytes",
           "measured_rates", "rates_for", "step_flops", "step_time"]  # fmt: skip

RATES_FILE = Path(__file__).with_name("gpu_rates.json")


# achieved fraction of the bf16 peak, causal fwd+bwd attention at long sequences, head_dim 128 (FlashAttention-2/3
# papers, flash-attention's and cuDNN's published benchmarks); defaults until measured rows exist
DEFAULT_ATTENTION = {
    "sm_80": {"flash_attn": 0.55, "torch": 0.50, "cudnn": 0.45, "flash_attn_3": 0.45, "torch_efficient": 0.30},
    "sm_90": {"flash_attn_3": 0.55, "cudnn": 0.50, "flash_attn_4": 0.45, "flash_attn": 0.35, "torch": 0.33,
              "torch_efficient": 0.20},
    "sm_100": {"flash_attn_4": 0.55, "cudnn": 0.50, "flash_attn": 0.22, "torch": 0.20, "torch_efficient": 0.12},
}  # fmt: skip
DEFAULT_GEMM = {"sm_80": 0.75, "sm_90": 0.70, "sm_100": 0.70}  # large bf16 GEMMs (cuBLAS)
REFERENCE_FRACTION = 0.03  # hf_ring's plain-torch kernel: float32 matmuls of [rows, Sk] score tiles


def _generation(capability: tuple[int, int]) -> str:
    return "sm_80" if capability < (9, 0) else "sm_90" if capability[0] == 9 else "sm_100"


def auto_kernel(gpu: GPUKind, head_dim: int, window: bool = False, softcap: bool = False) -> str:
    """The kernel ``backend="auto"`` picks for a layer on ``gpu`` when flash-attn 2, 3, 4 and cuDNN are all
    installed (``hf_ring.ops.kernels.CANDIDATES``, restated without torch)."""
    gen = _generation(gpu.capability)
    plain = not (window or softcap)
    order = {"sm_80": ["flash_attn"], "sm_90": ["flash_attn_3", "cudnn", "flash_attn"],
             "sm_100": ["flash_attn_4", "cudnn", "flash_attn"]}[gen]  # fmt: skip
    takes = {"flash_attn_3": head_dim <= 256, "flash_attn_4": head_dim <= 128, "flash_attn": head_dim <= 256,
             "cudnn": head_dim <= 128 and plain}  # fmt: skip
    for name in order:
        if takes[name]:
            return name
    return "torch_efficient" if plain else "reference"


@dataclass(frozen=True)
class Rates:
    """Achieved rates of one GPU (or CPU process): attention fwd+bwd and GEMM FLOP/s, memory bytes/s, the
    peak MFU is taken against (FLOP/s), which kernel and whether the figures were measured."""

    attention: float
    gemm: float
    memory: float
    peak: float
    kernel: str = "auto"
    gpu: str = ""
    measured: bool = False
    source: str = "default"


def measured_rates(path: Path | str = RATES_FILE) -> dict[str, Any]:
    """The measured rates file: ``{gpu kind: {"attention": {kernel: TFLOP/s}, "gemm": TFLOP/s, "memory": GB/s,
    "date": ..., "source": ...}}`` (``{}`` when absent)."""
    p = Path(path)
    if not p.is_file():
        return {}
    data = json.loads(p.read_text() or "{}")
    return {k: v for k, v in data.items() if isinstance(v, dict)}


def rates_for(gpu: str, kernel: str, head_dim: int = 128, table: dict[str, Any] | None = None) -> Rates:
    """Rates of ``kernel`` (a backend name; ``"auto"``: ``auto_kernel``'s choice) on the GPU kind ``gpu``:
    measured ones from ``table`` (default: ``measured_rates()``) where present for that kind, else defaults."""
    kind = gpu_kind(gpu)
    name = auto_kernel(kind, head_dim) if kernel == "auto" else kernel
    gen, peak = _generation(kind.capability), kind.peak_tflops * 1e12
    row = (measured_rates() if table is None else table).get(next(k for k, v in GPU_KINDS.items() if v is kind), {})
    att = row.get("attention", {}).get(name)
    if att is not None and row.get("gemm") is not None:
        memory = float(row.get("memory", kind.hbm_GBps * 0.8)) * 1e9
        source = f"measured {row.get('date', '')} ({row.get('source', 'bench_gpu')})".replace(" ()", "")
        return Rates(float(att) * 1e12, float(row["gemm"]) * 1e12, memory, peak, name, kind.name, True, source)
    frac = REFERENCE_FRACTION if name == "reference" else DEFAULT_ATTENTION[gen].get(name, 0.2)
    return Rates(frac * peak, DEFAULT_GEMM[gen] * peak, kind.hbm_GBps * 0.8e9, peak, name, kind.name)


def _again(s: PlanSettings) -> float:
    """Forwards of a layer once more per step on average: ``(k - 1) / k`` with ``offload_every = k``."""
    return (s.offload_every - 1) / s.offload_every if s.offload and s.offload_every > 1 else 0.0


def _gemm_per_token(m: ModelShape, s: PlanSettings) -> tuple[float, float]:
    """``(executed, model)`` GEMM FLOPs per token of the whole step (every layer, the head). The recompute of a
    checkpointed layer stops after the last tensor its backward saved (torch's non-reentrant checkpoint stops
    early): it skips the layer's last linear layer, whose output nothing saves."""
    lora = s.mode == "lora"
    fwd = bwd = recompute = extra = 0.0
    for parts in m.layer_blocks:
        layer = last = 0.0
        for part in parts:
            if part == "mlp" and m.moe:
                down = 2 * m.active_experts * m.hidden * m.expert_intermediate
                f = 3 * down + 2 * m.hidden * m.experts
                layer, last, bwd = layer + f, down, bwd + f * (1 if lora else 2)
                continue
            shapes = m.mixer.linear_shapes(m.hidden) if part in ("gated_deltanet", "mamba2") and m.mixer else \
                m.part_shapes(part)  # fmt: skip
            for name, (fan_in, fan_out) in shapes.items():
                f = 2 * fan_in * fan_out
                a = 2 * s.lora_rank * (fan_in + fan_out) if lora and name in s.lora_targets else 0
                layer, last, bwd = layer + f + a, f, bwd + f * (1 if lora else 2) + 2 * a
                # the tiles' forward once more in backward (tiled MLP, tiled layers); tiled layers make the
                # group's q, k, v twice more (for the ring, for the tiles' backward) and o_proj's once more
                again = {"o_proj": 1, "q_proj": 2, "k_proj": 2, "v_proj": 2}.get(name, 0) if s.tiled_layers else 0
                if part == "mlp" and (s.tiled_mlp or s.tiled_layers):
                    again = 1
                extra += again * (f + a)
        fwd += layer
        recompute += layer - last
    head = 2 * m.hidden * m.vocab
    head_fwd = head * (2 if s.chunked_loss else 1)  # the chunked loss recomputes the logits in backward
    head_bwd = head * (1 if lora else 2)
    executed = fwd * (1 + _again(s)) + (recompute if s.checkpointing else 0.0) + bwd + head_fwd + head_bwd + extra
    return executed, fwd + bwd + head + head_bwd


def step_flops(m: ModelShape, s: PlanSettings, cp: int) -> dict[str, float]:
    """FLOPs of one micro-step on one rank of a CP group of ``cp``: ``attention`` and ``gemm`` as executed
    (recompute included), ``model`` without the recompute, ``tokens`` of the rank's shard."""
    n = -(-s.seq_len // (2 * cp)) * 2 * cp
    b = s.micro_batch
    attention_layers = sum("attention" in parts for parts in m.layer_blocks)
    full, windowed = attention_layers - m.windowed_layers, m.windowed_layers
    per_pair = 4 * m.heads * m.head_dim * b / cp  # FLOPs of one (query, key) pair over the rank's share
    w = min(m.window, n) if m.window else 0
    fwd = per_pair * (full * n * n / 2 + windowed * (w * n - w * (w - 1) / 2))
    # forwards per step: checkpointing recomputes every layer; offloading every k-th layer's input makes the
    # k - 1 between again from it in backward (one more forward of (k - 1) / k of the layers)
    passes = (2 if s.checkpointing else 1) + _again(s)
    gemm_exec, gemm_model = _gemm_per_token(m, s)
    tokens = b * n / cp
    return {
        "attention": fwd * (passes + 2.5),
        "attention_model": fwd * 3.5,
        "gemm": gemm_exec * tokens,
        "gemm_model": gemm_model * tokens,
        "model": fwd * 3.5 + gemm_model * tokens,
        "tokens": tokens,
    }


@dataclass(frozen=True)
class StepTime:
    """Seconds of one micro-step on one rank, by part; throughput and MFU; the rates used."""

    attention_s: float
    gemm_s: float
    memory_s: float
    exposed_comm_s: float
    tokens: float
    model_flops: float
    rates: Rates
    vision_s: float = 0.0  # a multimodal model's vision tower (its matrix products and attention within frames)

    @property
    def total_s(self) -> float:
        return self.attention_s + self.gemm_s + self.memory_s + self.exposed_comm_s + self.vision_s

    @property
    def tokens_per_s(self) -> float:
        """Tokens of the rank's shard per second (times the GPUs for the job's)."""
        return self.tokens / self.total_s

    @property
    def mfu(self) -> float:
        return self.model_flops / (self.total_s * self.rates.peak) if self.rates.peak else math.nan

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "total_s": self.total_s, "tokens_per_s": self.tokens_per_s, "mfu": self.mfu}


def elementwise_bytes(m: ModelShape, b: int) -> float:
    """Bytes the memory-bound operations of one decoder layer move per token in one forward (``b`` bytes per
    element): RMSNorm before attention and before the MLP (square, mean, rsqrt, two products: ~5 passes over the
    hidden state each), RoPE on q and k (two products, the rotated half, a sum: ~5 passes), the gated activation
    (SiLU and the product: ~5 passes over the intermediate size; an MoE layer's over its active experts'), the two
    residual adds (3 passes each)."""
    qk = (m.heads + m.kv_heads) * m.head_dim
    inter = m.active_experts * m.expert_intermediate if m.moe else m.intermediate
    return b * (10 * m.hidden + 5 * qk + 5 * inter + 6 * m.hidden)


def step_time(m: ModelShape, s: PlanSettings, cp: int, ulysses: int, rates: Rates) -> StepTime:
    """One micro-step of one rank (``step_flops`` at ``rates``; the exposed communication of the ring /
    Ulysses layout with the attention rate setting the overlap)."""
    f = step_flops(m, s, cp)
    attention_s, gemm_s = f["attention"] / rates.attention, f["gemm"] / rates.gemm
    passes = (2 if s.checkpointing else 1) + _again(s) + 2  # forwards, and the backward's twice the traffic
    memory_s = elementwise_bytes(m, DTYPE_BYTES[s.dtype]) * m.layers * f["tokens"] * passes / rates.memory
    exposed = 0.0
    attention_layers = sum("attention" in parts for parts in m.layer_blocks)
    if cp > 1 and attention_layers:
        cost = grid_cost(m, replace(s, flops=rates.attention), cp, ulysses)
        exposed = cost.exposed_s * (attention_layers - m.windowed_layers)
    vision_s = vision_model = 0.0
    if m.vision is not None and s.visual_fraction > 0:
        visual = s.visual_fraction * s.seq_len * s.micro_batch
        patches = m.vision.patches(encoded_tokens(visual, cp))
        vision_s = m.vision.flops(patches, s.train_vision, s.checkpointing) / rates.gemm
        vision_model = m.vision.flops(patches, s.train_vision, False)
    return StepTime(attention_s, gemm_s, memory_s, exposed, f["tokens"], f["model"] + vision_model, rates, vision_s)
