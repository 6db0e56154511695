"""Route the token mixers of hybrid models through their context-parallel forms.

In transformers 5 the hybrid mixers (Gated DeltaNet, KDA, Mamba, Mamba2, short convolutions, ...)
call module-level kernel functions of their modeling module (``causal_conv1d_fn``,
``torch_chunk_gated_delta_rule``, ...) and pass them their ``**kwargs``, which carry the batch's
``ring_context`` from ``shard_batch``. ``MIXER_FAMILIES`` names, module by module, the dispatchers those
names get (``hf_ring.transformers.install`` binds them, for the modeling module of a model being
built):

- a call with a ``ring_context`` goes to the op's context-parallel form (``hf_ring.ops.mixers``),
  which calls the original function -- the installed fla / causal-conv1d / mamba-ssm kernel, or
  transformers' torch fallback -- for the local compute; also at ``cp_size = 1`` when the batch
  holds packed documents (each document then restarts its state and convolution exactly);
- every other call goes to the original, unchanged.

Adding a family is one entry: its modeling module, the function names with their route
(``MIXER_ROUTES``: ``"conv"``, ``"delta"``, ``"ssd"``, ``"selective"``, ``"unfused"``), the mixer classes
the routes make exact (what ``support.check_layer`` stops refusing), and ``adapters`` for mixers
that call a kernel without their ``**kwargs`` (``carry_context``) or compute inline
(``lightning_forward``, ``recurrent_block_forward``, ``rnn_scan_method``). This module rebinds
nothing itself; every rebinding is a row of ``install.CHANGES`` (listed in docs/architecture.md).
"""

from __future__ import annotations

import functools
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from ..errors import RingNotSupported
from ..ops.mixers.conv import causal_conv1d, conv_plan
from ..ops.mixers.delta import delta_plan, delta_rule
from ..ops.mixers.diagonal import diagonal_plan, diagonal_recurrence
from ..ops.mixers.lightning import lightning_attention
from ..ops.mixers.selective import selective_plan, selective_scan
from ..ops.mixers.ssd import ssd_plan, ssd_scan
from .carry import ACTIVE as _ACTIVE
from .carry import carry_context
from .carry import context_of as _context
from .carry import needs_cp as _needs_cp
from .context import RingContext

__all__ = ["MIXER_FAMILIES", "MIXER_ROUTES", "Family", "family_of", "routed_classes"]

Route = Callable[[Callable], Callable]  # the original function -> its dispatcher
_MODELS = "transformers.models."


def _name(fn: Callable) -> str:
    """The name of a kernel function; transformers >= 5.25 hands out ``kernels`` hub wrappers (an
    ``nn.Module`` per function, named ``Func``) that hold the function they wrap in their forward."""
    if hasattr(fn, "__name__"):
        return fn.__name__
    cells = getattr(getattr(type(fn), "forward", None), "__closure__", None) or ()
    names = [getattr(c.cell_contents, "__name__", None) for c in cells if callable(c.cell_contents)]
    names = [n for n in names if isinstance(n, str)]
    return names[0] if names else type(fn).__name__


def _decode() -> Any:
    """``hf_ring.transformers.decode`` (imported on use: it imports ``support``, which imports this module)."""
    from . import decode

    return decode


def _check_rows(ctx: RingContext, rows: int, what: str) -> None:
    """Refuse a call that does not see the whole local shard; count the call (the guard reads it)."""
    ctx.cross_rank_calls.mixer_ran()
    if rows != ctx.layout.local:
        raise RingNotSupported(
            f"{what}: got {rows} tokens per row under a ring_context whose shard holds {ctx.layout.local}; "
            "a mixer under context parallelism must see the whole local shard (no cache, no decoding)."
        )


def _no_cache(fn: Callable, has_cache: bool) -> None:
    if has_cache:
        raise RingNotSupported(
            f"{_name(fn)} under context parallelism runs the whole sharded sequence from a zero state; "
            "a cache (initial or final recurrent state) is not supported. Pass use_cache=False "
            "(shard_batch does) and generate without context parallelism."
        )


def conv_route(fn: Callable) -> Callable:
    """``causal_conv1d_fn(x [B, C, S], weight [C, K], bias, activation=None, **kwargs)``."""

    @functools.wraps(fn)
    def causal_conv1d_fn(hidden_states: Tensor, weight: Tensor, bias: Tensor | None = None,
                         activation: str | None = None, **kwargs: Any) -> Tensor:  # fmt: skip
        ctx = _context(kwargs)
        step = ctx.decode if ctx is not None else None  # greedy decoding under CP (decode.py)
        if step is not None and step.decoding:
            return _decode().conv(fn, ctx, hidden_states, weight, bias, activation)
        if not _needs_cp(ctx):
            out = fn(hidden_states, weight, bias, activation=activation, **kwargs)
        else:
            _check_rows(ctx, hidden_states.shape[-1], "causal_conv1d_fn")
            b, width, dev = hidden_states.shape[0], weight.shape[-1] - 1, hidden_states.device
            plan = ctx.cached(("conv", b, width, dev), lambda: conv_plan(ctx.layout, b, ctx.rank, width, dev))

            def local(x: Tensor, w: Tensor, bias_: Tensor | None, activation: str | None = None) -> Tensor:
                return fn(x, w, bias_, activation=activation)

            out = causal_conv1d(hidden_states, weight, bias, activation, plan, ctx.group, conv=local)
        if step is not None:  # a prefill for decoding keeps the input's last rows
            _decode().keep_conv(ctx, hidden_states, weight.shape[-1] - 1)
        return out

    return causal_conv1d_fn


def delta_route(fn: Callable) -> Callable:
    """``rule(query, key, value, g, beta, chunk_size=64, initial_state=None, output_final_state=False,
    use_qk_l2norm_in_kernel=False, **kwargs) -> (out, final state)``: transformers' chunked gated
    delta rules (``torch_chunk_gated_delta_rule``, ``chunk_kimi_delta_attention``) and fla's."""

    @functools.wraps(fn)
    def rule(query: Tensor, key: Tensor, value: Tensor, g: Tensor, beta: Tensor, chunk_size: int = 64,
             initial_state: Tensor | None = None, output_final_state: bool = False,
             use_qk_l2norm_in_kernel: bool = False, **kwargs: Any) -> tuple[Tensor, Tensor | None]:  # fmt: skip
        ctx = _context(kwargs)
        step = ctx.decode if ctx is not None else None  # greedy decoding under CP (decode.py)
        if step is not None and step.decoding:
            _no_cache(fn, initial_state is not None)
            return _decode().delta(fn, ctx, query, key, value, g, beta, chunk_size=chunk_size,
                                   use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, **kwargs)  # fmt: skip
        if not _needs_cp(ctx):
            out = fn(query, key, value, g=g, beta=beta, chunk_size=chunk_size, initial_state=initial_state,
                     output_final_state=output_final_state or step is not None,
                     use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, **kwargs)  # fmt: skip
            if step is not None:  # a prefill for decoding keeps the state after the prompt
                _decode().keep_state(ctx, out[1])
                return out[0], None
            return out
        _no_cache(fn, initial_state is not None or output_final_state)
        _check_rows(ctx, query.shape[1], _name(fn))
        b, dev = query.shape[0], query.device
        plan = ctx.cached(("delta", b, dev), lambda: delta_plan(ctx.layout, b, ctx.rank, dev))

        def local(q: Tensor, k: Tensor, v: Tensor, g_: Tensor, beta_: Tensor, **kw: Any) -> tuple:
            return fn(q, k, v, g=g_, beta=beta_, **kw)

        out = delta_rule(local, query, key, value, g, beta, plan, ctx.group, chunk_size=chunk_size,
                         use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, final_state=step is not None)  # fmt: skip
        if step is not None:  # a prefill for decoding keeps the state after the prompt
            _decode().keep_state(ctx, out[1])
            return out[0], None
        return out, None

    return rule


def ssd_route(fn: Callable) -> Callable:
    """``mamba2_chunk_scan(x, dt, A, B, C, chunk_size, D=None, dt_bias=None, initial_states=None,
    dt_softplus=False, dt_limit=(0, inf), return_final_states=False, **kwargs)``: transformers' SSD
    chunk scan of the Mamba2 mixers, or mamba-ssm's ``mamba_chunk_scan_combined``."""

    @functools.wraps(fn)
    def scan(hidden_states: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, chunk_size: int,
             D: Tensor | None = None, dt_bias: Tensor | None = None, initial_states: Tensor | None = None,
             dt_softplus: bool = False, dt_limit: tuple[float, float] = (0.0, math.inf),
             return_final_states: bool = False, **kwargs: Any) -> Any:  # fmt: skip
        ctx = _context(kwargs)
        if not _needs_cp(ctx):
            return fn(hidden_states, dt, A, B, C, chunk_size=chunk_size, D=D, dt_bias=dt_bias,
                      initial_states=initial_states, dt_softplus=dt_softplus, dt_limit=dt_limit,
                      return_final_states=return_final_states, **kwargs)  # fmt: skip
        _no_cache(fn, initial_states is not None or return_final_states)
        if kwargs.get("z") is not None:
            raise RingNotSupported(
                f"{_name(fn)} with a gate z inside the scan is not supported under context parallelism "
                "(the transformers mixers gate in their norm); run this model without context parallelism."
            )
        _check_rows(ctx, hidden_states.shape[1], _name(fn))
        b, dev = hidden_states.shape[0], hidden_states.device
        plan = ctx.cached(("ssd", b, dev), lambda: ssd_plan(ctx.layout, b, ctx.rank, dev))

        def local(x: Tensor, dt_: Tensor, a: Tensor, b_: Tensor, c: Tensor, chunk: int, **kw: Any) -> Any:
            return fn(x, dt_, a, b_, c, chunk_size=chunk, **kw)

        return ssd_scan(local, hidden_states, dt, A, B, C, plan, ctx.group, chunk_size=chunk_size, D=D,
                        dt_bias=dt_bias, dt_softplus=dt_softplus, dt_limit=dt_limit)  # fmt: skip

    return scan


def selective_route(fn: Callable) -> Callable:
    """``mamba_selective_scan(u, dt, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
    return_last_state=False, **kwargs)``: transformers' selective scan of the Mamba mixers, or
    mamba-ssm's ``selective_scan_fn``."""

    @functools.wraps(fn)
    def scan(hidden_states: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor | None = None,
             z: Tensor | None = None, delta_bias: Tensor | None = None, delta_softplus: bool = False,
             return_last_state: bool = False, **kwargs: Any) -> Any:  # fmt: skip
        ctx = _context(kwargs)
        if not _needs_cp(ctx):
            return fn(hidden_states, dt, A, B, C, D=D, z=z, delta_bias=delta_bias, delta_softplus=delta_softplus,
                      return_last_state=return_last_state, **kwargs)  # fmt: skip
        _no_cache(fn, return_last_state)
        _check_rows(ctx, hidden_states.shape[-1], _name(fn))
        b, dev = hidden_states.shape[0], hidden_states.device
        plan = ctx.cached(("selective", b, dev), lambda: selective_plan(ctx.layout, b, ctx.rank, dev))
        options = {k: v for k, v in kwargs.items() if k in ("use_mambapy", "use_associative_scan")}

        def local(u: Tensor, dt_: Tensor, a: Tensor, b_: Tensor, c: Tensor, **kw: Any) -> Any:
            return fn(u, dt_, a, b_, c, **kw)

        return selective_scan(local, hidden_states, dt, A, B, C, plan, ctx.group, D=D, z=z, delta_bias=delta_bias,
                              delta_softplus=delta_softplus, **options)  # fmt: skip

    return scan


def unfused_route(fn: Callable) -> Callable:
    """A fused kernel of a whole mixer (mamba-ssm's ``mamba_split_conv1d_scan_combined`` and
    ``mamba_inner_fn``): under a ``ring_context`` it returns ``None``, which makes the mixer take its
    unfused path (convolution and scan, each routed); every other call goes to the kernel."""

    @functools.wraps(fn)
    def fused(*args: Any, **kwargs: Any) -> Any:
        if _needs_cp(_context(kwargs)):
            return None
        return fn(*args, **kwargs)

    return fused


def lightning_forward(forward: Callable) -> Callable:
    """``MiniMaxLightningAttention.forward`` (its recurrence is inline, no kernel function to route):
    with a ``ring_context`` the same projections, norm and gate around ``ops.mixers.lightning``;
    every other call goes to the original."""

    @functools.wraps(forward)
    def wrapped(self: Any, hidden_states: Tensor, *args: Any, **kwargs: Any) -> Any:
        ctx = kwargs.get("ring_context")
        if not _needs_cp(ctx):
            return forward(self, hidden_states, *args, **kwargs)
        _no_cache(forward, kwargs.get("cache") is not None or kwargs.get("past_key_values") is not None)
        b, s, _ = hidden_states.shape
        _check_rows(ctx, s, type(self).__name__)
        h, d = self.num_attention_heads, self.head_dim
        qkv = self.act_fn(self.qkv_proj(hidden_states))
        mask = kwargs.get("attention_mask", args[1] if len(args) > 1 else None)
        if mask is not None:
            qkv = sys.modules[type(self).__module__].apply_mask_to_padding_states(qkv, mask)
        q, k, v = qkv.view(b, s, h, 3 * d).split(d, dim=3)
        dev = hidden_states.device
        plan = ctx.cached(("ssd", b, dev), lambda: ssd_plan(ctx.layout, b, ctx.rank, dev))
        out = lightning_attention(q, k, v, self.slope_rate.reshape(h), plan, ctx.group, block_size=self.block_size)
        out = self.norm(out.reshape(b, s, h * d))
        out = self.out_proj(torch.sigmoid(self.output_gate(hidden_states)) * out)
        return out, None

    return wrapped


def recurrent_block_forward(forward: Callable) -> Callable:
    """``RecurrentGemmaRecurrentBlock.forward`` (its convolution is an ``nn.Conv1d`` called inline):
    with a ``ring_context`` the same branches around ``ops.mixers.conv.causal_conv1d`` and the RG-LRU,
    whose scan (``rnn_scan_method``) sees the context; no cache. Every other call: the original."""

    @functools.wraps(forward)
    def wrapped(self: Any, input_states: Tensor, *args: Any, **kwargs: Any) -> Any:
        ctx = kwargs.get("ring_context")
        if not _needs_cp(ctx):
            return forward(self, input_states, *args, **kwargs)
        position_ids = kwargs["position_ids"] if "position_ids" in kwargs else args[0]
        b, s, _ = input_states.shape
        _check_rows(ctx, s, type(self).__name__)
        self.conv1d_state, self.rg_lru.recurrent_states = None, None  # no cache under context parallelism
        y = self.act_fn(self.linear_y(input_states))
        x = self.linear_x(input_states).transpose(1, 2)
        weight = self.conv_1d.weight[:, 0]
        width, dev = weight.shape[-1] - 1, x.device
        plan = ctx.cached(("conv", b, width, dev), lambda: conv_plan(ctx.layout, b, ctx.rank, width, dev))
        x = causal_conv1d(x, weight, self.conv_1d.bias, None, plan, ctx.group)
        token = _ACTIVE.set(ctx)
        try:
            x = self.rg_lru(x.transpose(1, 2), position_ids)
        finally:
            _ACTIVE.reset(token)
            self.rg_lru.recurrent_states = None
        return self.linear_out(x * y), None

    return wrapped


def rnn_scan_method(scan: Callable) -> Callable:
    """``RecurrentGemmaRglru._rnn_scan(hidden_states, recurrent_gate, reset, recurrent_states,
    acc_dtype)``: under the block's ``ring_context``, ``ops.mixers.diagonal`` over the CP group."""

    @functools.wraps(scan)
    def wrapped(self: Any, hidden_states: Tensor, recurrent_gate: Tensor, reset: Tensor,
                recurrent_states: Tensor | None = None, acc_dtype: torch.dtype = torch.float32) -> Any:  # fmt: skip
        ctx = _ACTIVE.get()
        if not _needs_cp(ctx):
            return scan(self, hidden_states, recurrent_gate, reset, recurrent_states, acc_dtype)
        _no_cache(scan, recurrent_states is not None)
        b, dev = hidden_states.shape[0], hidden_states.device
        plan = ctx.cached(("diagonal", b, dev), lambda: diagonal_plan(ctx.layout, b, ctx.rank, dev))
        out = diagonal_recurrence(recurrent_gate * ~reset, hidden_states, plan, ctx.group)
        return out.to(hidden_states.dtype), None

    return wrapped


MIXER_ROUTES: dict[str, Route] = {"conv": conv_route, "delta": delta_route, "ssd": ssd_route,
                                  "selective": selective_route, "unfused": unfused_route}  # fmt: skip


@dataclass(frozen=True)
class Family:
    """One modeling module's routes: ``functions`` (module-level name -> key of ``MIXER_ROUTES``) and the
    mixer ``classes`` those routes make exact."""

    functions: dict[str, str]
    classes: tuple[str, ...]
    adapters: dict[str, Callable] = field(default_factory=dict)  # "Class" or "Class.method" -> adapter


_GDN = {"causal_conv1d_fn": "conv", "torch_chunk_gated_delta_rule": "delta"}
_KDA = {"causal_conv1d_fn": "conv", "chunk_kimi_delta_attention": "delta"}
_CONV = {"causal_conv1d_fn": "conv"}
_MAMBA = {"causal_conv1d_fn": "conv", "mamba_selective_scan": "selective", "mamba_inner_fn": "unfused"}
_SSD = {"causal_conv1d_fn": "conv", "mamba2_chunk_scan": "ssd", "mamba2_split_conv1d_scan_combined": "unfused"}



def _carried(*classes: str) -> dict[str, Callable]:
    """``carry_context`` on the ``forward`` of ``classes`` (a causal LM that calls its model without
    its keyword arguments, and the model, which calls its blocks without them)."""
    return dict.fromkeys(classes, carry_context)


# modeling module (under transformers.models.) -> its routes
MIXER_FAMILIES: dict[str, Family] = {
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
    "nemotron_h.modeling_nemotron_h": Family(_SSD, ("NemotronHMamba2Mixer",)),
    "granitemoehybrid.modeling_granitemoehybrid": Family(_SSD, ("GraniteMoeHybridMambaLayer",)),
    "bamba.modeling_bamba": Family(_SSD, ("BambaMixer",)),
    "falcon_h1.modeling_falcon_h1": Family(_SSD, ("FalconH1Mixer",)),
    "zamba2.modeling_zamba2": Family(_SSD, ("Zamba2MambaMixer", "Zamba2MambaDecoderLayer")),
    "minimax.modeling_minimax": Family(
        {}, ("MiniMaxLightningAttention",), {"MiniMaxLightningAttention": lightning_forward}
    ),
    "recurrent_gemma.modeling_recurrent_gemma": Family(
        {}, ("RecurrentGemmaRecurrentBlock", "RecurrentGemmaRglru"),
        {"RecurrentGemmaRecurrentBlock": recurrent_block_forward, "RecurrentGemmaRglru._rnn_scan": rnn_scan_method},
    ),
    "jamba.modeling_jamba": Family(
        _MAMBA, ("JambaMambaMixer", "JambaMambaDecoderLayer"), {"JambaModel": carry_context}
    ),
    "mamba.modeling_mamba": Family(_MAMBA, ("MambaMixer", "MambaBlock"), _carried("MambaForCausalLM", "MambaModel")),
    "falcon_mamba.modeling_falcon_mamba": Family(
        _MAMBA, ("FalconMambaMixer", "FalconMambaBlock"), _carried("FalconMambaForCausalLM", "FalconMambaModel")
    ),
    "mamba2.modeling_mamba2": Family(
        _SSD, ("Mamba2Mixer", "Mamba2Block"), _carried("Mamba2ForCausalLM", "Mamba2Model")
    ),
    "zamba.modeling_zamba": Family(
        _MAMBA, ("ZambaMambaMixer", "ZambaMambaDecoderLayer"), {"ZambaMambaMixer": carry_context}
    ),
}


def family_of(modeling_module: str) -> Family | None:
    """The routes of a modeling module (its full name, ``transformers.models.jamba.modeling_jamba``)."""
    return MIXER_FAMILIES.get(modeling_module.removeprefix(_MODELS))


def routed_classes(modeling_module: str) -> tuple[str, ...]:
    """The mixer classes of a modeling module that run exactly under context parallelism."""
    family = family_of(modeling_module)
    return family.classes if family is not None else ()
