"""The per-batch context: everything the ring attention function and the loss need for one batch.

``shard_batch`` makes one ``RingContext`` per batch and hands it to the model as the keyword
argument ``ring_context``. transformers passes model keyword arguments down to every attention
call and to the loss function, so both read it from their kwargs: no thread-locals, no module
globals, nothing keyed by identity. The walk of one batch is in ``docs/architecture.md``.

What travels in it:

- the CP group (size and rank read once), and with Ulysses (``ulysses_size > 1``) its Ulysses
  and ring groups: the attention then runs ``hf_ring.ops.ulysses.ulysses_attention``;
- packed documents: this rank's ring schedule cut along document boundaries (computed once);
- the loss policy: the backward scale of each rank's share of the loss, and whether this batch
  has labels (``num_items_in_batch`` is the global target count the model's loss divides by);
- ``full_logits``: the chunked loss (``enable_chunked_loss``) leaves this batch alone;
- filled while the batch runs: how many times ring attention ran on it (the guard against a model
  that never called the ring), and the last hidden states that the chunked-loss hook sets aside
  for the loss (taken, and so freed, by the loss).

This module imports only torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.distributed as dist
from torch import Tensor, nn

from ..ops.schedule import Schedule

__all__ = ["RingContext", "KEY"]

KEY = "ring_context"  # the model keyword argument that carries it


@dataclass(eq=False)
class ChunkedLossInput:
    """What the chunked-loss hook set aside for the loss of one batch."""

    hidden: Tensor  # [B, S_local, H], the decoder's last hidden states
    head: nn.Module  # the LM head
    chunk_size: int | None


@dataclass(eq=False)
class RingContext:
    """One batch's context (made by ``hf_ring.shard_batch``; passed as ``model(..., ring_context=...)``).

    Attributes:
        group: the CP group (``None``: the world group, or no torch.distributed).
        size, rank: the group's size and this rank's place in it.
        ulysses_size, ulysses_group, ring_group: the CP group's Ulysses x ring grid (see
            ``hf_ring.setup_context_parallel``); ``ulysses_size == 1``: plain ring attention over
            ``group``. ``ring_group`` ``None``: no ring (pure Ulysses). The batch is then in the
            hybrid layout (``hf_ring.ops.zigzag.hybrid``).
        grad_scale: backward factor of this rank's share of the loss (CP size x DP replicas that
            the target count spans).
        labelled: the batch has labels, so the model computes a loss that ``hf_ring`` sums over
            the CP group.
        full_logits: compute full logits even on a model with ``enable_chunked_loss``.
        positions_given: the batch brought its own ``position_ids`` (else ``shard_batch`` numbered
            the tokens 0, 1, 2, ..., which models that number positions otherwise must refuse).
        schedule: for packed documents, this rank's ring schedule cut along the document
            boundaries (``hf_ring.ops.schedule.layout_schedule``); ``None``: one sequence per row.
        index: for packed documents, ``[P, B, S_local]``: the global position of every local row of
            every rank (``N``, one past the end, for padding rows); ``unshard`` uses it.
        length: for packed documents, ``N``, the tokens of the whole sequence.
        attention_calls: ring attention calls made with this context since its last loss (forward
            calls only; the recompute of activation checkpointing in backward does not count).
    """

    group: dist.ProcessGroup | None
    size: int
    rank: int
    grad_scale: float = 1.0
    labelled: bool = False
    full_logits: bool = False
    positions_given: bool = True
    schedule: Schedule | None = field(default=None, repr=False)
    index: Tensor | None = field(default=None, repr=False)
    length: int = 0
    ulysses_size: int = 1
    ulysses_group: dist.ProcessGroup | None = field(default=None, repr=False)
    ring_group: dist.ProcessGroup | None = field(default=None, repr=False)
    attention_calls: int = 0
    _chunked: ChunkedLossInput | None = field(default=None, repr=False)

    def set_aside(self, hidden: Tensor, head: nn.Module, chunk_size: int | None) -> None:
        """Keep the last hidden states for the chunked loss of this batch (the hook's side)."""
        self._chunked = ChunkedLossInput(hidden, head, chunk_size)

    def take_chunked(self) -> ChunkedLossInput | None:
        """The hidden states set aside for the loss, once (the loss's side); ``None`` when the model
        computed full logits for this batch."""
        taken, self._chunked = self._chunked, None
        return taken

    def unshard(self, x: Tensor) -> Tensor:
        """Gather this batch's shards of ``x [B, S_local, ...]`` from the CP group and restore global
        order: ``[B, N_pad, ...]`` for one sequence per row (as ``hf_ring.unshard``, in this batch's
        layout), ``[B, N, ...]`` for packed documents (whose layout only the context knows). Not
        differentiable."""
        if self.index is None:
            from ..ops.zigzag import unshard

            return unshard(x, dim=1, group=self.group, ulysses_size=self.ulysses_size)
        import torch
        import torch.distributed as dist

        x = x.detach().contiguous()
        parts = [x]
        if self.size > 1:
            parts = [torch.empty_like(x) for _ in range(self.size)]
            dist.all_gather(parts, x, group=self.group)
        b, n = x.shape[0], self.length
        out = x.new_zeros((b, n + 1, *x.shape[2:]))  # row n collects the padding rows
        for r, part in enumerate(parts):
            idx = self.index[r].to(x.device).view(b, -1, *([1] * (x.dim() - 2))).expand_as(part)
            out.scatter_(1, idx, part)
        return out[:, :n]
