"""A forward of a sharded batch must reach across the CP group: the guard against per-shard answers.

Under context parallelism each rank holds a shard of every sequence, and a model computes the whole
sequence's answer only where its tokens meet across the CP group: in ring attention, or in a token
mixer's context-parallel form (``mixers.MIXER_FAMILIES``). A model whose tokens meet elsewhere -- in
attention code of its own, outside transformers' attention registry, or in a recurrent or
state-space mixer that hf_ring has no context-parallel form of (RWKV, xLSTM, ...) -- computes every
token from its own rank's shard alone and returns a wrong loss, or wrong logits, without an error.

The rule, which names no model: a forward that carries a ``ring_context`` at CP > 1 in which
neither ring attention nor a context-parallel mixer ran is refused (``RingNeverRan``). And the
positions: ``shard_batch`` passes the global position of every local token (``position_ids``); a
submodule that takes ``position_ids`` but is handed others -- numbered from the local sequence
length, as the decoders of BART, mBART, Marian, Pegasus, Blenderbot and PLBart do -- would place
every rank's tokens wrong, and is refused too.

And the ``kernels`` hub: transformers >= 5.25 loads models with ``use_kernels`` on by default where
the ``kernels`` package is installed, and ``kernelize`` may replace a whole layer's forward with a
hub kernel (``module.forward`` and ``_kernel_repo`` set on the instance:
``kernels/_internals/layer/layer.py`` ``_replace_forward``), or a function the layer calls (its
private ``_kernel_funcs``). A hub kernel behind a function hf_ring routes is the local compute of its
context-parallel form, as the installed package's would be; one that replaces a token mixer, or a
function of the mixer around the routed ones, would scan each rank's shard alone, and is refused.

- ``check_ran(ctx, calls, what)``: the rule, for the calls counted on the batch's context
  (``RingContext.cross_rank_calls``) while ``what`` ran;
- ``watch(model)``: forward hooks that apply both after every forward of ``model`` with a
  ``ring_context``, labelled or not (training, prefill, evaluation, logits for a custom loss). The
  build hook (``install``) watches every model built while hf_ring is installed -- the causal LM and
  its decoder (PEFT calls the causal LM's ``forward`` directly, past its hooks) --, so a sharded
  batch given to a model that does not run the ring (``attn_implementation="sdpa"``) is refused
  too; the positions are checked on models that run the ring. These hooks are the one reader of
  the counts.
"""

from __future__ import annotations

import functools
import inspect
import sys
import weakref
from typing import Any

from torch import Tensor, nn

from ..errors import RingNeverRan, RingNotSupported
from ..ledger import LEDGER
from .carry import context_of
from .context import RingContext
from .mixers import family_of
from .multimodal import check_entry, is_encoder
from .support import model_name

__all__ = ["check_hub_kernels", "check_ran", "forget", "watch"]

WHY = "`guard.watch`: the rule after every forward with a ring_context (the install table's model row)"
_GUARDS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> its _Guard
_CLAIMED: weakref.WeakSet = weakref.WeakSet()  # submodules whose positions a guard checks

# kernels of one decoding step (they run only with a cache, which hf_ring refuses under CP)
DECODE_STEP = frozenset({"causal_conv1d_update", "fused_recurrent_gated_delta_rule", "fused_recurrent_kda",
                         "selective_state_update"})  # fmt: skip
CP_MIXERS = "Gated DeltaNet, KDA, Mamba, Mamba2, short convolutions, lightning attention, RG-LRU"


def check_ran(ctx: RingContext, calls: int, what: str) -> None:
    """Raise ``RingNeverRan`` when ``what`` ran a batch at CP > 1 with no ring attention or mixer call."""
    if ctx.size > 1 and calls == 0:
        raise RingNeverRan(
            f"{what} ran a batch sharded by hf_ring.shard_batch over {ctx.size} ranks but never ran ring attention "
            "or a context-parallel token mixer with it, so each rank computed its tokens from its own shard only. "
            "Its tokens meet elsewhere: in attention the model computes itself (outside transformers' attention "
            'registry; load it with attn_implementation="ring", and its layers must pass the batch\'s keyword '
            "arguments, ring_context among them, on to attention), or in a recurrent or state-space mixer that "
            f"hf_ring has no context-parallel form of (it has: {CP_MIXERS}). Run this model without context "
            "parallelism (cp_size=1)."
        )


@functools.cache
def _routed_layer_names(modeling_module: str) -> frozenset[str]:
    """The ``kernels`` layer names of the functions hf_ring routes in ``modeling_module``, and of the
    decoding-step kernels."""
    family, module = family_of(modeling_module), sys.modules.get(modeling_module)
    if family is None or module is None:
        return DECODE_STEP
    names = (getattr(LEDGER.original(module, name), "kernel_layer_name", None) for name in family.functions)
    return frozenset(n for n in names if isinstance(n, str)) | frozenset(family.functions) | DECODE_STEP


def check_hub_kernels(model: nn.Module) -> None:
    """Refuse a token mixer that hf_ring runs under context parallelism when a ``kernels`` hub kernel
    replaced its forward, or a function it calls other than the ones hf_ring routes."""
    for sub in model.modules():
        cls = type(sub)
        family = family_of(cls.__module__)
        if family is None or cls.__name__ not in family.classes:
            continue
        replaced = [cls.__name__] if "_kernel_repo" in sub.__dict__ else []
        allowed = _routed_layer_names(cls.__module__)
        for name, fn in (sub.__dict__.get("_kernel_funcs") or {}).items():
            if "_kernel_repo" in getattr(fn, "__dict__", {}) and name not in allowed:
                replaced.append(f"{cls.__name__}'s {name}")
        if replaced:
            raise RingNotSupported(
                f"a hub kernel from the kernels package replaced {', '.join(replaced)} "
                f"(use_kernels, {model_name(getattr(model, 'config', None))}); under context parallelism hf_ring "
                "runs this token mixer through its context-parallel form, which a kernel in its place would skip "
                "(each rank would scan its own shard alone). Load the model with use_kernels=False, or leave this "
                "layer out of the kernel_config's mapping."
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
    start must not be zero (the count at its start is kept here, per forward); and, on a model that
    runs the ring, its submodules that take ``position_ids`` must get the positions the model was
    given (hooked at its first forward at CP > 1)."""

    def __init__(self, module: nn.Module) -> None:
        self.what = f"{type(module).__name__} ({model_name(getattr(module, 'config', None))})"
        self.start: tuple[RingContext, int] | None = None  # the forward running now: its context, count at start
        self.given: Tensor | None = None  # the position_ids of the forward running now, at CP > 1
        LEDGER.hook(module, module.register_forward_pre_hook(self.before, with_kwargs=True), why=WHY)
        LEDGER.hook(module, module.register_forward_hook(self.after, with_kwargs=True), why=WHY)
        self.scanned = False

    def _claim_positions(self, module: nn.Module) -> None:
        """Hook the submodules that take ``position_ids`` (those no guard of an inner model claimed)."""
        self.scanned = True
        if getattr(getattr(module, "config", None), "_attn_implementation", None) != "ring":
            return
        for sub in module.modules():
            if sub is not module and _signature(type(sub)) is not None and sub not in _CLAIMED:
                _CLAIMED.add(sub)
                LEDGER.hook(sub, sub.register_forward_pre_hook(self.positions, with_kwargs=True), why=WHY)

    def before(self, module: nn.Module, args: Any, kwargs: dict) -> None:
        ctx = context_of(kwargs)  # its own, or the one its causal LM carries (Mamba)
        if is_encoder(module):  # a vision encoder runs whole images on every rank
            ctx = None
        given = kwargs.get("position_ids")
        self.given = given if isinstance(ctx, RingContext) and ctx.size > 1 and isinstance(given, Tensor) else None
        if self.given is not None and not self.scanned:
            for inner in reversed(list(module.modules())):  # the innermost guarded model checks a submodule
                guard = _GUARDS.get(inner)
                if guard is not None and not guard.scanned:
                    guard._claim_positions(inner)
        if isinstance(ctx, RingContext) and ctx.entry is not None:
            check_entry(module, ctx)
        self.start = (ctx, ctx.cross_rank_calls.total) if isinstance(ctx, RingContext) else None
        if isinstance(ctx, RingContext) and ctx.size > 1 and "kernels" in sys.modules:
            check_hub_kernels(module)

    def after(self, module: nn.Module, args: Any, kwargs: dict, output: Any) -> None:
        self.given, start, self.start = None, self.start, None
        ctx = None if is_encoder(module) else context_of(kwargs)
        if start is not None and start[0] is ctx:
            check_ran(ctx, ctx.cross_rank_calls.total - start[1], self.what)

    def positions(self, module: nn.Module, args: Any, kwargs: dict) -> None:
        """A submodule that takes ``position_ids`` gets the model's own (or a view of them)."""
        given = self.given
        sig = _signature(type(module))
        if given is None or sig is None:
            return
        value = sig.bind_partial(module, *args, **kwargs).arguments.get("position_ids")
        if not isinstance(value, Tensor) or value is given or value.shape[-1:] != given.shape[-1:]:
            return
        # multimodal RoPE positions [R, B, S] (Qwen): the rows, or the text row first, go on separately
        candidates = (given,) if given.dim() < 3 else (given, given[0], given[1:])
        same = any(c.shape == value.shape and bool((value == c).all()) for c in candidates)
        if not same and given.dim() < 3:
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
    """Apply the rule after every forward of ``model`` that carries a ``ring_context`` (idempotent); the
    hooks are ledger entries of the model."""
    if model not in _GUARDS:
        _GUARDS[model] = _Guard(model)


def watched(model: nn.Module) -> bool:
    return model in _GUARDS


def forget() -> None:
    """Forget every model's guard (``uninstall``, after the ledger removed their hooks)."""
    _GUARDS.clear()
    _CLAIMED.clear()
