"""Partial attention results and their exact merge, in log space; attention sinks.

A kernel call over some of a row's keys returns ``out`` (normalised over those keys) and ``lse``
(the log-sum-exp of their scores). Two results for the same rows merge exactly::

    lse = logaddexp(lse_a, lse_b)
    out = out_a * exp(lse_a - lse) + out_b * exp(lse_b - lse)

Rows that saw no key yet have ``lse = -inf`` and stay ``0``/``-inf`` instead of turning into NaN.
An attention sink is one more logit per row with no value, joined once to the merged result; its
gradient needs only ``out``, ``lse`` and ``dout``. The ring (``ring.py``) folds every block into
float32 accumulators with ``merge_`` and applies sinks after the last one. This module imports only
torch.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["add_sinks", "merge_", "sink_grad"]


def merge_(out: Tensor, lse: Tensor, blk_out: Tensor, blk_lse: Tensor) -> None:
    """Fold one block into the running result, in place and in log space.

    ``out: [B, S, H, D]`` and ``lse: [B, S, H]`` are float32 accumulators (``lse = -inf`` for rows
    that have seen no key yet); ``blk_out``/``blk_lse`` are the block's. Rows where both are
    ``-inf`` stay ``0``/``-inf`` instead of turning into NaN.
    """
    new = torch.logaddexp(lse, blk_lse)
    w_old = torch.exp(lse - new).nan_to_num_(0.0)
    w_blk = torch.exp(blk_lse - new).nan_to_num_(0.0)
    out.mul_(w_old.unsqueeze(-1)).add_(blk_out * w_blk.unsqueeze(-1))
    lse.copy_(new)


def add_sinks(out: Tensor, lse: Tensor, sinks: Tensor) -> tuple[Tensor, Tensor]:
    """Attention sinks after the merge: one more logit per head with no value.

    ``out [B, S, Hq, D]`` and ``lse [B, S, Hq]`` of attention over the keys; ``sinks [Hq]`` (one per head)
    or ``[B, S, Hq]`` (one per query row and head). Returns
    ``out * exp(lse - lse')`` (in ``out``'s dtype; the sink's share of each row's softmax mass is
    dropped, ``exp(lse - lse') = sigmoid(lse - sink)``) and ``lse' = logaddexp(lse, sink)``, computed in
    ``lse``'s dtype. With ``lse'`` and this ``out``, the block kernels' backward gives exactly the
    gradients of attention with sinks (the sink adds a probability but no value to ``dO . O``).
    """
    new = torch.logaddexp(lse, sinks.to(lse.dtype))
    return (out.to(lse.dtype) * torch.exp(lse - new).unsqueeze(-1)).to(out.dtype), new


def sink_grad(dout: Tensor, out: Tensor, lse: Tensor, sinks: Tensor) -> Tensor:
    """``d loss / d sinks``, shaped like ``sinks``: ``-p_sink * (dO . O)`` per row, with
    ``p_sink = exp(sink - lse')`` (``out``/``lse`` those of attention with sinks), summed over the
    rows for per-head sinks ``[Hq]``."""
    ct = lse.dtype
    delta = (dout.to(ct) * out.to(ct)).sum(-1)  # (B, S, Hq)
    grad = -(torch.exp(sinks.to(ct) - lse) * delta)
    return (grad.sum((0, 1)) if sinks.dim() == 1 else grad).to(sinks.dtype)
