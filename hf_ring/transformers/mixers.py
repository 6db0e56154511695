"""Route the token mixers of hybrid models through their context-parallel forms.

In transformers 5 the hybrid mixers (Gated DeltaNet, KDA, Mamba, Mamba2, short convolutions, ...)
call module-level kernel functions of their modeling module (``causal_conv1d_fn``,
``torch_chunk_gated_delta_rule``, ...) and pass them their ``**kwargs``, which carry the batch's
``ring_context`` from ``shard_batch``. ``install()`` rebinds those names, module by module
(``FAMILIES``), to dispatchers:

- a call with a ``ring_context`` goes to the op's context-parallel form (``hf_ring.ops.mixers``),
  which calls the original function -- the installed fla / causal-conv1d / mamba-ssm kernel, or
  transformers' torch fallback -- for the local compute; also at ``cp_size = 1`` when the batch
  holds packed documents (each document then restarts its state and convolution exactly);
- every other call goes to the original, unchanged.

Adding a family is one entry: its modeling module, the function names with their route
(``ROUTES``: ``"conv"``, ``"delta"``, ...), and the mixer classes the routes make exact (what
``support.check_layer`` stops refusing). Rebinding is idempotent; ``original(module, name)`` gives
back what transformers had. Every rebinding is listed in docs/architecture.md.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

from ..ops.mixers.conv import causal_conv1d, conv_plan
from ..ops.mixers.delta import delta_plan, delta_rule
from .context import RingContext
from .support import RingNotSupported

__all__ = ["FAMILIES", "ROUTES", "Family", "install", "original", "routed_classes"]

Route = Callable[[Callable], Callable]  # the original function -> its dispatcher
_MODELS = "transformers.models."


def _needs_cp(ctx: RingContext | None) -> bool:
    return ctx is not None and (ctx.size > 1 or ctx.layout.packed)


def _check_rows(ctx: RingContext, rows: int, what: str) -> None:
    if rows != ctx.layout.local:
        raise RingNotSupported(
            f"{what}: got {rows} tokens per row under a ring_context whose shard holds {ctx.layout.local}; "
            "a mixer under context parallelism must see the whole local shard (no cache, no decoding)."
        )


def conv_route(fn: Callable) -> Callable:
    """``causal_conv1d_fn(x [B, C, S], weight [C, K], bias, activation=None, **kwargs)``."""

    @functools.wraps(fn)
    def causal_conv1d_fn(hidden_states: Tensor, weight: Tensor, bias: Tensor | None = None,
                         activation: str | None = None, **kwargs: Any) -> Tensor:  # fmt: skip
        ctx = kwargs.get("ring_context")
        if not _needs_cp(ctx):
            return fn(hidden_states, weight, bias, activation=activation, **kwargs)
        _check_rows(ctx, hidden_states.shape[-1], "causal_conv1d_fn")
        b, width = hidden_states.shape[0], weight.shape[-1] - 1
        plan = ctx.cached(("conv", b, width), lambda: conv_plan(ctx.layout, b, ctx.rank, width))

        def local(x: Tensor, w: Tensor, bias_: Tensor | None, activation: str | None = None) -> Tensor:
            return fn(x, w, bias_, activation=activation)

        return causal_conv1d(hidden_states, weight, bias, activation, plan, ctx.group, conv=local)

    return causal_conv1d_fn


def delta_route(fn: Callable) -> Callable:
    """``rule(query, key, value, g, beta, chunk_size=64, initial_state=None, output_final_state=False,
    use_qk_l2norm_in_kernel=False, **kwargs) -> (out, final state)``: transformers' chunked gated
    delta rules (``torch_chunk_gated_delta_rule``, ``chunk_kimi_delta_attention``) and fla's."""

    @functools.wraps(fn)
    def rule(query: Tensor, key: Tensor, value: Tensor, g: Tensor, beta: Tensor, chunk_size: int = 64,
             initial_state: Tensor | None = None, output_final_state: bool = False,
             use_qk_l2norm_in_kernel: bool = False, **kwargs: Any) -> tuple[Tensor, Tensor | None]:  # fmt: skip
        ctx = kwargs.get("ring_context")
        if not _needs_cp(ctx):
            return fn(query, key, value, g=g, beta=beta, chunk_size=chunk_size, initial_state=initial_state,
                      output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                      **kwargs)  # fmt: skip
        if initial_state is not None or output_final_state:
            raise RingNotSupported(
                f"{fn.__name__} under context parallelism runs the whole sharded sequence from a zero state; "
                "a cache (initial or final recurrent state) is not supported. Pass use_cache=False "
                "(shard_batch does) and generate without context parallelism."
            )
        _check_rows(ctx, query.shape[1], fn.__name__)
        b = query.shape[0]
        plan = ctx.cached(("delta", b), lambda: delta_plan(ctx.layout, b, ctx.rank))

        def local(q: Tensor, k: Tensor, v: Tensor, g_: Tensor, beta_: Tensor, **kw: Any) -> tuple:
            return fn(q, k, v, g=g_, beta=beta_, **kw)

        out = delta_rule(local, query, key, value, g, beta, plan, ctx.group, chunk_size=chunk_size,
                         use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)  # fmt: skip
        return out, None

    return rule


ROUTES: dict[str, Route] = {"conv": conv_route, "delta": delta_route}


@dataclass(frozen=True)
class Family:
    """One modeling module's routes: ``functions`` (module-level name -> key of ``ROUTES``) and the
    mixer ``classes`` those routes make exact."""

    functions: dict[str, str]
    classes: tuple[str, ...]
    adapters: dict[str, Callable] = field(default_factory=dict)  # class name -> forward adapter


_GDN = {"causal_conv1d_fn": "conv", "torch_chunk_gated_delta_rule": "delta"}
_KDA = {"causal_conv1d_fn": "conv", "chunk_kimi_delta_attention": "delta"}
_CONV = {"causal_conv1d_fn": "conv"}

# modeling module (under transformers.models.) -> its routes
FAMILIES: dict[str, Family] = {
    "qwen3_5.modeling_qwen3_5": Family(_GDN, ("Qwen3_5GatedDeltaNet",)),
    "qwen3_5_moe.modeling_qwen3_5_moe": Family(_GDN, ("Qwen3_5MoeGatedDeltaNet",)),
    "qwen3_next.modeling_qwen3_next": Family(_GDN, ("Qwen3NextGatedDeltaNet",)),
    "olmo_hybrid.modeling_olmo_hybrid": Family(
        _GDN, ("OlmoHybridGatedDeltaNet", "OlmoHybridLinearAttentionDecoderLayer")
    ),
    "lara_mini.modeling_lara_mini": Family(_GDN, ("LaraMiniGatedDeltaNet",)),
    "kimi_linear.modeling_kimi_linear": Family(_KDA, ("KimiLinearDeltaAttention", "KimiLinearAttention")),
    "bailing_hybrid.modeling_bailing_hybrid": Family(_KDA, ("BailingHybridDeltaAttention",)),
    "lfm2.modeling_lfm2": Family(_CONV, ("Lfm2ShortConv",)),
    "lfm2_moe.modeling_lfm2_moe": Family(_CONV, ("Lfm2MoeShortConv",)),
    "lfm3.modeling_lfm3": Family(_CONV, ("Lfm3ShortConv",)),
}


def routed_classes(modeling_module: str) -> tuple[str, ...]:
    """The mixer classes of a modeling module that run exactly under context parallelism."""
    family = FAMILIES.get(modeling_module.removeprefix(_MODELS))
    return family.classes if family is not None else ()


def original(module: Any, name: str) -> Callable:
    """What transformers had under ``module.name`` before ``install`` rebound it."""
    fn = getattr(module, name)
    return getattr(fn, "hf_ring_original", fn)


def install() -> list[str]:
    """Rebind every function of ``FAMILIES`` to its dispatcher (idempotent); returns the rebound
    ``module.name``s. Modules this transformers lacks are skipped."""
    done = []
    for short, family in FAMILIES.items():
        try:
            module = importlib.import_module(_MODELS + short)
        except ImportError:
            continue
        for name, route in family.functions.items():
            fn = getattr(module, name, None)
            if fn is None:
                continue
            if not hasattr(fn, "hf_ring_original"):
                dispatcher = ROUTES[route](fn)
                dispatcher.hf_ring_original = fn  # type: ignore[attr-defined]
                setattr(module, name, dispatcher)
            done.append(f"{short}.{name}")
        for cls_name, adapter in family.adapters.items():
            cls = getattr(module, cls_name, None)
            if cls is not None and not hasattr(cls.forward, "hf_ring_original"):
                forward = adapter(cls.forward)
                forward.hf_ring_original = cls.forward
                cls.forward = forward
    return done
