"""The MoE router's load-balancing loss of a sharded batch: the whole sequence's, on every rank.

transformers' MoE causal LMs (Mixtral, Qwen2/3-MoE, OLMoE, GPT-OSS, ...) add
``router_aux_loss_coef * load_balancing_loss_func(router_logits, E, top_k, attention_mask)`` to
the language-model loss, a module-level function of their modeling module called from the
``ForCausalLM`` forward. On a CP rank that would be the loss of its own shard. ``install()``
rebinds, in every modeling module whose ``load_balancing_loss_func`` computes the Switch loss
(checked on a small input against ``hf_ring.ops.router_loss`` before anything is rebound):

- ``load_balancing_loss_func`` to a dispatcher: inside a forward that carries a ``ring_context``
  it returns ``ops.router_loss.load_balancing_loss`` over the CP group -- the expert counts, router
  probabilities and token counts of every rank summed, padding excluded (the context's ``real``
  rows: the tokens of the batch, as transformers' ``attention_mask`` excludes them), the backward
  scaled by the CP size; every other call goes to the original;
- the ``forward`` of the module's classes that call it, to carry the call's ``ring_context`` to the
  dispatcher (a ``ContextVar`` set for the duration of that forward, nothing kept after it).

``routed(modeling_module)`` says whether a module's loss is routed (``support.check_layer``
refuses the router loss at CP > 1 for the others). Every rebinding is listed in
docs/architecture.md.
"""

from __future__ import annotations

import contextvars
import functools
import importlib
import inspect
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ..ops.router_loss import load_balancing_loss
from .context import RingContext
from .support import RingNotSupported

__all__ = ["install", "routed"]

FUNCTION = "load_balancing_loss_func"
_ACTIVE: contextvars.ContextVar[RingContext | None] = contextvars.ContextVar("hf_ring_router_context", default=None)
_ROUTED: set[str] = set()
_CHECKED: dict[tuple, bool] = {}  # bytecode of a load-balancing function -> it computes the Switch loss


def routed(modeling_module: str) -> bool:
    """``modeling_module``'s router load-balancing loss is computed over the CP group."""
    return modeling_module in _ROUTED


def _same_loss(fn: Callable) -> bool:
    """``fn`` is the Switch load-balancing loss ``ops.router_loss`` computes: same value on two small
    inputs (with and without an attention mask), float64. Checked once per distinct bytecode (most
    modeling modules hold the same copy)."""
    code = getattr(fn, "__code__", None)
    if code is None:
        return False
    key = (code.co_code, code.co_names, tuple(c for c in code.co_consts if not isinstance(c, str)))
    if key not in _CHECKED:
        _CHECKED[key] = _same_value(fn)
    return _CHECKED[key]


def _same_value(fn: Callable) -> bool:
    g = torch.Generator().manual_seed(0)
    logits = tuple(torch.randn(2 * 5, 4, generator=g, dtype=torch.float64) for _ in range(3))
    mask = torch.ones(2, 5, dtype=torch.long)
    mask[1, 3:] = 0
    try:
        for m in (None, mask):
            want = fn(logits, 4, 2, m)
            got = load_balancing_loss(logits, 4, 2, None if m is None else m.reshape(-1))
            if not isinstance(want, Tensor) or not math.isclose(float(want), float(got), rel_tol=1e-6):
                return False
    except Exception:  # noqa: BLE001 - another signature or formula: leave the module alone
        return False
    return True


def _dispatcher(fn: Callable) -> Callable:
    @functools.wraps(fn)
    def load_balancing_loss_func(
        gate_logits: Any, num_experts: int | None = None, top_k: int = 2, attention_mask: Tensor | None = None
    ) -> Any:
        ctx = _ACTIVE.get()
        if ctx is None or gate_logits is None or not isinstance(gate_logits, tuple) or num_experts is None:
            return fn(gate_logits, num_experts, top_k, attention_mask)
        real = ctx.real
        rows = gate_logits[0].reshape(-1, gate_logits[0].shape[-1]).shape[0]
        if real is None or rows != real.numel():
            raise RingNotSupported(
                f"{FUNCTION}: got router logits for {rows} tokens under a ring_context whose shard holds "
                f"{None if real is None else real.numel()}; the router loss under context parallelism needs "
                "the whole local shard (no cache, no decoding)."
            )
        return load_balancing_loss(
            gate_logits, num_experts, top_k, real.reshape(-1), ctx.group, ctx.size, float(ctx.size)
        )

    return load_balancing_loss_func


def _carrier(forward: Callable) -> Callable:
    @functools.wraps(forward)
    def carrying_forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        ctx = kwargs.get("ring_context")
        if ctx is None:
            return forward(self, *args, **kwargs)
        token = _ACTIVE.set(ctx)
        try:
            return forward(self, *args, **kwargs)
        finally:
            _ACTIVE.reset(token)

    return carrying_forward


def _callers(module: Any) -> list[type]:
    """Classes of ``module`` whose own ``forward`` calls the load-balancing loss (names it as a global)."""
    out = []
    for obj in vars(module).values():
        if not (isinstance(obj, type) and obj.__module__ == module.__name__ and "forward" in vars(obj)):
            continue
        code = getattr(inspect.unwrap(obj.forward), "__code__", None)
        if code is not None and FUNCTION in code.co_names:
            out.append(obj)
    return out


def _modules() -> list[str]:
    """transformers modeling modules that define the load-balancing loss (read from source, not imported)."""
    import transformers

    root = Path(transformers.__file__).parent / "models"
    found = []
    for path in sorted(root.glob("*/modeling_*.py")):
        try:
            text = path.read_text(encoding="utf-8")
        except OSError:
            continue
        if f"def {FUNCTION}(" in text:
            found.append(f"transformers.models.{path.parent.name}.{path.stem}")
    return found


def install() -> list[str]:
    """Route the load-balancing loss of every modeling module that computes the Switch loss
    (idempotent); returns the routed modules. Modules that fail to import are skipped."""
    for name in _modules():
        if name in _ROUTED:
            continue
        try:
            module = importlib.import_module(name)
        except Exception:  # noqa: BLE001 - optional dependencies of some models
            continue
        fn = getattr(module, FUNCTION, None)
        if fn is None or hasattr(fn, "hf_ring_original") or not _same_loss(fn):
            continue
        callers = _callers(module)
        if not callers:
            continue
        dispatcher = _dispatcher(fn)
        dispatcher.hf_ring_original = fn  # type: ignore[attr-defined]
        setattr(module, FUNCTION, dispatcher)
        for cls in callers:
            if not hasattr(cls.forward, "hf_ring_original"):
                wrapped = _carrier(cls.forward)
                wrapped.hf_ring_original = cls.forward  # type: ignore[attr-defined]
                cls.forward = wrapped
        _ROUTED.add(name)
    return sorted(_ROUTED)
