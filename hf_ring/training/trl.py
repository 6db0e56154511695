"""Ring attention with TRL's ``SFTTrainer``: ``RingSFTTrainer`` and ``RingSFTConfig``.

``RingSFTTrainer`` is ``RingTrainer`` mixed into ``trl.SFTTrainer`` (``class RingSFTTrainer(RingTrainer,
SFTTrainer)``): TRL prepares the data (chat templates, tokenisation, completion-only or
assistant-only labels, truncation), its collator pads on the right, and ``RingTrainer`` splits the
batches over the DP replicas, shards each over the CP group and computes the loss, summed over the
group, as on one device. ``RingSFTConfig`` is ``SFTConfig`` with ``RingTrainingArguments``' fields
(``cp_size``, ``chunked_loss``, ``tiled_mlp``, ``activation_offload``)::

    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="ring")
    args = RingSFTConfig(output_dir="out", cp_size=4, max_length=131072, bf16=True)
    RingSFTTrainer(model=model, args=args, train_dataset=ds, processing_class=tok, peft_config=lora).train()

What TRL adds to its loss is left out: the loss is the causal-LM loss (``loss_type="nll"``; no
``dft``), and the entropy and token-accuracy metrics are not logged. Packing and padding-free
batches put several documents in one sequence; ``shard_batch`` keeps them apart by their
restarting ``position_ids``, but that path is not tested with TRL's collators yet: keep
``packing=False`` and ``padding_free=False`` (the defaults). Pass the model as a module loaded with
``attn_implementation="ring"`` (not a name).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from trl import SFTConfig, SFTTrainer

from ..trainer import RingTrainer
from .arguments import RingTrainingArguments

__all__ = ["RingSFTConfig", "RingSFTTrainer"]


@dataclass
class RingSFTConfig(SFTConfig, RingTrainingArguments):
    """``trl.SFTConfig`` (its defaults) plus ``cp_size``, ``chunked_loss``, ``tiled_mlp``, ``activation_offload``."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.cp_size > 1 and (self.packing or self.padding_free):
            raise ValueError(
                "RingSFTConfig: packing / padding_free put several documents in one sequence, whose boundaries "
                "ring attention does not honour yet; set packing=False and padding_free=False."
            )
        if self.loss_type != "nll":
            raise ValueError(f"RingSFTConfig: loss_type={self.loss_type!r} is not supported; use 'nll'.")


class RingSFTTrainer(RingTrainer, SFTTrainer):
    """``trl.SFTTrainer`` with context parallelism: see the module docstring."""

    def __init__(self, model: Any = None, args: Any = None, *rest: Any, **kwargs: Any) -> None:
        if isinstance(model, str):
            raise TypeError(
                'RingSFTTrainer: pass the model loaded with attn_implementation="ring" (after `import hf_ring`), '
                "not its name."
            )
        super().__init__(model, args, *rest, **kwargs)

    def compute_loss(self, model: Any, inputs: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
        inputs = {k: v for k, v in inputs.items() if k not in ("use_cache", "output_router_logits")}
        return RingTrainer.compute_loss(self, model, inputs, *args, **kwargs)
