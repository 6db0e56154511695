"""The MoE router's load-balancing loss over a whole sequence split across a group.

The Switch-Transformer loss that transformers' MoE models add to the language-model loss is a
function of three sums over every routed token of every MoE layer::

    tokens[e] = sum over layers and rows of  w * [e in top_k(softmax(logits))]      (no gradient)
    probs[e]  = sum over layers and rows of  w * softmax(logits)[e]
    rows      = sum over layers and rows of  w
    loss      = E * sum_e (tokens[e] / rows) * (probs[e] / rows)

with ``w`` 1 for a token of the batch and 0 for padding. Each rank of a context-parallel group holds
some rows; summing the three over the group (one all-reduce of ``2E + 1`` numbers) gives every rank
the loss of the whole sequence, and its gradient flows through this rank's own router
probabilities. The all-reduce's backward scales the gradient by ``grad_scale`` (the CP size), as the
language-model loss does, so gradients averaged over the group equal those of one process. The sums
are float32, as transformers accumulates them. This module imports only torch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from .reduce import sum_over_group

__all__ = ["load_balancing_loss", "routing_sums"]


def routing_sums(gate_logits: Sequence[Tensor], num_experts: int, top_k: int, weights: Tensor | None) -> Tensor:
    """``[2E + 1]`` float32: ``tokens [E]`` (detached), ``rows [1]`` (detached), ``probs [E]`` of this
    rank's rows. ``gate_logits``: per MoE layer ``[T, E]`` (any leading shape flattening to the
    ``T`` rows of ``weights``); ``weights``: ``[T]``, the rows to count (``None``: all)."""
    device = gate_logits[0].device
    tokens = torch.zeros(num_experts, dtype=torch.float32, device=device)
    probs = torch.zeros(num_experts, dtype=torch.float32, device=device)
    rows = torch.zeros(1, dtype=torch.float32, device=device)
    for layer in gate_logits:
        logits = layer.to(device).reshape(-1, layer.shape[-1])  # (T, E)
        w = (
            torch.ones(logits.shape[0], dtype=torch.float32, device=device)
            if weights is None
            else weights.reshape(-1).to(device, torch.float32)
        )
        if w.shape[0] != logits.shape[0]:
            raise ValueError(f"load_balancing_loss: {logits.shape[0]} router rows but {w.shape[0]} weights")
        routing = torch.softmax(logits, dim=-1)
        _, chosen = torch.topk(routing, top_k, dim=-1)  # (T, k)
        tokens = tokens.scatter_add(0, chosen.reshape(-1), w.repeat_interleave(top_k))
        probs = probs + (routing.float() * w[:, None]).sum(dim=0)
        rows = rows + w.sum()
    return torch.cat((tokens.detach(), rows.detach(), probs))


def load_balancing_loss(
    gate_logits: Sequence[Tensor],
    num_experts: int,
    top_k: int,
    weights: Tensor | None = None,
    group: dist.ProcessGroup | None = None,
    size: int = 1,
    grad_scale: float = 1.0,
) -> Tensor:
    """The load-balancing loss (a float32 scalar) of the rows of every rank of ``group`` together.

    ``gate_logits``: this rank's router logits, one ``[T, E]`` tensor per MoE layer (rows in the
    order of ``weights``); ``weights``: ``[T]``, 1 for rows to count, 0 for padding (``None``: every
    row); ``group`` of ``size`` ranks: the ranks whose rows make up the sequence (``None``: the
    world group; ``size`` 1: this rank's rows alone, no communication, which is transformers'
    ``load_balancing_loss_func``); ``grad_scale``: the backward factor of the all-reduce (the CP
    size when gradients are averaged over the group). Every rank of
    ``group`` must call this with the same ``num_experts``, ``top_k`` and number of layers.
    """
    sums = routing_sums(gate_logits, num_experts, top_k, weights)
    if size > 1:
        sums = sum_over_group(sums, group, grad_scale)
    tokens, rows, probs = sums[:num_experts], sums[num_experts], sums[num_experts + 1 :]
    return torch.sum((tokens / rows) * (probs / rows)) * num_experts
