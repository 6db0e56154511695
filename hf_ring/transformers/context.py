"""The per-batch context: everything the ring attention function, the token mixers and the loss
need for one batch.

``shard_batch`` makes one ``RingContext`` per batch and hands it to the model as the keyword
argument ``ring_context``. transformers passes model keyword arguments down to every attention
call, to the token mixers of hybrid models and to the loss function, so all of them read it from
their kwargs (the few functions transformers calls without them see the context of the forward
running now, ``carry.ACTIVE``). The walk of one batch is in ``docs/architecture.md``.

What travels in it:

- the CP group (size and rank read once), and with Ulysses (``ulysses_size > 1``) its Ulysses
  and ring groups: the attention then runs ``hf_ring.ops.ulysses.ulysses_ring_attention``;
- ``layout`` (``hf_ring.ops.layout.ShardLayout``): which global token every local row of every rank
  holds, and where documents begin. The ring's schedules and the halo exchanges of the
  context-parallel token mixers are derived from it, once per batch (``cached``);
- ``real``: which local rows hold tokens of the batch (not padding);
- the loss policy: this rank's share of the loss is summed over the CP group and multiplied by
  ``dp_size``; its backward is scaled by ``size * dp_size`` (``reduce_loss``);
- ``full_logits``: the chunked loss (``enable_chunked_loss``) leaves this batch alone;
- ``decode``: for greedy decoding under context parallelism, the ``decode.DecodeStep`` of this
  forward (the prefill fills its sharded KV cache, decoding forwards read it); ``None`` otherwise;
- ``cross_rank_calls``: how many forward calls of ring attention and of the context-parallel token
  mixers ran on this batch -- the only thing written to the context while the batch runs, each
  count by its one writer (the attention function, the mixer routes); the guard against a model
  that computed its tokens from its own shard reads it (``guard.py``).

Nothing else travels on the context: the hidden states of the chunked loss belong to that model's
chunked-loss object (``patches.enable_chunked_loss``), and functions transformers calls without
the forward's keyword arguments see the context through ``carry.ACTIVE``.

This module imports only torch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from ..ops.layout import ShardLayout
from ..ops.reduce import sum_over_group
from ..ops.schedule import Schedule

__all__ = ["CrossRankCalls", "RingContext", "CONTEXT_KEY"]

CONTEXT_KEY = "ring_context"  # the model keyword argument that carries it


@dataclass(eq=False)
class CrossRankCalls:
    """The forward calls of one batch in which its tokens met across the CP group. Counts only grow;
    a reader takes ``total`` before and after what it watches (``guard.py``). Each count has one
    writer; the recompute of activation checkpointing in backward does not count."""

    attention: int = 0  # ring attention (written by ``attention.ring_attention_forward`` only)
    mixers: int = 0  # context-parallel token mixers (written by the routes of ``mixers`` only)

    @property
    def total(self) -> int:
        return self.attention + self.mixers

    def attention_ran(self) -> None:
        if not _in_backward():
            self.attention += 1

    def mixer_ran(self) -> None:
        if not _in_backward():
            self.mixers += 1


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
        dp_size: the data-parallel replicas that ``num_items_in_batch`` counts the targets of.
        labelled: the batch has labels, so the model computes a loss that ``hf_ring`` sums over
            the CP group.
        full_logits: compute full logits even on a model with ``enable_chunked_loss``.
        positions_given: the batch brought its own ``position_ids`` (else ``shard_batch`` numbered
            the tokens 0, 1, 2, ..., which models that number positions otherwise must refuse).
        layout: where every token of the batch lives (``hf_ring.ops.layout.ShardLayout``).
        real: ``[B, S_local]`` bool, the local rows that hold tokens of the batch (not padding that
            ``shard_batch`` added nor right padding of an ``attention_mask``).
        schedule: for packed documents, this rank's ring schedule cut along the document
            boundaries (``hf_ring.ops.schedule.placement_schedule``); ``None``: one sequence per row
            (the ring's own zigzag schedule).
        cross_rank_calls: the forward calls of ring attention and of the context-parallel token
            mixers made with this context (``CrossRankCalls``).
        decode: ``hf_ring.transformers.decode.DecodeStep`` of a prefill for decoding or of a decoding
            forward (its sharded KV cache, set by ``hf_ring.evaluation.generate``); ``None``: no decoding.
        entry: ``[B, S_local]`` long, for a batch that enters the model whole (image or video inputs):
            the global token of every local row (``>= N`` for padding), by which the text decoder's
            entry cuts its inputs (``multimodal.py``); ``None``: the inputs come sharded.
    """

    group: dist.ProcessGroup | None
    size: int
    rank: int
    layout: ShardLayout
    dp_size: int = 1
    labelled: bool = False
    full_logits: bool = False
    positions_given: bool = True
    real: Tensor | None = field(default=None, repr=False)
    schedule: Schedule | None = field(default=None, repr=False)
    ulysses_size: int = 1
    ulysses_group: dist.ProcessGroup | None = field(default=None, repr=False)
    ring_group: dist.ProcessGroup | None = field(default=None, repr=False)
    cross_rank_calls: CrossRankCalls = field(default_factory=CrossRankCalls, repr=False)
    entry: Tensor | None = field(default=None, repr=False)
    decode: Any = field(default=None, repr=False)
    _cache: dict[Any, Any] = field(default_factory=dict, repr=False)

    @property
    def grad_scale(self) -> float:
        """The backward factor of this rank's share of the loss: ``size * dp_size`` (DDP and FSDP
        average gradients over the DP x CP world)."""
        return float(self.size * self.dp_size)

    def reduce_loss(self, local: Tensor) -> Tensor:
        """This rank's share of the loss (its tokens' summed loss over the step's global target count)
        -> the loss every rank reports: summed over the CP group, times ``dp_size`` (the mean over
        the DP replicas is then the step's loss, as DDP and ``Trainer`` average it); backward scaled
        by ``size * dp_size`` in all, so gradients averaged over the DP x CP world are those of one
        device."""
        total = sum_over_group(local, self.group, float(self.size))
        return total * self.dp_size if self.dp_size != 1 else total

    def cached(self, key: Any, make: Callable[[], Any]) -> Any:
        """``make()``, computed once per batch under ``key`` (schedules, halo plans: data derived
        from the layout that every layer of the model shares)."""
        if key not in self._cache:
            self._cache[key] = make()
        return self._cache[key]

    def unshard(self, x: Tensor) -> Tensor:
        """Gather this batch's shards of ``x [B, S_local, ...]`` from the CP group and restore global
        order: ``[B, N_pad, ...]`` for one sequence per row (as ``hf_ring.unshard``, in this batch's
        layout), ``[B, N, ...]`` for packed documents (whose layout only the context knows). Not
        differentiable."""
        if not self.layout.packed:
            from ..ops.zigzag import unshard

            return unshard(x, dim=1, group=self.group, ulysses_size=self.ulysses_size)
        import torch
        import torch.distributed as dist

        x = x.detach().contiguous()
        parts = [x]
        if self.size > 1:
            parts = [torch.empty_like(x) for _ in range(self.size)]
            dist.all_gather(parts, x, group=self.group)
        b, n = x.shape[0], self.layout.n
        index = self.cached("index", lambda: self.layout.index(b))
        out = x.new_zeros((b, n + 1, *x.shape[2:]))  # row n collects the padding rows
        for r, part in enumerate(parts):
            idx = index[r].to(x.device).view(b, -1, *([1] * (x.dim() - 2))).expand_as(part)
            out.scatter_(1, idx, part)
        return out[:, :n]


def _in_backward() -> bool:
    """True while autograd runs a backward pass (where activation checkpointing recomputes)."""
    task = getattr(torch._C, "_current_graph_task_id", None)
    return task is not None and task() != -1
