"""The transformers glue: the only part of hf_ring that imports transformers.

- ``attention``: the ``"ring"`` attention function and mask function;
- ``loss``: the causal-LM loss of a sharded batch, summed over the CP group;
- ``batch``: ``shard_batch``, a full batch -> this rank's model arguments and its ``RingContext``;
- ``context``: ``RingContext``, the per-batch object that carries everything above;
- ``patches``: opt-in model changes (chunked loss, tiled MLP, activation checkpointing + offload);
- ``mixers``: the token mixers of hybrid models routed through their context-parallel forms;
- ``router``: the MoE router load-balancing loss of a sharded batch, over the CP group;
- ``temperature``: Llama 4's NoPE query temperature from global positions;
- ``support``: what ring attention computes exactly, and ``RingNotSupported`` for the rest;
- ``guard``: a forward of a sharded batch that never reached across the CP group is refused;
- ``logits``: a model's logits as a function of its LM head's output (for chunked logits).
"""

from __future__ import annotations

import sys
from typing import Any

NAME = "ring"


def register() -> None:
    """Make ``attn_implementation="ring"`` available to transformers (idempotent).

    Registers the attention function and the mask function under "ring", and wraps the causal-LM
    loss so that batches from ``shard_batch`` (which carry a ``ring_context``) get their loss summed
    over the CP group; every other call of that loss is unchanged. Routes the token mixers of hybrid
    models (``mixers.FAMILIES``) through their context-parallel forms, and the MoE router
    load-balancing loss (``router.install``) over the CP group, for calls that carry a
    ``ring_context``; and watches every model built with (or switched to) the ring for forwards of
    sharded batches that never ran ring attention or a context-parallel mixer (``guard.install``).
    Runs at ``import hf_ring``.
    """
    from transformers import AttentionInterface
    from transformers.loss.loss_utils import LOSS_MAPPING
    from transformers.masking_utils import AttentionMaskInterface

    from .attention import ring_attention_forward, ring_mask
    from .guard import install as install_guard
    from .loss import wrap_causal_lm_loss
    from .mixers import install
    from .router import install as install_router
    from .support import refuse_at_build

    AttentionInterface.register(NAME, ring_attention_forward)
    AttentionMaskInterface.register(NAME, ring_mask)
    refuse_at_build(NAME)
    install()
    install_router()
    install_guard(NAME)
    _wrap_causal_lm_loss(LOSS_MAPPING, wrap_causal_lm_loss)


def _wrap_causal_lm_loss(mapping: dict, wrap: Any) -> None:
    """Put the wrapped causal-LM loss wherever transformers refers to ``ForCausalLMLoss``.

    Every ``LOSS_MAPPING`` entry that is ``ForCausalLMLoss`` (``ForCausalLM``,
    ``ForConditionalGeneration``, ...) gets the wrapper, and so does the name ``ForCausalLMLoss``
    itself, in ``transformers.loss.loss_utils`` and in every transformers module that imported it
    already. Identity checks such as ``Trainer``'s ``LOSS_MAPPING[loss_type] is ForCausalLMLoss``
    (which decides that position 0 of each row is not a target) keep their answer.
    """
    from transformers.loss import loss_utils

    original = loss_utils.ForCausalLMLoss
    if hasattr(original, "hf_ring_original"):
        return
    wrapped = wrap(original)
    for key, fn in list(mapping.items()):
        if fn is original:
            mapping[key] = wrapped
    for name, module in list(sys.modules.items()):
        # __dict__, not getattr: transformers' lazy modules import on attribute access
        if name.startswith("transformers") and vars(module).get("ForCausalLMLoss") is original:
            module.ForCausalLMLoss = wrapped
