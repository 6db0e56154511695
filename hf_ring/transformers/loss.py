"""The causal-LM loss of a sharded batch: this rank's share, summed over the CP group.

``register()`` wraps transformers' ``ForCausalLM`` loss once. Calls that carry a labelled
``RingContext`` (keyword ``ring_context``, from ``hf_ring.shard_batch``) compute this rank's share
of the loss -- from the hidden states the chunked-loss hook set aside on the context, or from the
logits as usual -- and sum it over the CP group (``RingContext.reduce_loss``, the one place of the
loss policy), after checking that the forward ran ring attention or a context-parallel token mixer
(``guard.check_ran``); every other call of the loss is unchanged.
"""

from __future__ import annotations

from typing import Any

import torch.nn.functional as F
from torch import Tensor

from ..ops.cross_entropy import IGNORE_INDEX, chunked_causal_lm_loss
from .context import ChunkedLossInput, RingContext
from .guard import check_ran

__all__ = ["wrap_causal_lm_loss"]


def _chunked_loss(
    chunked: ChunkedLossInput,
    labels: Tensor | None = None,
    shift_labels: Tensor | None = None,
    num_items_in_batch: Tensor | int | None = None,
    ignore_index: int = IGNORE_INDEX,
    **_: Any,
) -> Tensor:
    if shift_labels is None:
        if labels is None:
            raise ValueError("chunked loss: the model was called without labels")
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    return chunked_causal_lm_loss(
        chunked.hidden,
        chunked.head,
        shift_labels,
        num_items_in_batch=num_items_in_batch,
        ignore_index=ignore_index,
        chunk_size=chunked.chunk_size,
        logits_transform=chunked.transform,
    )


def wrap_causal_lm_loss(original: Any) -> Any:
    """The ``ForCausalLM`` loss ``original``, made aware of ``ring_context`` (see the module docstring)."""

    def loss(*args: Any, ring_context: RingContext | None = None, **kwargs: Any) -> Tensor:
        chunked = ring_context.take_chunked() if ring_context is not None else None
        local = original(*args, **kwargs) if chunked is None else _chunked_loss(chunked, **kwargs)
        if ring_context is None or not ring_context.labelled:
            return local
        check_ran(ring_context, ring_context.take_calls(), "the model")  # the calls of this forward
        return ring_context.reduce_loss(local)

    loss.hf_ring_original = original  # type: ignore[attr-defined]
    return loss
