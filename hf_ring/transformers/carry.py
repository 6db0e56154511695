"""The batch's ``ring_context`` for functions that transformers calls without it.

Most hybrid mixers hand their ``**kwargs`` -- the batch's ``ring_context`` among them -- to the
kernel functions that ``mixers`` routes. Some do not: the Mamba, Mamba2 and Falcon-Mamba causal LMs
call their model without them (and Mamba's model its blocks), Jamba's decoder layer calls its mixer
without them, Zamba's mixer calls its scan and convolution without them, RecurrentGemma's block its
RG-LRU scan; and the MoE causal LMs call the router load-balancing loss without them.
``carry_context`` (an adapter on such a model's, mixer's or causal LM's ``forward``, bound by
``install``) makes the context of the call the one of the forward running now, ``ACTIVE`` -- the
one context variable of hf_ring -- for the functions below it (``context_of``), also when
activation checkpointing recomputes a layer in backward, after that forward returned.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from contextvars import ContextVar
from typing import Any

from ..ledger import LEDGER
from .context import RingContext

WHY = "`carry_context`: a checkpointed module's checkpoint function runs its function under the batch's context"

__all__ = ["ACTIVE", "carry_context", "context_of", "needs_cp"]


# The ring_context of the forward running now (set by ``carry_context``).
ACTIVE: ContextVar[RingContext | None] = ContextVar("hf_ring_mixer_context", default=None)


def context_of(kwargs: dict[str, Any]) -> RingContext | None:
    ctx = kwargs.get("ring_context")
    return ctx if ctx is not None else ACTIVE.get()


def _in_context(function: Callable, ctx: RingContext) -> Callable:
    @functools.wraps(function)
    def run(*args: Any, **kwargs: Any) -> Any:
        token = ACTIVE.set(ctx)
        try:
            return function(*args, **kwargs)
        finally:
            ACTIVE.reset(token)

    return run


def _checkpointing_in_context(checkpoint: Callable, ctx: RingContext) -> Callable:
    """A module's activation-checkpoint function whose function runs under ``ctx``: in forward, and
    again when backward recomputes it (after the forward that set the context has returned)."""

    def run(function: Callable, *args: Any, **kwargs: Any) -> Any:
        return checkpoint(_in_context(function, ctx), *args, **kwargs)

    return run


def carry_context(forward: Callable) -> Callable:
    """A model's or a mixer's ``forward`` that makes its ``ring_context`` keyword visible to the routed
    kernels called below it without their ``**kwargs``: for the duration of the call, and in the
    recompute of the activation-checkpointed modules inside it (the checkpoint functions transformers
    gives them, ``_gradient_checkpointing_func``, run their function under the context)."""

    @functools.wraps(forward)
    def wrapped(self: Any, *args: Any, **kwargs: Any) -> Any:
        ctx = context_of(kwargs)  # its own, else the one an enclosing forward carries
        token = ACTIVE.set(ctx)
        try:
            with LEDGER.scoped() as scope:  # transformers' own checkpoint functions again when the forward returns
                if needs_cp(ctx):
                    for module in self.modules():
                        checkpoint = module.__dict__.get("_gradient_checkpointing_func")
                        if checkpoint is not None:
                            scope.set_attr(module, "_gradient_checkpointing_func",
                                           _checkpointing_in_context(checkpoint, ctx), why=WHY)  # fmt: skip
                return forward(self, *args, **kwargs)
        finally:
            ACTIVE.reset(token)

    return wrapped


def needs_cp(ctx: RingContext | None) -> bool:
    return ctx is not None and (ctx.size > 1 or ctx.layout.packed)
