"""``RingTrainingArguments``: ``TrainingArguments`` plus context parallelism and the model-side
options of long sequences, and ``apply_model_options``, which puts those options on a model.
``hf_ring.trainer`` re-exports both."""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn
from transformers import TrainingArguments

from ..planner.settings import parse_ulysses_size
from ..transformers.patches import enable_activation_checkpointing, enable_chunked_loss, enable_tiled_mlp

__all__ = ["RingTrainingArguments", "apply_model_options"]


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
    activation_offload: bool = field(
        default=False,
        metadata={
            "help": "Keep the activations that checkpointed layers save in host memory "
            "(hf_ring.enable_activation_checkpointing(offload=True)); needs activation_checkpointing."
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

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.activation_offload and not self.activation_checkpointing:
            raise ValueError(
                "RingTrainingArguments: activation_offload=True needs activation_checkpointing=True "
                "(alias gradient_checkpointing): what is offloaded are the checkpointed layers' inputs."
            )
        try:
            self.ulysses_size = parse_ulysses_size(self.ulysses_size)  # type: ignore[assignment]
        except ValueError as e:
            raise ValueError(f"RingTrainingArguments: {e} (e.g. --ulysses_size 2 or --ulysses_size auto)") from None
        if self.ulysses_size != "auto" and self.cp_size % int(self.ulysses_size):
            raise ValueError(
                f"RingTrainingArguments: ulysses_size={self.ulysses_size} does not divide cp_size={self.cp_size}; "
                f"pick a divisor of {self.cp_size} (1 is plain ring attention)."
            )
        if self.tiled_mlp is not None and self.tiled_mlp < 1:
            raise ValueError(f"RingTrainingArguments: tiled_mlp must be >= 1 (tokens) or None, not {self.tiled_mlp}")


def apply_model_options(model: nn.Module, args: TrainingArguments) -> nn.Module:
    """Apply the model-side options of ``args`` (a ``RingTrainingArguments``; plain
    ``TrainingArguments`` have none) to ``model``: chunked loss, tiled MLP, activation offload.
    Idempotent; works on plain and PEFT models. Returns ``model``."""
    if getattr(args, "chunked_loss", False):
        enable_chunked_loss(model)
    if getattr(args, "tiled_mlp", None):
        enable_tiled_mlp(model, args.tiled_mlp)
    if getattr(args, "activation_offload", False):
        kwargs = dict(args.activation_checkpointing_kwargs or {})
        enable_activation_checkpointing(model, offload=True, every_n_layers=kwargs.get("every_n_layers", 1))
    return model
