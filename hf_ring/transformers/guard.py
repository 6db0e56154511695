"""A forward of a sharded batch must reach across the CP group: the guard against per-shard answers.

Under context parallelism each rank holds a shard of every sequence, and a model computes the whole
sequence's answer only where its tokens meet across the CP group: in ring attention, or in a token
mixer's context-parallel form (``mixers.FAMILIES``). A model whose tokens meet elsewhere -- in
attention code of its own, outside transformers' attention registry, or in a recurrent or
state-space mixer that hf_ring has no context-parallel form of (RWKV, xLSTM, ...) -- computes every
token from its own rank's shard alone and returns a wrong loss, or wrong logits, without an error.

The rule, which names no model: a forward that carries a ``ring_context`` at CP > 1 in which
neither ring attention nor a context-parallel mixer ran is refused (``RingNeverRan``). And the
positions: ``shard_batch`` passes the global position of every local token (``position_ids``); a
submodule that takes ``position_ids`` but is handed others -- numbered from the local sequence
length, as the decoders of BART, mBART, Marian, Pegasus, Blenderbot and PLBart do -- would place
every rank's tokens wrong, and is refused too.

- ``check_ran(ctx, calls, what)``: the rule, for ``calls`` counted on the context (the loss applies
  it to labelled batches, ``loss.py``);
- ``watch(model)``: forward hooks that apply both after every forward of ``model`` with a
  ``ring_context``, labelled or not (prefill, evaluation, logits for a custom loss);
- ``install()``: wraps ``PreTrainedModel.post_init`` and ``PreTrainedModel.set_attn_implementation``
  so that every model built with, or switched to, ``attn_implementation="ring"`` is watched (the
  model and its decoder: PEFT calls the model's ``forward`` directly, past its hooks).
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

from torch import Tensor, nn

from .carry import context_of
from .context import RingContext
from .support import RingNeverRan, RingNotSupported, model_name

__all__ = ["check_ran", "install", "watch"]

ROUTED = "Gated DeltaNet, KDA, Mamba, Mamba2, short convolutions, lightning attention, RG-LRU"


def check_ran(ctx: RingContext, calls: int, what: str) -> None:
    """Raise ``RingNeverRan`` when ``what`` ran a batch at CP > 1 with no ring attention or mixer call."""
    if ctx.size > 1 and calls == 0:
        raise RingNeverRan(
            f"{what} ran a batch sharded by hf_ring.shard_batch over {ctx.size} ranks but never ran ring attention "
            "or a context-parallel token mixer with it, so each rank computed its tokens from its own shard only. "
            "Its tokens meet elsewhere: in attention the model computes itself (outside transformers' attention "
            'registry; load it with attn_implementation="ring", and its layers must pass the batch\'s keyword '
            "arguments, ring_context among them, on to attention), or in a recurrent or state-space mixer that "
            f"hf_ring has no context-parallel form of (it has: {ROUTED}). Run this model without context "
            "parallelism (cp_size=1)."
        )


@functools.cache
def _signature(cls: type) -> inspect.Signature | None:
    """``cls.forward``'s signature when it takes ``position_ids`` by name, else ``None``."""
    try:
        sig = inspect.signature(cls.forward)
    except (TypeError, ValueError):
        return None
    return sig if "position_ids" in sig.parameters else None


class _Guard:
    """Hooks of one model: after its forward, the calls counted on the batch's context since its
    start must not be zero (the count at the start lives on the context: it goes with the batch);
    and its submodules that take ``position_ids`` must get the positions the model was given."""

    def __init__(self, module: nn.Module) -> None:
        self.what = f"{type(module).__name__} ({model_name(getattr(module, 'config', None))})"
        self.key = ("guard", id(self))
        self.given: Tensor | None = None  # the position_ids of the forward running now, at CP > 1
        self.handles = [
            module.register_forward_pre_hook(self.before, with_kwargs=True),
            module.register_forward_hook(self.after, with_kwargs=True),
        ]
        for sub in module.modules():  # the innermost guarded model checks a submodule
            if sub is not module and _signature(type(sub)) is not None and "_hf_ring_positions" not in sub.__dict__:
                sub._hf_ring_positions = True
                self.handles.append(sub.register_forward_pre_hook(self.positions, with_kwargs=True))

    def before(self, module: nn.Module, args: Any, kwargs: dict) -> None:
        ctx = context_of(kwargs)  # its own, or the one its causal LM carries (Mamba)
        given = kwargs.get("position_ids")
        self.given = given if isinstance(ctx, RingContext) and ctx.size > 1 and isinstance(given, Tensor) else None
        if isinstance(ctx, RingContext):
            ctx._cache[self.key] = ctx.calls

    def after(self, module: nn.Module, args: Any, kwargs: dict, output: Any) -> None:
        self.given = None
        ctx = context_of(kwargs)
        if isinstance(ctx, RingContext) and self.key in ctx._cache:
            check_ran(ctx, ctx.calls - ctx._cache.pop(self.key), self.what)

    def positions(self, module: nn.Module, args: Any, kwargs: dict) -> None:
        """A submodule that takes ``position_ids`` gets the model's own (or a view of them)."""
        given = self.given
        sig = _signature(type(module))
        if given is None or sig is None:
            return
        value = sig.bind_partial(module, *args, **kwargs).arguments.get("position_ids")
        if not isinstance(value, Tensor) or value is given or value.shape[-1:] != given.shape[-1:]:
            return
        try:
            same = bool((value == given).all())
        except RuntimeError:  # shapes that do not broadcast: not the same positions
            same = False
        if not same:
            raise RingNotSupported(
                f'attn_implementation="ring": {self.what} numbers positions itself for its {type(module).__name__} '
                "(from each rank's local length, say) instead of using the position_ids that hf_ring.shard_batch "
                "passes (the global positions of this rank's tokens), so every rank would place its tokens wrong. "
                "Run this model without context parallelism (cp_size=1)."
            )


def watch(model: nn.Module) -> None:
    """Apply the rule after every forward of ``model`` that carries a ``ring_context`` (idempotent)."""
    if "_hf_ring_guard" not in model.__dict__:
        model._hf_ring_guard = _Guard(model)


def _watching(method: Any, name: str) -> Any:
    @functools.wraps(method)
    def wrapped(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        out = method(self, *args, **kwargs)
        if getattr(getattr(self, "config", None), "_attn_implementation", None) == name:
            watch(self)
        return out

    wrapped.hf_ring_original = method  # type: ignore[attr-defined]
    return wrapped


def install(name: str) -> None:
    """Watch every transformers model built with, or switched to, ``attn_implementation=name``
    (idempotent)."""
    from transformers import PreTrainedModel

    for method in ("post_init", "set_attn_implementation"):
        fn = getattr(PreTrainedModel, method)
        if not hasattr(fn, "hf_ring_original"):
            setattr(PreTrainedModel, method, _watching(fn, name))
