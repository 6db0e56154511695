"""Passkey retrieval accuracy of a ``RingTrainer``'s model, with context-parallel prefill."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from ..data.passkey import retrieved
from ..parallel import unshard
from ..transformers.batch import shard_batch
from .data import passkey_stage

__all__ = ["passkey_accuracy"]


@torch.no_grad()
def passkey_accuracy(trainer: Any, seq_len: int, samples: int, seed: int = 0) -> float:
    """Fraction of ``samples`` held-out passkeys (``passkey_stage(seq_len, seed, 50)``) that
    ``trainer.model`` retrieves at ``seq_len`` tokens. Each CP group prefills its samples together;
    the DP replicas split them, every rank running the same number of forwards (FSDP needs it).
    Collective: call it on every rank."""
    model = trainer.model
    ds = passkey_stage(seq_len, seed, 50)
    group = trainer._cp_group
    dp_size, dp_rank = trainer.dp_size, (trainer._cp.dp_rank if trainer._cp is not None else 0)
    device = trainer.args.device
    was_training = model.training
    model.eval()
    hits = torch.zeros(2, dtype=torch.float64, device=device)
    for k in range(math.ceil(samples / dp_size)):
        i = k * dp_size + dp_rank
        item = ds[i if i < samples else 0]
        ids = item["input_ids"][None].to(device)
        logits = unshard(model(**shard_batch({"input_ids": ids}, group=group)).logits, group=group)[:, :seq_len]
        if i < samples:
            hits[0] += retrieved(logits.float(), item["labels"][None].to(device)).sum()
            hits[1] += 1
    if dp_size > 1:
        dist.all_reduce(hits, group=trainer._dp_group)
    model.train(was_training)
    return float(hits[0] / hits[1])
