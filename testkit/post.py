"""Arguments shared by the preference-training tests (one process against the ring, step for step)."""

from __future__ import annotations

from typing import Any


def dpo_arguments(out: str, **overrides: Any) -> dict[str, Any]:
    """``DPOConfig`` keyword arguments of the DPO equality tests: 2 steps of 2 micro-batches of 2 pairs,
    plain SGD at a large rate (so a wrong gradient shows in the next step), float32, no saving."""
    return dict(output_dir=out, max_steps=2, per_device_train_batch_size=2, gradient_accumulation_steps=2,
                learning_rate=0.05, optim="sgd", logging_steps=1, report_to="none", use_cpu=True, disable_tqdm=True,
                bf16=False, save_strategy="no", seed=0, beta=0.2) | overrides  # fmt: skip
