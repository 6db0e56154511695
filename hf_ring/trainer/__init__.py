"""``RingTrainer`` and what only it needs: ``RingTrainingArguments`` (``arguments``), start-up
checks (``checks``), the final adapter or model (``export``, written by ``RingTrainer.save_model``),
checkpoints that a kill cannot break (``checkpoints``, ``integrity``, ``saving``: ``CheckpointError``),
collective timeouts (``timeouts``: ``CollectiveTimeout``) and the TRL mixin (``trl``,
``RingSFTTrainer``; imported on its own, as it needs trl).

    from hf_ring import RingTrainer, RingTrainingArguments   # or from hf_ring.trainer
    from hf_ring.trainer.trl import RingSFTConfig, RingSFTTrainer
"""

from .arguments import RingTrainingArguments
from .trainer import RingTrainer, resolve_ulysses_size

__all__ = ["RingTrainer", "RingTrainingArguments", "resolve_ulysses_size"]
