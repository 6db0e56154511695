"""``RingTrainingArguments``: ``TrainingArguments`` plus context parallelism and the model-side
options of long sequences, and ``apply_model_options``, which puts those options on a model.
``hf_ring.trainer`` re-exports both."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from torch import nn
from transformers import TrainingArguments

from ..errors import UserError
from ..ledger import LEDGER
from ..ops.kernels import check_backend
from ..planner.settings import parse_ulysses_size
from ..transformers.layers import enable_head_groups, enable_tiled_layers
from ..transformers.patches import enable_activation_checkpointing, enable_chunked_loss, enable_tiled_mlp
from .mesh import parallelism_sizes

__all__ = ["NUMBERS", "RingTrainingArguments", "apply_model_options", "check_numbers"]


@dataclass
class RingTrainingArguments(TrainingArguments):
    """``TrainingArguments`` plus context parallelism and the model-side options of long sequences
    (all accepted by ``HfArgumentParser``: ``--cp_size 4 --tiled_mlp 8192``)."""

    cp_size: int = field(
        default=1,
        metadata={
            "help": "Context-parallel group size: each sequence is split over this many processes "
            '(needs attn_implementation="ring" when > 1). The world size must be a multiple of it; '
            "world_size / cp_size is the number of data-parallel replicas."
        },
    )
    # int or "auto" once constructed; typed str because HfArgumentParser parses ``int | str`` as int
    ulysses_size: str = field(
        default="1",
        metadata={
            "help": "Ulysses degree inside each CP group: cp_size = ulysses_size x ring. ulysses_size "
            "consecutive processes trade sequence for attention heads with an all-to-all (it must divide "
            "cp_size and the model's query heads); 1: ring attention only; cp_size: Ulysses only; auto: "
            "chosen by RingTrainer from the model's head counts, the GPUs per node and cp_size "
            "(hf_ring.planner.choose_ulysses_size)."
        },
    )
    attention_backend: str = field(
        default="auto",
        metadata={
            "help": "Block kernel of ring attention (hf_ring.set_attention_backend): auto (the fastest one that runs "
            "each layer on this GPU: flash-attn 3 or cuDNN on H100/H200, flash-attn 4 or cuDNN on B200, flash-attn 2 "
            "or torch's flash op on A100), or one of cudnn, flash_attn_3, flash_attn_4, flash_attn, torch, "
            "torch_efficient, reference."
        },
    )
    chunked_loss: bool = field(
        default=True,
        metadata={
            "help": "Compute the training loss from the last hidden states in chunks, never holding "
            "[tokens, vocab] logits (hf_ring.enable_chunked_loss). Predictions still get full logits."
        },
    )
    tiled_mlp: int | None = field(
        default=None,
        metadata={"help": "Run every gated MLP over tiles of this many tokens (hf_ring.enable_tiled_mlp); None: off."},
    )
    tiled_layers: int | None = field(
        default=None,
        metadata={
            "help": "Run every decoder layer's norms, projections, LoRA adapters, RoPE and MLP over tiles of this many "
            "tokens, attention one head group at a time (hf_ring.enable_tiled_layers; Llama, Qwen2, Qwen3, Mistral "
            "layers); None: off."
        },
    )
    head_groups: int = field(
        default=1,
        metadata={
            "help": "Attention heads in this many groups inside the ring, one group at a time: q, k, v, the ring's "
            "buffers and their gradients for one group (hf_ring.enable_head_groups; it must divide the K/V heads "
            "each rank attends with). 1: off."
        },
    )
    offload_every: int = field(
        default=1,
        metadata={
            "help": "With activation_offload and tiled_layers: only every K-th layer's input goes to host memory, "
            "the layers between make theirs again in backward from it (half the host memory for K = 2, for one "
            "more forward of half the layers). 1: every layer's input."
        },
    )
    activation_offload: bool = field(
        default=False,
        metadata={
            "help": "Keep the activations that checkpointed layers save in host memory "
            "(hf_ring.enable_activation_checkpointing(offload=True)); needs activation_checkpointing."
        },
    )

    overwrite_output_dir: bool = field(
        default=False,
        metadata={
            "help": "hf-ring train: start over in an output_dir that holds an earlier run (its checkpoints are "
            "removed first, its other files replaced as this run writes its own). Without it, such an output_dir "
            "is resumed from its newest checkpoint, or refused when it has none. RingTrainer itself ignores it."
        },
    )
    save_merged_model: bool = field(
        default=False,
        metadata={
            "help": "With LoRA, also write the final model with the adapter merged into the base weights "
            "to output_dir/final/merged (loads with from_pretrained, without peft)."
        },
    )
    checkpoint_checksums: bool = field(
        default=False,
        metadata={
            "help": "Record the SHA-256 of every checkpoint file in its manifest (hf_ring_checkpoint.json) and "
            "check them on resume: catches files changed after the save with their size intact. Each rank hashes "
            "its share; costs one read of the checkpoint at each save and at resume. Sizes are always checked."
        },
    )

    def _resolve_checkpointing_alias(self) -> None:
        """TRL's configs (``DPOConfig``, ``GRPOConfig``, ``SFTConfig``) default ``gradient_checkpointing`` to
        ``True``, which transformers >= 5.25 calls a deprecated alias of ``activation_checkpointing`` and resolves
        with a ``FutureWarning`` on every run. Where transformers has the new field and the old one holds its class
        default, move that value to the new field first: the same resolution, without the warning. A value a user
        set differently still reaches transformers (and its warning)."""
        fields = {f.name: f for f in dataclasses.fields(self)}
        for old, new in (("gradient_checkpointing", "activation_checkpointing"),
                         ("gradient_checkpointing_kwargs", "activation_checkpointing_kwargs")):  # fmt: skip
            if new not in fields or old not in fields or getattr(self, new) is not None:
                continue
            value, default = getattr(self, old), fields[old].default
            if value is not None and value == default:
                setattr(self, new, value)
                setattr(self, old, None)

    @cached_property
    def _setup_devices(self):  # noqa: ANN202 - TrainingArguments' own, run once (by __post_init__)
        with _without_parallel_mode_hint():
            return TrainingArguments._setup_devices.func(self)  # type: ignore[attr-defined]

    def __post_init__(self) -> None:
        check_numbers(self)
        self._resolve_checkpointing_alias()
        super().__post_init__()
        sizes = parallelism_sizes(self)  # accelerate's ParallelismConfig(cp_size=P), here or from the launcher
        if sizes is not None and self.cp_size == 1:
            self.cp_size = sizes["cp_size"]  # what RingTrainer will adopt; configs sized by it see it now
        if self.offload_every not in (1, 2) or (self.offload_every > 1 and not (self.activation_offload and
                                                                                  self.tiled_layers)):  # fmt: skip
            raise UserError(
                f"RingTrainingArguments: offload_every={self.offload_every} needs activation_offload=True and "
                "tiled_layers (the tiled layers make the inputs between again); it is 1 or 2."
            )
        if self.activation_offload and not checkpointing(self)[0]:
            raise UserError(
                "RingTrainingArguments: activation_offload=True needs activation_checkpointing=True "
                "(alias gradient_checkpointing): what is offloaded are the checkpointed layers' inputs."
            )
        try:
            check_backend(self.attention_backend)
        except ValueError as e:
            raise UserError(f"RingTrainingArguments: attention_backend: {e} (e.g. --attention_backend auto)") from None
        try:
            self.ulysses_size = parse_ulysses_size(self.ulysses_size)  # type: ignore[assignment]
        except ValueError as e:
            raise UserError(f"RingTrainingArguments: {e} (e.g. --ulysses_size 2 or --ulysses_size auto)") from None
        if self.ulysses_size != "auto" and self.cp_size % int(self.ulysses_size):
            raise UserError(
                f"RingTrainingArguments: ulysses_size={self.ulysses_size} does not divide cp_size={self.cp_size}; "
                f"pick a divisor of {self.cp_size} (1 is plain ring attention)."
            )


def checkpointing(args: Any) -> tuple[bool, dict | None]:
    """``args``' activation checkpointing and its keyword arguments, under transformers' name for them:
    ``activation_checkpointing`` from 5.25 on (``gradient_checkpointing`` its deprecated alias), only
    ``gradient_checkpointing`` before."""
    if hasattr(args, "activation_checkpointing"):
        return bool(args.activation_checkpointing), args.activation_checkpointing_kwargs
    return bool(getattr(args, "gradient_checkpointing", False)), getattr(args, "gradient_checkpointing_kwargs", None)


_PARALLEL_MODE_HINT = "torch.distributed process group is initialized, but parallel_mode != ParallelMode.DISTRIBUTED"


@contextmanager
def _without_parallel_mode_hint() -> Iterator[None]:
    """Keep transformers' hint above (``TrainingArguments._setup_devices``: a process group is up but accelerate's
    state is not distributed; "launch with torch.distributed.launch") from the user while the arguments set up
    their devices, and only then: RingTrainer compares the launched processes with Trainer's view itself and
    refuses a mismatch naming the fix (``use_cpu=True``), and one process with a group up is no mistake."""

    def keep(record: logging.LogRecord) -> bool:
        return _PARALLEL_MODE_HINT not in record.getMessage()

    logger = logging.getLogger("transformers.training_args")
    with LEDGER.scoped() as scope:
        logger.addFilter(keep)
        scope.change(logger, lambda: logger.removeFilter(keep), why="RingTrainingArguments: the parallel_mode hint")
        yield


# field -> (the least value, whether it may equal it, whole numbers only, what it counts; None is
# allowed where the field's default is None). TrainingArguments checks few of these itself: a 0 would
# surface as a ZeroDivisionError or a silent no-op much later.
NUMBERS: dict[str, tuple[float, bool, bool, str]] = {
    "cp_size": (1, True, True, "processes that share one sequence (1: no context parallelism)"),
    "per_device_train_batch_size": (1, True, True, "sequences per process and micro-step"),
    "per_device_eval_batch_size": (1, True, True, "sequences per process and evaluation step"),
    "gradient_accumulation_steps": (1, True, True, "micro-steps per optimizer step"),
    "tiled_mlp": (1, True, True, "tokens per tile of the MLP (None: off)"),
    "tiled_layers": (1, True, True, "tokens per tile of the tiled decoder layers (None: off)"),
    "head_groups": (1, True, True, "attention head groups inside the ring (1: off)"),
    "offload_every": (1, True, True, "layers per offloaded layer input (1: every layer's input)"),
    "max_steps": (1, True, True, "optimizer steps to train (-1: as many as num_train_epochs make)"),
    "save_steps": (0, False, False, "optimizer steps between checkpoints (below 1: a fraction of the run)"),
    "logging_steps": (0, False, False, "optimizer steps between logs (below 1: a fraction of the run)"),
    "eval_steps": (0, False, False, "optimizer steps between evaluations (below 1: a fraction of the run)"),
    "save_total_limit": (1, True, True, "checkpoints kept (None: all)"),
    "learning_rate": (0, True, False, "the peak learning rate"),
    "weight_decay": (0, True, False, "AdamW's weight decay"),
    "warmup_steps": (0, True, False, "optimizer steps of warm-up (below 1: a fraction of the run)"),
    "max_grad_norm": (0, True, False, "the gradient norm clipped to (0: no clipping)"),
    "num_train_epochs": (0, False, False, "epochs to train when max_steps is -1"),
    "dataloader_num_workers": (0, True, True, "data loader worker processes"),
}


def check_numbers(args: object) -> None:
    """Refuse a field of ``NUMBERS`` that is not a number in its range, naming the field, the value
    and the fix (``UserError``). ``max_steps`` may also be -1 (``TrainingArguments``' default)."""
    for name, (least, inclusive, whole, what) in NUMBERS.items():
        value = getattr(args, name, None)
        if value is None or (name == "max_steps" and value == -1):
            continue
        kind = "a whole number" if whole else "a number"
        bound = f"{'>=' if inclusive else '>'} {least:g}"
        number = isinstance(value, int if whole else (int, float)) and not isinstance(value, bool)
        if not number or value < least or (value == least and not inclusive):
            example = f"{least:g}" if inclusive and least > 0 else "1"
            shown = f"{value:g}" if isinstance(value, float) else repr(value)
            raise UserError(f"{name}={shown}: {what}; give {kind} {bound} (e.g. --{name} {example})")


def apply_model_options(model: nn.Module, args: TrainingArguments) -> nn.Module:
    """Apply the model-side options of ``args`` (a ``RingTrainingArguments``; plain
    ``TrainingArguments`` have none) to ``model``: chunked loss, tiled MLP, head groups, tiled layers,
    activation offload.
    Idempotent; works on plain and PEFT models. Returns ``model``."""
    if getattr(args, "chunked_loss", False):
        enable_chunked_loss(model)
    if getattr(args, "tiled_mlp", None):
        enable_tiled_mlp(model, args.tiled_mlp)
    if getattr(args, "head_groups", 1) > 1:
        enable_head_groups(model, args.head_groups)
    if getattr(args, "tiled_layers", None):
        enable_tiled_layers(model, args.tiled_layers, offload_every=getattr(args, "offload_every", 1))
    if getattr(args, "activation_offload", False):
        kwargs = dict(checkpointing(args)[1] or {})
        enable_activation_checkpointing(model, offload=True, every_n_layers=kwargs.get("every_n_layers", 1))
    return model
