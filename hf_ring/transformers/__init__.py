"""The transformers glue: the only part of hf_ring that imports transformers.

- ``install``: every change hf_ring makes to transformers, in one table; ``register``,
  ``uninstall``, ``installed`` (docs/architecture.md shows the table);
- ``attention``: the ``"ring"`` attention function and mask function;
- ``loss``: the causal-LM loss of a sharded batch, summed over the CP group (a model's ``loss_function``);
- ``batch``: ``shard_batch``, a full batch -> this rank's model arguments and its ``RingContext``;
- ``context``: ``RingContext``, the per-batch object that carries everything above;
- ``carry``: the context of the forward running now, for functions transformers calls without it;
- ``patches``: opt-in model changes (chunked loss, tiled MLP, activation checkpointing + offload);
- ``mixers``: the token mixers of hybrid models routed through their context-parallel forms;
- ``router``: the MoE router load-balancing loss of a sharded batch, over the CP group;
- ``temperature``: Llama 4's NoPE query temperature from global positions;
- ``support``: what ring attention computes exactly (the exceptions live in ``hf_ring.errors``);
- ``guard``: a forward of a sharded batch that never reached across the CP group is refused;
- ``logits``: a model's logits as a function of its LM head's output (for chunked logits).

This package's ``__init__`` imports nothing heavy: ``register`` and the rest import on call.
"""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["installed", "register", "uninstall"]


def register() -> None:
    """Make ``attn_implementation="ring"`` available to transformers (idempotent): the ``"ring"``
    entries of its attention and mask registries, and the build hook that gives every model built
    from then on what it needs to run a batch of ``hf_ring.shard_batch`` (``install``). Runs at
    ``import hf_ring``."""
    from .install import register as register_

    register_()


def uninstall() -> None:
    """Undo ``register`` and everything it led to: transformers as it was (``install.uninstall``); a
    later ``import transformers`` registers nothing (``register()`` installs anew)."""
    sys.meta_path[:] = [f for f in sys.meta_path if not getattr(f, "hf_ring_registers", False)]
    if "transformers" in sys.modules:
        from .install import uninstall as uninstall_

        uninstall_()


def installed() -> list[Any]:
    """The changes to transformers in effect now (``install.Applied``, each with what it replaced)."""
    from .install import installed as installed_

    return installed_()
