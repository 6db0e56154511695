"""The causal-LM loss of a sharded batch: this rank's share, summed over the CP group.

transformers' causal LMs compute their loss with ``self.loss_function(logits, labels, vocab_size,
**kwargs)``, and ``PreTrainedModel.loss_function`` returns the model's own ``_loss_function`` when
it has one. ``install`` gives every model built while hf_ring is installed its ``CausalLMLoss``
there (``enable_chunked_loss`` gives one to the model it is called on): a call that carries a
labelled ``RingContext`` (keyword ``ring_context``, from ``hf_ring.shard_batch``) computes this
rank's share of the loss -- from the LM head's input that the model's chunked loss kept for this
call (``ChunkedLossInput``), or from the logits as usual -- and sums it over the CP group
(``RingContext.reduce_loss``, the one place of the loss policy). Every other call is the loss
transformers would use (``LOSS_MAPPING[model.loss_type]``), unchanged; ``LOSS_MAPPING`` itself is
not touched, so ``Trainer``'s check that a model's loss is ``ForCausalLMLoss`` keeps its answer.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch.nn.functional as F
from torch import Tensor, nn
from transformers.loss.loss_utils import LOSS_MAPPING, ForCausalLMLoss

from ..errors import RingNotSupported
from ..ledger import LEDGER
from ..ops.cross_entropy import IGNORE_INDEX, chunked_causal_lm_loss
from .context import RingContext

__all__ = ["CHUNKED", "CausalLMLoss", "ChunkedLossInput", "give_loss"]

# causal LM -> its chunked loss (``patches.ChunkedLoss``): hf_ring's own record, never an attribute of the model
CHUNKED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@dataclass(eq=False)
class ChunkedLossInput:
    """What the chunked loss of a model kept, for one call, for the loss of that call."""

    hidden: Tensor  # [B, S_local, H], the LM head's input (the last hidden states)
    head: nn.Module  # the LM head
    chunk_size: int | None
    transform: Callable[[Tensor], Tensor] | None = None  # the model's logits from the head's output


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


class CausalLMLoss:
    """The ``loss_function`` of one model: transformers' own (``LOSS_MAPPING[model.loss_type]``, read at
    every call as ``PreTrainedModel.loss_function`` reads it), made aware of ``ring_context`` when it
    is ``ForCausalLMLoss`` (see the module docstring). Holds its model weakly; copies of the model
    (``copy.deepcopy``, pickling) get one of their own."""

    def __init__(self, model: nn.Module) -> None:
        self.model = weakref.ref(model)

    def __reduce__(self) -> tuple:
        return (type(self), (self.model(),))

    def original(self) -> Callable:
        """The loss transformers would give the model."""
        loss_type = getattr(self.model(), "loss_type", None)
        return LOSS_MAPPING[loss_type if loss_type in LOSS_MAPPING else "ForCausalLM"]

    def __call__(self, *args: Any, ring_context: RingContext | None = None, **kwargs: Any) -> Tensor:
        original = self.original()
        if ring_context is None or original is not ForCausalLMLoss:
            if ring_context is not None:
                kwargs["ring_context"] = ring_context
            return original(*args, **kwargs)
        model = self.model()
        chunked = CHUNKED.get(model) if model is not None else None
        taken = chunked.take(ring_context) if chunked is not None else None
        local = original(*args, **kwargs) if taken is None else _chunked_loss(taken, **kwargs)
        if not ring_context.labelled:
            return local
        return ring_context.reduce_loss(local)


def give_loss(model: nn.Module, why: str = "the model's `CausalLMLoss` (the install table's model row)") -> None:
    """Give ``model`` its ``CausalLMLoss`` as its ``_loss_function`` (idempotent; a ledger entry of the model);
    ``RingNotSupported`` if it has a loss of its own."""
    current = model.__dict__.get("_loss_function")
    if current is None:
        LEDGER.set_attr(model, "_loss_function", CausalLMLoss(model), why=why, scope="model")
    elif not isinstance(current, CausalLMLoss):
        raise RingNotSupported(
            f"{type(model).__name__} has a loss_function of its own ({current!r}); hf_ring computes the loss of a "
            "sharded batch with transformers' causal-LM loss. Remove it (del model._loss_function)."
        )
