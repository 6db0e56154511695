"""CPU stand-ins for the CUDA kernels of hybrid mixers, with their signatures and the checks that
matter to a caller, and the fake packages that make transformers pick them up.

* flash-linear-attention (``fla``, fla-core 0.6): ``chunk_gated_delta_rule(q, k, v, g, beta, scale=None,
  initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=False, cu_seqlens=None,
  head_first=False)``: q/k ``[B, T, H, K]`` (value heads a multiple of H), v ``[B, T, HV, V]``, g and
  beta ``[B, T, HV]``, one dtype for q/k/v and not float32 ("does not support float32. Please use
  bfloat16."), ``initial_state [N, HV, K, V]``; returns ``(o [B, T, HV, V], final_state float32 or
  None)``. ``chunk_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
  use_qk_l2norm_in_kernel=False, ..., cu_seqlens=None, **kwargs)``: g ``[B, T, H, K]``, beta
  ``[B, T, H]``, a float32 contiguous ``initial_state [B, H, K, V]``.
* causal-conv1d 1.x: ``causal_conv1d_fn(x, weight, bias=None, seq_idx=None, initial_states=None,
  return_final_states=False, final_states_out=None, activation=None)``: x ``[B, D, L]`` with unit
  stride along L or along D (channel-last), weight ``[D, W]`` with ``2 <= W <= 4``, fp32/fp16/bf16,
  activation ``None``, ``"silu"`` or ``"swish"``.

Each computes in float32 (the kernels accumulate in float32) and returns the kernel's dtypes.
``fake_packages()`` puts modules ``fla`` and ``causal_conv1d`` with these functions in
``sys.modules``; ``kernel_like_transformers(torch_fn, name, package)`` then wraps a transformers
torch fallback exactly as transformers does at import when the package is installed.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import Tensor

from .mixers import delta_rule_reference

CALLS: list[tuple[str, dict]] = []  # (kernel, shapes and flags) of every call, for tests to inspect


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise AssertionError(msg)  # fla and causal-conv1d use assert / TORCH_CHECK


def _record(name: str, **info: object) -> None:
    CALLS.append((name, info))


def chunk_gated_delta_rule(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: Tensor | None = None,
    head_first: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """fla's ``chunk_gated_delta_rule`` (see the module)."""
    _check(q.dtype == k.dtype == v.dtype, "q, k, v must share a dtype")
    _check(q.dtype != torch.float32, "ChunkGatedDeltaRuleFunction does not support float32. Please use bfloat16.")
    _check(beta.dim() == 3, "beta must be of shape [B, T, H] if head_first=False, or [B, H, T] otherwise.")
    _check(not head_first, "the stand-in takes head_first=False only")
    b, t, h, dk = q.shape
    hv = v.shape[2]
    _check(k.shape == q.shape and v.shape[:2] == (b, t) and hv % h == 0, f"shapes q {q.shape} k {k.shape} v {v.shape}")
    _check(g.shape == (b, t, hv) and beta.shape == (b, t, hv), f"g {g.shape} / beta {beta.shape} != {(b, t, hv)}")
    if cu_seqlens is not None:
        _check(b == 1, "The batch size is expected to be 1 rather than {b} when using `cu_seqlens`.")
    n = b if cu_seqlens is None else len(cu_seqlens) - 1
    if initial_state is not None:
        _check(initial_state.shape == (n, hv, dk, v.shape[-1]), f"initial_state {initial_state.shape}")
    _record("chunk_gated_delta_rule", shape=tuple(q.shape), v=tuple(v.shape), h0=initial_state is not None,
            final=output_final_state, varlen=cu_seqlens is not None)  # fmt: skip
    return _run(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens)


def chunk_kda(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    cu_seqlens: Tensor | None = None,
    **kwargs: object,
) -> tuple[Tensor, Tensor | None]:
    """fla's ``chunk_kda`` (see the module); the gate is applied outside (``use_gate_in_kernel=False``)."""
    _check(not use_gate_in_kernel, "the stand-in takes the decay precomputed (use_gate_in_kernel=False)")
    _check(q.dtype == k.dtype == v.dtype and q.dtype != torch.float32, "q, k, v: one dtype, bf16/fp16")
    b, t, h, dk = q.shape
    _check(g.shape == (b, t, h, dk) and beta.shape == (b, t, h), f"g {g.shape} / beta {beta.shape}")
    if initial_state is not None:
        _check(initial_state.dtype == torch.float32, "KDA requires initial_state dtype torch.float32")
        _check(initial_state.is_contiguous(), "KDA requires initial_state to be contiguous")
        _check(initial_state.shape == (b, h, dk, v.shape[-1]), f"initial_state {initial_state.shape}")
    _record("chunk_kda", shape=tuple(q.shape), h0=initial_state is not None, final=output_final_state)
    return _run(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens)


def _run(q, k, v, g, beta, scale, initial_state, output_final_state, l2norm, cu_seqlens):
    if scale is not None:
        _check(abs(scale - q.shape[-1] ** -0.5) < 1e-12, "the stand-in takes the default scale")
    f32 = [x.float() for x in (q, k, v, g, beta)]
    h0 = None if initial_state is None else initial_state.float()
    if cu_seqlens is None:
        out, state = delta_rule_reference(
            *f32, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=l2norm
        )
    else:
        outs, states = [], []
        for i, (a, e) in enumerate(zip(cu_seqlens.tolist(), cu_seqlens[1:].tolist())):
            part = [x[:, a:e] for x in f32]
            o, s = delta_rule_reference(*part, initial_state=None if h0 is None else h0[i : i + 1],
                                        output_final_state=True, use_qk_l2norm_in_kernel=l2norm)  # fmt: skip
            outs.append(o)
            states.append(s)
        out, state = torch.cat(outs, 1), torch.cat(states)
    return out.to(v.dtype), (state if output_final_state else None)


def causal_conv1d_fn(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None = None,
    seq_idx: Tensor | None = None,
    initial_states: Tensor | None = None,
    return_final_states: bool = False,
    final_states_out: Tensor | None = None,
    activation: str | None = None,
) -> Tensor:
    """causal-conv1d's ``causal_conv1d_fn`` (see the module), without seq_idx / states."""
    _check(activation in (None, "silu", "swish"), "activation must be None, silu, or swish")
    _check(x.dtype in (torch.float32, torch.float16, torch.bfloat16), "x: fp32, fp16 or bf16")
    _check(weight.dim() == 2 and weight.shape[0] == x.shape[1], f"weight {weight.shape} for x {x.shape}")
    _check(2 <= weight.shape[1] <= 4, "causal_conv1d only supports width between 2 and 4")
    _check(x.stride(2) == 1 or x.stride(1) == 1, "x must be contiguous along the sequence or the channels")
    _check(seq_idx is None and initial_states is None and not return_final_states, "the stand-in: no states")
    _record("causal_conv1d_fn", shape=tuple(x.shape), width=weight.shape[1])
    out = F.conv1d(x.float(), weight.float().unsqueeze(1), None if bias is None else bias.float(),
                   padding=weight.shape[1] - 1, groups=x.shape[1])[..., : x.shape[-1]]  # fmt: skip
    return (F.silu(out) if activation else out).to(x.dtype)


@contextmanager
def fake_packages() -> Iterator[None]:
    """``fla`` and ``causal_conv1d`` in ``sys.modules`` with the stand-ins, while inside."""
    fla, conv = ModuleType("fla"), ModuleType("causal_conv1d")
    fla.chunk_gated_delta_rule = chunk_gated_delta_rule  # type: ignore[attr-defined]
    fla.chunk_kda = chunk_kda  # type: ignore[attr-defined]
    conv.causal_conv1d_fn = causal_conv1d_fn  # type: ignore[attr-defined]
    saved = {name: sys.modules.get(name) for name in ("fla", "causal_conv1d")}
    sys.modules.update(fla=fla, causal_conv1d=conv)
    try:
        yield
    finally:
        for name, mod in saved.items():
            if mod is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = mod


def kernel_like_transformers(torch_fn: Callable, name: str, package: str) -> Callable:
    """``torch_fn`` wrapped by transformers' ``use_kernel_func_from_hub_with_fallback(name, package)``
    while the fake packages are installed: what a modeling module holds on a machine with them."""
    from transformers.integrations.hub_kernels import use_kernel_func_from_hub_with_fallback

    with fake_packages():
        return use_kernel_func_from_hub_with_fallback(name, package)(torch_fn)
