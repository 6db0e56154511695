"""Every change hf_ring makes to transformers: one table (``changes()``), installed where it is
needed through the ledger (``hf_ring.ledger.LEDGER``) and undone by ``uninstall()``.

At ``import transformers`` (or at ``import hf_ring`` when transformers is loaded already)
``register()`` makes the only process-wide changes: the ``"ring"`` entries of transformers'
attention and mask registries, and the build hook -- a wrapper of
``PreTrainedModel._check_and_adjust_attn_implementation``, the check every model runs while it is
built (``PreTrainedModel.__init__``) and when its attention implementation is switched
(``set_attn_implementation``). For every model that check sees, ``install_for``:

- refuses at once, when it asks for ``"ring"``, a model that cannot run the ring
  (``support.REFUSED_AT_BUILD``);
- applies, once per modeling module (of the model's classes: ``type(model).__mro__``), that
  module's rows: its token-mixer kernels and adapters (``mixers.MIXER_FAMILIES``) and, where its
  ``load_balancing_loss_func`` computes the Switch loss, the router loss (``router``). Only
  modules already imported are touched; no file is read and no other modeling module imported;
- gives the model itself its causal-LM loss (``loss.CausalLMLoss`` as its ``loss_function``) and
  the guard's hooks (``guard.watch``).

Every model, whatever its attention, gets the model and module rows: they change nothing without a
``ring_context``, and with one they are what makes a sharded batch exact or refused (a model built
with ``"sdpa"`` and given a batch of ``shard_batch`` at CP > 1 is refused by its guard; packed
documents at CP = 1 restart the mixers' states). ``installed()`` lists what is in effect (the ledger's
entries, each with the object it replaced); ``uninstall()`` undoes every ledger entry -- every original
back by identity, the registry entries, the build hook and what models got (their chunked loss,
tiled MLPs, offload, hooks) -- and forgets the modules, so that ``register()`` installs anew. docs/architecture.md shows
``markdown()`` (checked by tests/test_install.py; ``python -m hf_ring.transformers.install``).
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from ..ledger import LEDGER, Entry

__all__ = ["Change", "changes", "install_for", "install_module", "installed", "markdown",
           "original", "register", "uninstall"]  # fmt: skip

NAME = "ring"
PROCESS, MODULE, MODEL = "process", "modeling module", "model"
REGISTRY, FUNCTION, METHOD, ATTRIBUTE, HOOKS = "registry entry", "module function", "class method", "attribute", "hooks"
_MODELS = "transformers.models."


@dataclass(frozen=True)
class Change:
    """One row of the table: what changes (``target``, a dotted path; ``<...>`` stands for a kind of
    module, class or model), its ``kind``, its ``scope`` (``"process"``: at registration;
    ``"modeling module"``: when a model of that module is built; ``"model"``: each model built) and
    ``why``."""

    target: str
    kind: str
    scope: str
    why: str


ATTENTION = Change("transformers.AttentionInterface['ring']", REGISTRY, PROCESS,
                   "the ring attention function (`install.attention_entry`: `attention.ring_attention_forward`, "
                   "imported on first call); a new name")  # fmt: skip
MASK = Change("transformers.masking_utils.AttentionMaskInterface['ring']", REGISTRY, PROCESS,
              "the ring's mask function (`install.mask_entry`: `attention.ring_mask`): no `[N, N]` mask; the model's "
              "window or chunk read, its arguments kept for a call without a `ring_context`; a new name")  # fmt: skip
BUILD_HOOK = Change(
    "transformers.PreTrainedModel._check_and_adjust_attn_implementation", METHOD, PROCESS,
    "the build hook: the original, then `install_for(model)`, which applies the rows below; raises "
    "`RingNotSupported` for a model of `support.REFUSED_AT_BUILD` (Falcon, GPT-Neo, XLM, XLNet, CPM-Ant, "
    "ProphetNet) built with, or switched to, `\"ring\"`",
)  # fmt: skip
ROUTER_LOSS = Change(
    "transformers.models.<MoE module>.load_balancing_loss_func", FUNCTION, MODULE,
    "where it computes the Switch loss (checked on a small input, `router.routed`): inside a forward with a "
    "`ring_context`, the whole sequence's router loss over the CP group (`router.dispatcher`); else the original",
)  # fmt: skip
ROUTER_CALLER = Change(
    "transformers.models.<MoE module>.<class that calls it>.forward", METHOD, MODULE,
    "`carry.carry_context`: the call's `ring_context` is the one of the forward running now (`carry.ACTIVE`) "
    "for the router loss, which the forward calls without it; reset when it returns",
)  # fmt: skip
ATTENTION_CALLER = Change(
    "transformers.models.<module>.<decoder layer>.forward", METHOD, MODULE,
    "`carry.carry_context` on the decoder layers that call their attention without the batch's keyword arguments "
    "(`ATTENTION_CALLERS`: StableLM, Nemotron): the ring attention function takes the layer's `ring_context` "
    "from `carry.ACTIVE`, also in activation-checkpoint recomputes",
)  # fmt: skip
# modeling module -> its decoder layers that drop the keyword arguments (``self.self_attn(...)`` without ``**kwargs``)
ATTENTION_CALLERS = {
    "transformers.models.stablelm.modeling_stablelm": ("StableLmDecoderLayer",),
    "transformers.models.nemotron.modeling_nemotron": ("NemotronDecoderLayer",),
}
LOSS = Change(
    "<model>.loss_function", ATTRIBUTE, MODEL,
    "`loss.CausalLMLoss` (as `_loss_function`): the loss transformers would use, with a labelled `ring_context` "
    "summed over the CP group (from the LM head's input the model's chunked loss kept, if enabled); "
    "`LOSS_MAPPING` is not changed",
)  # fmt: skip
GUARD = Change(
    "<model> forward hooks", HOOKS, MODEL,
    "`guard.watch`: a forward with a `ring_context` at CP > 1 that ran no ring attention or context-parallel mixer "
    "raises `RingNeverRan`; on a ring model, a submodule handed other `position_ids` raises",
)  # fmt: skip
ENTRY = Change(
    "<multimodal model>.language_model, its vision encoder: forward pre-hooks", HOOKS, MODEL,
    "`multimodal.attach` (Qwen3-VL, Qwen3.5, Llama 4, Gemma 3: `multimodal.VLM_FAMILIES`): a batch with images enters "
    "whole; the text decoder's entry cuts the merged embeddings and the model's positions to this rank's rows, the "
    "encoder runs without the `ring_context` on this rank's share of the images (its instance's "
    "`get_image_features`; Gemma 3's and Llama 4's `forward` carries the context to it, `carry.carry_context`); "
    "refuses what it cannot cut",
)  # fmt: skip
VISION = Change(
    "<vision encoder of a multimodal model>._check_and_adjust_attn_implementation", METHOD, PROCESS,
    "in the build hook: `\"ring\"` asked for an encoder of `multimodal.VISION_TOWERS` builds it with `\"sdpa\"` "
    "(it attends within each image, whole on every rank)",
)  # fmt: skip
MIXERS_WHY = (
    "dispatchers and adapters (`mixers.MIXER_FAMILIES`): a call with a `ring_context` (its own, or the one the "
    "enclosing forward carries, also into activation-checkpoint recomputes) runs the mixer's context-parallel "
    "form (`ops.mixers`); every other call runs the original"
)


@functools.cache
def changes() -> tuple[Change, ...]:
    """The table: the process rows, one row per routed function and adapter of ``mixers.MIXER_FAMILIES``,
    the router-loss rows (by kind: they apply to any modeling module whose loss qualifies) and the
    model rows."""
    return (ATTENTION, MASK, BUILD_HOOK, VISION, *_mixer_rows().values(), ROUTER_LOSS, ROUTER_CALLER,
            ATTENTION_CALLER, LOSS, GUARD, ENTRY)  # fmt: skip


@functools.cache
def _mixer_rows() -> dict[tuple[str, str], Change]:
    """(modeling module, function name or ``Class.method``) -> its row, from ``mixers.MIXER_FAMILIES``."""
    from .mixers import MIXER_FAMILIES

    rows = {}
    for short, family in MIXER_FAMILIES.items():
        module = _MODELS + short
        for name, route in family.functions.items():
            rows[(module, name)] = Change(f"{module}.{name}", FUNCTION, MODULE, f"{route} route")
        for target, adapter in family.adapters.items():
            method = target if "." in target else f"{target}.forward"
            rows[(module, method)] = Change(f"{module}.{method}", METHOD, MODULE, f"adapter {adapter.__name__}")
    return rows


# --- what is in effect -------------------------------------------------------------------------

_MODULES: set[str] = set()  # modeling modules whose rows are applied


def _replace(change: Change, owner: Any, name: str, make: Callable[[Any], Any]) -> None:
    """``owner.name = make(current)`` (a module's or a class's; a class's may be inherited), once,
    through the ledger. A name that is absent, or ``None``, or routed by someone else is left alone."""
    if LEDGER.find(owner, name) is not None:
        return
    current = getattr(owner, name, None)
    if current is None or hasattr(current, "hf_ring_original"):
        return
    new = make(current)
    new.hf_ring_original = current  # on hf_ring's own wrapper: the object it routes to
    LEDGER.set_attr(owner, name, new, why=change.why, scope=change.scope)


def _register_entry(change: Change, interface: Any, value: Any) -> None:
    where = f"{interface.__module__}.{interface.__name__}[{NAME!r}]"
    LEDGER.set_item(interface._global_mapping, NAME, value, why=change.why, where=where, scope=change.scope)


def original(owner: Any, name: str) -> Any:
    """What transformers has under ``owner.name`` without hf_ring (``None`` when it has nothing)."""
    return LEDGER.original(owner, name)


def installed() -> list[Entry]:
    """The changes in effect now: the ledger's entries (process, module and model rows, and what else
    hf_ring changed: models' options, trainers' changes to TRL and accelerate)."""
    return LEDGER.entries()


# --- installing ----------------------------------------------------------------------------------


def register() -> None:
    """Make ``attn_implementation="ring"`` available to transformers (idempotent): the registry
    entries and the build hook. Runs at ``import hf_ring`` (``hf_ring/__init__.py``)."""
    from transformers import AttentionInterface, PreTrainedModel
    from transformers.masking_utils import AttentionMaskInterface

    _register_entry(ATTENTION, AttentionInterface, attention_entry)
    _register_entry(MASK, AttentionMaskInterface, mask_entry)
    _replace(BUILD_HOOK, PreTrainedModel, "_check_and_adjust_attn_implementation", _build_hook)


# The registry entries import the attention module (and the ring's ops) on their first call, so
# that registering costs nothing at ``import hf_ring``.


def attention_entry(*args: Any, **kwargs: Any) -> Any:
    """The ``"ring"`` entry of ``AttentionInterface``: ``attention.ring_attention_forward``."""
    from .attention import ring_attention_forward

    return ring_attention_forward(*args, **kwargs)


def mask_entry(*args: Any, **kwargs: Any) -> Any:
    """The ``"ring"`` entry of ``AttentionMaskInterface``: ``attention.ring_mask``."""
    from .attention import ring_mask as mask

    return mask(*args, **kwargs)


def _build_hook(check: Callable) -> Callable:
    @functools.wraps(check)
    def _check_and_adjust_attn_implementation(self: Any, attn_implementation: Any, *args: Any, **kwargs: Any) -> Any:
        from .multimodal import vision_attention

        implementation = check(self, vision_attention(self, attn_implementation), *args, **kwargs)
        install_for(self, implementation)
        return implementation

    return _check_and_adjust_attn_implementation


def _pretrained(model: Any) -> Iterator[Any]:
    from transformers import PreTrainedModel

    return (m for m in model.modules() if isinstance(m, PreTrainedModel))


def install_for(model: Any, implementation: str | None = None) -> None:
    """The rows of ``model`` (a transformers model, being built or switched to ``implementation``):
    see the module docstring. Raises ``RingNotSupported`` for a model that cannot run the ring."""
    from .support import refuse_at_build

    if implementation is None:
        implementation = getattr(getattr(model, "config", None), "_attn_implementation", None)
    models = list(_pretrained(model))  # while it is built: the model alone
    if implementation == NAME:
        for m in models:
            refuse_at_build(m)
    for m in models:
        for cls in type(m).__mro__:
            module = sys.modules.get(cls.__module__)
            if module is not None and cls.__module__.startswith(_MODELS):
                install_module(module)
        _give(m)


def install_module(module: ModuleType) -> None:
    """The rows of one (imported) modeling module, once: its mixer routes and adapters, its router loss."""
    if module.__name__ in _MODULES:
        return
    from . import router
    from .carry import carry_context
    from .mixers import MIXER_ROUTES, family_of

    _MODULES.add(module.__name__)
    family = family_of(module.__name__)
    if family is not None:
        rows = _mixer_rows()
        for name, route in family.functions.items():
            _replace(rows[(module.__name__, name)], module, name, MIXER_ROUTES[route])
        for target, adapter in family.adapters.items():
            cls_name, _, method = target.partition(".")
            method = method or "forward"
            cls = getattr(module, cls_name, None)
            if cls is not None:
                _replace(rows[(module.__name__, f"{cls_name}.{method}")], cls, method, adapter)
    if router.routed(module.__name__):
        _replace(ROUTER_LOSS, module, router.FUNCTION, router.dispatcher)
        for cls in router.callers(module):
            _replace(ROUTER_CALLER, cls, "forward", carry_context)
    for cls_name in ATTENTION_CALLERS.get(module.__name__, ()):
        cls = getattr(module, cls_name, None)  # a renamed class: the guard refuses the model (RingNeverRan)
        if cls is not None:
            _replace(ATTENTION_CALLER, cls, "forward", carry_context)


def _give(model: Any) -> None:
    from .guard import watch
    from .loss import give_loss
    from .multimodal import attach

    give_loss(model, LOSS.why)
    watch(model)
    attach(model)


# --- undoing ---------------------------------------------------------------------------------------


def uninstall() -> None:
    """Undo everything: every ledger entry (every rebound name is its original object again, an inherited
    one is deleted; the registries hold what they held before, no ``"ring"``; models lose their loss,
    hooks, chunked loss, tiled MLPs, tiled layers, head groups and offload; TRL's and accelerate's objects
    are theirs again), and forget the modules, so that ``register()`` installs anew."""
    from . import guard, layers, multimodal, patches

    LEDGER.undo_all()
    # what hf_ring kept about models
    for forget in (guard.forget, multimodal.forget, patches.forget_models, layers.forget):
        forget()
    _MODULES.clear()


# --- the table in docs/architecture.md -------------------------------------------------------------

_WHEN = {PROCESS: "at registration", MODULE: "a model of that module is built", MODEL: "each model built"}


def markdown() -> str:
    """The table as docs/architecture.md shows it: one line per row, the mixer rows one line per module."""
    lines = ["| what changes | kind | when | effect |", "|---|---|---|---|"]
    mixers = _mixer_rows()
    by_module: dict[str, list[str]] = {}
    kinds: dict[str, set[str]] = {}
    for (module, name), row in mixers.items():
        by_module.setdefault(module, []).append(f"`{name}` ({row.why.removeprefix('adapter ').removesuffix(' route')})")
        kinds.setdefault(module, set()).add(row.kind)
    for row in changes():
        if row.kind == FUNCTION and row.scope == MODULE and row is not ROUTER_LOSS:
            continue  # in its module's line
        if row.kind == METHOD and row.scope == MODULE and row not in (ROUTER_CALLER, ATTENTION_CALLER):
            continue
        lines.append(f"| `{row.target}` | {row.kind} | {_WHEN[row.scope]} | {row.why} |")
        if row is BUILD_HOOK:
            for i, (module, names) in enumerate(by_module.items()):
                why = MIXERS_WHY if i == 0 else "as above"
                kind = ", ".join(f"{k}s" for k in sorted(kinds[module], reverse=True))
                lines.append(f"| `{module}`: {', '.join(names)} | {kind} | {_WHEN[MODULE]} | {why} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(markdown(), end="")
