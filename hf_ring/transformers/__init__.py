"""The transformers glue: the only part of hf_ring that imports transformers.

- ``attention``: the ``"ring"`` attention function and mask function;
- ``loss``: the causal-LM loss of a sharded batch, summed over the CP group;
- ``batch``: ``shard_batch``, a full batch -> this rank's model arguments and its ``RingContext``;
- ``context``: ``RingContext``, the per-batch object that carries everything above;
- ``patches``: opt-in model changes (chunked loss, tiled MLP, activation checkpointing + offload);
- ``support``: what ring attention computes exactly, and ``RingNotSupported`` for the rest.
"""

from __future__ import annotations

NAME = "ring"


def register() -> None:
    """Make ``attn_implementation="ring"`` available to transformers (idempotent).

    Registers the attention function and the mask function under "ring", and wraps the causal-LM
    loss so that batches from ``shard_batch`` (which carry a ``ring_context``) get their loss summed
    over the CP group; every other call of that loss is unchanged. Runs at ``import hf_ring``.
    """
    from transformers import AttentionInterface
    from transformers.loss.loss_utils import LOSS_MAPPING
    from transformers.masking_utils import AttentionMaskInterface

    from .attention import ring_attention_forward, ring_mask
    from .loss import wrap_causal_lm_loss
    from .support import refuse_at_build

    AttentionInterface.register(NAME, ring_attention_forward)
    AttentionMaskInterface.register(NAME, ring_mask)
    refuse_at_build(NAME)
    if not hasattr(LOSS_MAPPING["ForCausalLM"], "hf_ring_original"):
        LOSS_MAPPING["ForCausalLM"] = wrap_causal_lm_loss(LOSS_MAPPING["ForCausalLM"])
