"""The MoE router's load-balancing loss of a sharded batch: the whole sequence's, on every rank.

transformers' MoE causal LMs (Mixtral, Qwen2/3-MoE, OLMoE, GPT-OSS, ...) add
``router_aux_loss_coef * load_balancing_loss_func(router_logits, E, top_k, attention_mask)`` to
the language-model loss, a module-level function of their modeling module called from the
``ForCausalLM`` forward. On a CP rank that would be the loss of its own shard. For a modeling
module whose ``load_balancing_loss_func`` computes the Switch loss (checked on a small input
against ``hf_ring.ops.router_loss``, ``routed``), ``hf_ring.transformers.install`` binds, when a
model of that module is built:

- ``load_balancing_loss_func`` to ``dispatcher(fn)``: inside a forward that carries a
  ``ring_context`` it returns ``ops.router_loss.load_balancing_loss`` over the CP group -- the
  expert counts, router probabilities and token counts of every rank summed, padding excluded (the
  context's ``real`` rows: the tokens of the batch, as transformers' ``attention_mask`` excludes
  them), the backward scaled by the CP size; every other call goes to the original;
- the ``forward`` of the module's classes that call it (``callers``) to ``carry.carry_context``,
  which makes the call's ``ring_context`` the one of the forward running now (``carry.ACTIVE``)
  for the dispatcher, which transformers calls without the forward's keyword arguments.

``routed(modeling_module)`` says whether a module's loss has that form (``support.check_layer``
refuses the router loss at CP > 1 for the others). This module rebinds nothing itself.
"""

from __future__ import annotations

import functools
import inspect
import math
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch
from torch import Tensor

from ..errors import RingNotSupported
from ..ops.router_loss import load_balancing_loss
from .carry import ACTIVE

__all__ = ["FUNCTION", "callers", "dispatcher", "routed"]

FUNCTION = "load_balancing_loss_func"
_ROUTED: dict[str, bool] = {}  # modeling module -> its router loss has a context-parallel form
_CHECKED: dict[tuple, bool] = {}  # bytecode of a load-balancing function -> it computes the Switch loss


def routed(modeling_module: str) -> bool:
    """``modeling_module`` (imported) defines the Switch load-balancing loss and calls it from a
    ``forward``: hf_ring computes it over the CP group. Decided once per module."""
    if modeling_module not in _ROUTED:
        module = sys.modules.get(modeling_module)
        fn = getattr(module, FUNCTION, None) if module is not None else None
        fn = getattr(fn, "hf_ring_original", fn)
        _ROUTED[modeling_module] = fn is not None and _same_loss(fn) and bool(callers(module))
    return _ROUTED[modeling_module]


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
    # on the CPU whatever device the caller set as default (a model built under ``torch.device("meta")``
    # is checked while that is in force): meta tensors have no value to compare
    with torch.device("cpu"):
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


def dispatcher(fn: Callable) -> Callable:
    """``load_balancing_loss_func`` over the CP group under the forward's ``ring_context``; ``fn`` otherwise."""

    @functools.wraps(fn)
    def load_balancing_loss_func(
        gate_logits: Any, num_experts: int | None = None, top_k: int = 2, attention_mask: Tensor | None = None
    ) -> Any:
        ctx = ACTIVE.get()
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


def callers(module: ModuleType) -> list[type]:
    """Classes of ``module`` whose own ``forward`` calls the load-balancing loss (names it as a global)."""
    out = []
    for obj in vars(module).values():
        if not (isinstance(obj, type) and obj.__module__ == module.__name__ and "forward" in vars(obj)):
            continue
        code = getattr(inspect.unwrap(obj.forward), "__code__", None)
        if code is not None and FUNCTION in code.co_names:
            out.append(obj)
    return out
