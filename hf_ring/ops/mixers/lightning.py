"""The context-parallel form of lightning attention (MiniMax's linear attention layers) by state passing.

Per head the layer keeps ``S [Dh, Dh]`` (keys x values) and decays it by ``lambda = exp(-slope)`` every
token: ``S_t = lambda S_{t-1} + k_t^T v_t``, ``o_t = q_t S_t``. That is the SSD recurrence with step
1, ``A = -slope``, ``x = v``, ``B = k``, ``C = q`` (its state is ``S^T``), so it runs through
``ssd.ssd_scan`` with the torch chunk scan ``ssd.torch_ssd_scan`` (blocks of ``block_size``): each
run's map is ``lambda^len`` per head, its state from zero is gathered and composed over the CP group.
This module imports only torch; the group is passed in.
"""

from __future__ import annotations

import torch.distributed as dist
from torch import Tensor

from .runs import RunPlan
from .ssd import Scan, ssd_scan, torch_ssd_scan

__all__ = ["lightning_attention"]


def lightning_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    slope: Tensor,
    plan: RunPlan,
    group: dist.ProcessGroup | None,
    block_size: int = 64,
    scan: Scan = torch_ssd_scan,
) -> Tensor:
    """Lightning attention over the whole (sharded) sequence, this rank's rows.

    Args:
        q, k, v: ``[B, S_local, H, Dh]``; slope: ``[H]`` (the per-token decay is ``exp(-slope)``).
        plan: ``ssd.ssd_plan(layout, B, rank)``; group: the layout's CP group.
        block_size: the chunk of the torch scan; scan: an SSD scan (``ssd.Scan``).

    Returns ``[B, S_local, H, Dh]`` in ``v``'s dtype: each row's output as the recurrence over its
    document in global order from a zero state (padding rows: zeros). Collective over ``group``.
    """
    ones = v.new_ones(v.shape[:3])
    out = ssd_scan(scan, v, ones, -slope.reshape(-1), k, q, plan, group, chunk_size=block_size)
    return out.to(v.dtype)
