"""The settings of a long-context fine-tuning run that decide its memory: one keyword-only dataclass.

``PlanSettings`` holds every input of ``hf_ring.planner.plan`` besides the model's shape. Each
field's ``metadata`` documents it (``help``) and says how ``hf-ring plan`` takes it on the command
line (``flag``, ``parse``, ``unit``, ``choices``, ``metavar``, ``cli_default`` for a required field;
``least`` / ``above``: the bounds of a number, checked on the command line; ``cli=False``: not an
option), so the CLI derives its options from this one table (``hf_ring.cli``).

Imports neither torch nor transformers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .gpus import GPU_KINDS
from .models import LORA_TARGETS

__all__ = ["ATTENTION_BACKENDS", "PlanSettings", "format_tokens", "parse_ulysses_size", "tokens"]

# hf_ring.ops.kernels.BACKENDS, restated without torch (tests/test_startup.py holds the two equal)
ATTENTION_BACKENDS = ("auto", "torch", "flash_attn", "flash_attn_3", "flash_attn_4", "cudnn", "torch_efficient",
                      "reference")  # fmt: skip


def tokens(text: str) -> int:
    """A token count: ``131072``, ``128K`` (x1024), ``1M`` (x1024^2), ``1.5M``."""
    t = text.strip().upper()
    mult = {"K": 2**10, "M": 2**20, "G": 2**30}.get(t[-1:], 1)
    return int(float(t[:-1] if mult > 1 else t) * mult)


def format_tokens(n: int) -> str:
    """The inverse of ``tokens`` where exact: ``1024`` -> ``1K``, ``1048576`` -> ``1M``, ``1500`` -> ``1500``."""
    for unit, size in (("M", 2**20), ("K", 2**10)):
        if n >= size and n % size == 0:
            return f"{n // size}{unit}"
    return str(n)


def parse_ulysses_size(value: int | str) -> int | str:
    """``ulysses_size`` as given in a config or on a command line: a positive int, or ``"auto"``.

    ``2``, ``"2"`` -> ``2``; ``"auto"`` (any case) -> ``"auto"``; anything else raises ``ValueError``."""
    if isinstance(value, str):
        text = value.strip()
        if text.lower() == "auto":
            return "auto"
        if not text.isdigit():
            raise ValueError(f"ulysses_size must be a positive int or 'auto', not {value!r}")
        value = int(text)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"ulysses_size must be a positive int or 'auto', not {value!r}")
    return value


def _setting(default: Any, help: str, **cli: Any) -> Any:
    """A field with its documentation and command-line spelling in its metadata."""
    return field(default=default, metadata={"help": help, **cli})


def _required(help: str, parse: Callable[[str], Any] = int, **cli: Any) -> Any:
    return field(metadata={"help": help, "parse": parse, **cli})


@dataclass(frozen=True, kw_only=True)
class PlanSettings:
    """Everything a plan depends on besides the model: length, GPUs, parallelism, training mode,
    memory tools, and the hardware figures of the overlap check. ``seq_len`` and ``gpus`` are
    required; every other field has a default. ``dataclasses.replace(settings, cp=4)`` varies one."""

    seq_len: int = _required("tokens per sequence: 131072, 128K, 1M", parse=tokens, least=2)
    gpus: int = _required("number of GPUs (a recipe states its own)", cli_default=8, least=1)
    cp: int | None = _setting(None, "CP group size (default: the smallest divisor of gpus that fits)", parse=int,
                              least=1)  # fmt: skip
    gpu_gib: float = _setting(80.0, "GiB per GPU", flag="--gpu-mem", above=0)
    mode: str = _setting(
        "lora",
        "lora: frozen base weights, float32 adapters with AdamW; full: AdamW on every weight (for bf16, "
        "float32 master weights and moments in the optimizer: 2 + 2 + 12 bytes per parameter)",
        choices=("lora", "full"),
    )
    lora_rank: int = _setting(16, "LoRA rank", least=1)
    lora_targets: tuple[str, ...] = _setting(LORA_TARGETS, "linear layers with LoRA adapters", cli=False)
    lora_fp32: bool = _setting(
        True,
        "LoRA adapters in float32 on a 16-bit model (PEFT's default autocast_adapter_dtype=True): each saves a "
        "float32 copy of its input for backward",
        flag="--lora-bf16-adapters",
    )
    dtype: str = _setting("bf16", "dtype of weights and activations", choices=("bf16", "fp16", "fp32"))
    checkpointing: bool = _setting(True, "activation checkpointing of every decoder layer (off: every layer keeps "
                                   "its activations)")  # fmt: skip
    offload: bool = _setting(
        False,
        "checkpointed activations (everything the decoder saves for backward) in host memory "
        "(hf_ring.enable_activation_checkpointing(model, offload=True)); needs checkpointing",
    )
    sharding: str = _setting(
        "none",
        "zero1: optimizer state, zero2: + gradients, zero3/fsdp: + weights sharded over all GPUs (CP ranks hold "
        "the same weights, so they shard them too)",
        choices=("none", "zero1", "zero2", "zero3", "fsdp"),
    )
    chunked_loss: bool = _setting(True, "the chunked loss (hf_ring.enable_chunked_loss): no full logits")
    loss_chunk: int | None = _setting(None, "tokens per chunk of the chunked loss (default: from the vocabulary)",
                                      parse=int, least=1)  # fmt: skip
    micro_batch: int = _setting(1, "sequences per micro-batch", least=1)
    tiled_mlp: int | None = _setting(
        None, "hf_ring.enable_tiled_mlp(model, TOKENS): the MLP over tiles of TOKENS", parse=tokens, metavar="TOKENS",
        least=1,
    )
    tiled_layers: int | None = _setting(
        None,
        "hf_ring.enable_tiled_layers(model, TOKENS): each decoder layer's norms, projections, LoRA adapters and "
        "RoPE over tiles of TOKENS, its MLP too (Llama, Qwen2, Qwen3, Mistral layers; needs checkpointing)",
        parse=tokens, metavar="TOKENS", least=1,
    )
    head_groups: int = _setting(
        1,
        "hf_ring.enable_head_groups(model, G): attention heads in G groups inside the ring (G divides the K/V heads "
        "each rank attends with): q, k, v, the ring's buffers and their gradients for one group at a time",
        least=1, metavar="G",
    )
    offload_every: int = _setting(
        1,
        "with offload and tiled_layers: every K-th layer's input in host memory, the K - 1 between made again in "
        "backward from it (one more forward of those layers); 1: every layer's (hf_ring.enable_tiled_layers(model, "
        "TOKENS, offload_every=2))",
        choices=(1, 2), parse=int, metavar="K",
    )
    host_gib: float | None = _setting(
        None, "GiB of host memory per node the plan must fit in (offloaded activations); None: not checked",
        flag="--host-mem", parse=float, above=0, metavar="GIB",
    )
    reserve_gib: float = _setting(
        2.0, "GiB for CUDA context, NCCL buffers, allocator slack (a recipe: 0)", flag="--reserve", least=0
    )
    flops: float = _setting(400e12, "achieved attention FLOP/s per GPU (option: TFLOP/s)", flag="--tflops", unit=1e12,
                            above=0)  # fmt: skip
    intra_GBps: float = _setting(300.0, "GB/s per direction between ring neighbours in a node", flag="--link-gbs",
                                  above=0)  # fmt: skip
    inter_GBps: float = _setting(45.0, "GB/s per direction between ring neighbours across nodes", flag="--inter-gbs",
                                  above=0)  # fmt: skip
    gpus_per_node: int = _setting(8, "GPUs per node (a CP group larger than this crosses nodes)", least=1)
    mixer_kernels: str = _setting(
        "cuda",
        "kernels of a hybrid's linear token mixers: cuda (flash-linear-attention, mamba-ssm: chunked kernels that "
        "save their inputs and recompute in backward; estimated), torch (transformers' torch fallbacks, as on CPU; "
        "measured)",
        choices=("cuda", "torch"),
    )
    gpu: str = _setting(
        "H100",
        "GPU kind the step time is estimated for (peak bf16 FLOP/s, HBM bandwidth; kernel rates measured on it by "
        "scripts/gpu_check.sh, else defaults)",
        choices=tuple(GPU_KINDS),
    )
    attention_backend: str = _setting(
        "auto",
        "block kernel of ring attention the step time is estimated with (auto: the one backend='auto' picks on "
        "that GPU when flash-attn 2/3/4 and cuDNN are installed)",
        choices=ATTENTION_BACKENDS,
    )
    visual_fraction: float = _setting(
        0.0,
        "fraction of the sequence's tokens that are image or video tokens (a multimodal model's vision tower is "
        "priced when > 0; 0: text only, the tower neither loaded nor run)",
        least=0,
    )
    train_vision: bool = _setting(False, "train the vision tower's weights too (needs --mode full; default: frozen)")
    ulysses_size: int | str = _setting(
        1,
        "Ulysses degree inside the CP group (cp = ulysses_size x ring; 1: ring only); auto: "
        "hf_ring.planner.choose_ulysses_size, as RingTrainer resolves it",
        parse=parse_ulysses_size,
        metavar="U|auto",
    )
