"""Loss reduction over the context-parallel group.

Each rank computes the cross-entropy of its own tokens, summed and divided by the number of valid
targets of the *whole* sequence (``num_items_in_batch``), so the rank losses add up to the loss of
the whole sequence. ``reduce_loss`` sums them across the CP group, so every rank reports that loss,
and scales the backward by ``grad_scale`` (default: the CP size), so that gradients *averaged* over
the group, as DDP/FSDP do over a DP x CP world, equal those of one process running the sequence.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor


@dataclass(frozen=True)
class CPLoss:
    """Handed to the model by ``shard_batch`` (keyword ``hf_ring_cp``): how to reduce the loss.

    ``group``: the CP group; ``grad_scale``: the backward factor of each rank's share
    (the CP size, times the DP size when ``num_items_in_batch`` counts targets over DP replicas).
    """

    group: dist.ProcessGroup | None
    grad_scale: float


class _SumAcrossRanks(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, grad_scale):  # type: ignore[override]
        ctx.grad_scale = grad_scale
        x = x.clone()
        if dist.is_initialized() and dist.get_world_size(group) > 1:
            dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return grad * ctx.grad_scale, None, None


def reduce_loss(local: Tensor, cp: CPLoss) -> Tensor:
    """Sum this rank's share of the loss over the CP group; backward scales by ``cp.grad_scale``."""
    return _SumAcrossRanks.apply(local, cp.group, cp.grad_scale)
