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
``dft``), and the entropy and token-accuracy metrics are not logged. ``packing=True`` (and
``padding_free=True``) work at any ``cp_size``: TRL's padding-free batches put several documents
in one row with ``position_ids`` restarting at each, and ``shard_batch`` keeps them apart (tested
equal to single-process ``SFTTrainer`` with sdpa, which masks by the same ``position_ids``). Pass
the model as a module loaded with ``attn_implementation="ring"`` (not a name).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from trl import SFTConfig, SFTTrainer

from .arguments import RingTrainingArguments
from .trainer import RingTrainer

__all__ = ["RingSFTConfig", "RingSFTTrainer", "drop_seq_idx"]


@dataclass
class RingSFTConfig(SFTConfig, RingTrainingArguments):
    """``trl.SFTConfig`` (its defaults) plus ``cp_size``, ``chunked_loss``, ``tiled_mlp``, ``activation_offload``."""

    def __post_init__(self) -> None:
        super().__post_init__()
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
        return RingTrainer.compute_loss(self, model, drop_seq_idx(inputs), *args, **kwargs)


def drop_seq_idx(inputs: dict[str, Any]) -> dict[str, Any]:
    """``inputs`` without TRL's padding-free ``seq_idx [1, N]`` (each token's document, for the short
    convolutions of linear-attention layers), after checking that it says what ``position_ids`` say
    (a document starts where they restart at 0), which is what ring attention reads."""
    seq_idx = inputs.get("seq_idx")
    if seq_idx is None:
        return inputs
    pos = inputs.get("position_ids")
    follows = pos is not None and pos.shape == seq_idx.shape
    if not follows or not bool(((pos == 0).cumsum(-1) - 1).eq(seq_idx.to(pos.device)).all()):
        raise ValueError(
            "RingSFTTrainer: the batch's seq_idx does not follow its position_ids (a document starts where "
            "position_ids restart at 0); ring attention reads document boundaries from position_ids or "
            "cu_seq_lens_q/k only."
        )
    return {k: v for k, v in inputs.items() if k != "seq_idx"}
