"""Direct preference optimisation with context parallelism: ``RingDPOTrainer`` and ``RingDPOConfig``.

``RingDPOTrainer`` is ``RingTrainer`` mixed into ``trl.DPOTrainer``: TRL prepares the pairs (prompt +
chosen, prompt + rejected, right padding) and computes every DPO loss it offers (``loss_type``:
sigmoid, hinge, ipo, robust, bco_pair, apo, ..., several at once with ``loss_weights``;
``ld_alpha``, ``use_weighting``, f-divergences) and its
metrics (``rewards/chosen``, ``rewards/rejected``, ``rewards/margins``, ``rewards/accuracies``,
``logps/*``, ``logits/*``, ``entropy``, ``mean_token_accuracy``) from per-token log-probabilities.
Here those come from the ring: each rank of a CP group holds ``1/P`` of every sequence; TRL reads
the per-token values only through sums over each row's completion, so each row's sums are summed
over the group and put where TRL reads them (``hf_ring.trainer.fused_head``; with ``ld_alpha``,
two sums per row: within the pair's shorter completion, and past it), for the policy and for the
reference alike -- a separate ``ref_model``, the same model with its LoRA
adapter disabled, or ``precompute_ref_log_probs=True`` (computed once, under CP too)::

    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="ring")
    args = RingDPOConfig(output_dir="out", cp_size=4, max_length=131072, bf16=True, loss_type=["sigmoid"])
    RingDPOTrainer(model=model, args=args, train_dataset=pairs, processing_class=tok, peft_config=lora).train()

``padding_free=True`` (TRL's name; TRL 1.16's own ``DPOTrainer`` falls back to padding) runs the
chosen and rejected rows of each micro-batch as the packed documents of one row, with positions
restarting at 0 at each document (``pack_rows``: no padding enters the ring, no token sees another
document); each document's sums (``sequence_sums(..., per_document=True)``) are planted in TRL's
padded ``[2B, N - 1]`` rows, so its loss code runs unchanged. Loss, gradients and metrics are
those of one-process ``DPOTrainer`` on the same data, padded or packed (tests/test_dpo.py). Pass
the model loaded with ``attn_implementation="ring"`` (not a name).

Image pairs (TRL's vision collator with a processor: ``pixel_values``, ``image_grid_thw``,
``mm_token_type_ids``) run the same way: the image inputs reach ``shard_batch`` whole, the text decoder
runs on this rank's shard; with ``padding_free=True`` each row is packed with its own images and M-RoPE
positions (``hf_ring.trainer.rows.pack_image_rows``). tests/test_dpo_vlm.py.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from trl import DPOConfig, DPOTrainer

from ..ledger import LEDGER
from .arguments import RingTrainingArguments
from .fused_head import RingTrainerForTRL

__all__ = ["RingDPOConfig", "RingDPOTrainer"]


@dataclass
class RingDPOConfig(DPOConfig, RingTrainingArguments):
    """``trl.DPOConfig`` (its defaults) plus ``cp_size``, ``ulysses_size``, ``chunked_loss``, ``tiled_mlp``,
    ``activation_offload``. ``padding_free=True`` packs each micro-batch's chosen and rejected rows
    as documents of one row (at ``cp_size > 1``; see the module docstring; at ``cp_size=1``, TRL's padding)."""


def ld_alpha_tail(label_mask: Tensor) -> Tensor:
    """``[2B, N - 1]`` bool: the completion positions of each row past the shorter completion of its
    pair (rows ``b`` and ``B + b``), whose log-probabilities DPO with ``ld_alpha`` weighs by it
    (``trl/trainer/dpo_trainer.py``, ``_compute_loss``, TRL 1.16: ``tail_mask = comp_pos > shared_lens``)."""
    lengths = label_mask.sum(1)
    chosen, rejected = lengths.chunk(2)
    shared = torch.minimum(chosen, rejected).repeat(2)
    return label_mask.long().cumsum(1) > shared[:, None]


class _Without(logging.Filter):
    """A logging filter that drops the records starting with ``start``."""

    def __init__(self, start: str) -> None:
        super().__init__()
        self.start = start

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.start)


class RingDPOTrainer(RingTrainerForTRL, DPOTrainer):
    """``trl.DPOTrainer`` with context parallelism: see the module docstring. Takes ``DPOTrainer``'s
    arguments (by keyword after ``model``), plus ``cp_size`` and ``ulysses_size`` (or in ``args``)."""

    def __init__(self, model: Any = None, ref_model: Any = None, args: Any = None, **kwargs: Any) -> None:
        stats = ("entropy", "mean_logits", "is_top1")
        if getattr(args, "use_weighting", False):
            stats += ("log_sum_sq_probs",)
        self._fused_pack = bool(getattr(args, "padding_free", False))
        # TRL reads the per-token outputs only through row sums (two per row with ld_alpha)
        self._fused_row_sums = True
        if getattr(args, "ld_alpha", None) is not None:
            self._fused_split = ld_alpha_tail
        with LEDGER.scoped() as scope:
            if self._fused_pack:  # TRL's DPOTrainer warns that it falls back to padding; under CP the ring packs
                log = logging.getLogger("trl.trainer.dpo_trainer")
                quiet = _Without("`padding_free=True` is temporarily unavailable")
                log.addFilter(quiet)
                scope.change(log, lambda: log.removeFilter(quiet), why="RingDPOTrainer: TRL's padding_free warning")
            self._ring_init(model, args, stats, ref_model=ref_model, **kwargs)
        if self._fused_pack and self.cp_size == 1:  # TRL's DPOTrainer, as it runs padding_free=True: padded
            warnings.warn(
                "RingDPOConfig: padding_free=True packs each batch's pairs into one row for the ring at cp_size > 1; "
                "at cp_size=1 this is TRL's DPOTrainer, which pads (set padding_free=False to silence this).",
                stacklevel=2,
            )

    def _precompute_ref_logps(self, dataset: Any, name: str, batch_size: int) -> Any:
        """TRL's, with the batches split over the DP replicas only (the ranks of a CP group share
        theirs) and the results gathered over the DP replicas."""
        if self._cp is None or self._cp.cp_size == 1:
            return super()._precompute_ref_logps(dataset, name, batch_size)
        acc = self.accelerator
        with self._split_over_dp_replicas(), self.model_calls(), LEDGER.scoped() as scope:
            why = "RingDPOTrainer: reference log-probabilities gathered over the DP replicas"
            scope.set_attr(acc, "gather_for_metrics", self._gather_over_dp, why=why)
            return super()._precompute_ref_logps(dataset, name, batch_size)
