"""Data for a DP x CP world: every rank of a CP group sees the same batches, DP replicas see
different ones, and the number of valid targets is counted over the whole optimizer step.

    plain torch:  DataLoader(ds, batch_size=b, sampler=hf_ring.dp_sampler(ds))
    accelerate:   loader = hf_ring.prepare_dataloader(DataLoader(ds, batch_size=b, shuffle=True))
                  (instead of accelerator.prepare(loader), which would split over all processes)
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from ..ops.cross_entropy import IGNORE_INDEX
from ..parallel import ContextParallel, context_parallel_state
from ..transformers.batch import next_token_targets

__all__ = ["count_targets", "dp_sampler", "prepare_dataloader"]


def _state(cp: ContextParallel | None) -> ContextParallel | None:
    return cp if cp is not None else context_parallel_state()


def dp_sampler(dataset: Dataset, cp: ContextParallel | None = None, *, shuffle: bool = True, seed: int = 0):
    """A ``DistributedSampler`` over the DP replicas only (the ranks of one CP group share it).

    Without ``setup_context_parallel`` (and no ``cp``), it samples for a single replica.
    """
    cp = _state(cp)
    replicas, rank = (cp.dp_size, cp.dp_rank) if cp is not None else (1, 0)
    return DistributedSampler(dataset, num_replicas=replicas, rank=rank, shuffle=shuffle, seed=seed, drop_last=True)


def prepare_dataloader(dataloader: DataLoader, cp: ContextParallel | None = None, **kwargs: Any) -> DataLoader:
    """accelerate's ``prepare_data_loader`` split over DP replicas, not over all processes.

    Extra keyword arguments go to ``accelerate.data_loader.prepare_data_loader``.
    """
    from accelerate.data_loader import prepare_data_loader

    cp = _state(cp)
    replicas, rank = (cp.dp_size, cp.dp_rank) if cp is not None else (1, 0)
    return prepare_data_loader(dataloader, num_processes=replicas, process_index=rank, **kwargs)


def count_targets(batches: Iterable[dict[str, Any]], dp_group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Valid next-token targets in ``batches`` (one optimizer step's micro-batches, unshifted HF
    labels and optional right-padding ``attention_mask``, or their ``shift_labels`` when a batch has
    them), summed over ``dp_group``.

    Pass the result as ``num_items_in_batch`` to ``shard_batch`` (with ``dp_size``) so that the
    loss of the step is the mean over all its targets, as on one device.
    """
    total = torch.zeros((), dtype=torch.int64)
    for b in batches:
        targets = b.get("shift_labels")
        if targets is None:
            targets = next_token_targets(b["labels"], b.get("attention_mask"), b.get("position_ids"))
        total += (targets != IGNORE_INDEX).sum().cpu()
    if dp_group is not None and dist.is_initialized() and dist.get_world_size(dp_group) > 1:
        if dist.get_backend(dp_group) == "nccl":
            total = total.cuda()
        dist.all_reduce(total, group=dp_group)
    return total
