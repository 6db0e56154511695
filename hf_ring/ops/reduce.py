"""Sum a scalar over a process group, with a chosen backward scale.

Each rank of a CP group computes the cross-entropy of its own tokens, summed and divided by the
number of valid targets of the *whole* sequence, so the rank losses add up to the loss of the whole
sequence. ``sum_over_group`` adds them up, so every rank reports that loss, and scales the backward
by ``grad_scale`` (the CP size, times the DP size when the target count spans DP replicas), so that
gradients *averaged* over the group, as DDP/FSDP do over a DP x CP world, equal those of one
process running the sequence. This module imports only torch.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["sum_over_group"]


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


def sum_over_group(local: Tensor, group: dist.ProcessGroup | None, grad_scale: float) -> Tensor:
    """``local`` (a scalar) summed over ``group``; its backward multiplies the gradient by ``grad_scale``."""
    return _SumAcrossRanks.apply(local, group, grad_scale)
