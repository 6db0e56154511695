"""The final model of a run, in the formats that load without hf_ring: a LoRA adapter in PEFT's
format (``PeftModel.from_pretrained(base, path)``), or a full model (``save_pretrained``), whatever
the FSDP state-dict type of the checkpoints (``SHARDED_STATE_DICT`` checkpoints are for resume)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["full_state_dict", "save_final"]


def _is_main() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def full_state_dict(model: nn.Module, trainable_only: bool) -> dict[str, torch.Tensor]:
    """Full (unsharded) CPU tensors of ``model``'s parameters -- only the trainable ones, or all its
    state -- on rank 0 (an empty dict elsewhere). Every rank must call it (FSDP2 parameters are
    gathered with ``DTensor.full_tensor``)."""
    from torch.distributed.tensor import DTensor

    items = (
        [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        if trainable_only
        else list(model.state_dict().items())
    )
    out: dict[str, torch.Tensor] = {}
    for name, t in items:
        t = t.detach()
        if isinstance(t, DTensor):
            t = t.full_tensor()
        if _is_main():
            out[name] = t.cpu().clone()
    return out


def save_final(trainer: Any, path: str | os.PathLike) -> Path:
    """Write the trained model of ``trainer`` (a ``RingTrainer`` after ``train()``) to ``path``:
    a PEFT model's adapter in PEFT's format, any other model with ``save_pretrained``. Collective:
    call it on every rank. Returns ``path``."""
    from peft import PeftModel

    path = Path(path)
    model = trainer.model  # FSDP2 shards it in place; DDP keeps the unwrapped module here
    inner = trainer.accelerator.unwrap_model(model)
    peft = isinstance(inner, PeftModel)
    state = full_state_dict(inner, trainable_only=peft)
    if _is_main():
        path.mkdir(parents=True, exist_ok=True)
        inner.save_pretrained(path, state_dict=state, safe_serialization=True)
        if getattr(trainer, "processing_class", None) is not None:
            trainer.processing_class.save_pretrained(path)
    if dist.is_initialized():
        dist.barrier()
    return path
