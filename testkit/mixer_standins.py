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
* mamba-ssm 2.x: ``mamba_chunk_scan_combined(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None,
  initial_states=None, seq_idx=None, cu_seqlens=None, dt_softplus=False, dt_limit=(0, inf),
  return_final_states=False, return_varlen_states=False)``: x ``[B, L, H, P]``, dt ``[B, L, H]``, A
  ``[H]``, B/C ``[B, L, G, N]`` (H a multiple of G), D ``[H]`` or ``[H, P]``, ``initial_states [B, H,
  P, N]``; returns ``out`` in x's dtype (and the final states in float32).
  ``selective_scan_fn(u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
  return_last_state=False)``: u/delta/z ``[B, D, L]``, A ``[D, N]`` float32, B/C ``[B, N, L]``, D and
  delta_bias float32 ``[D]``; no initial state; returns ``out`` in u's dtype (and the last state in
  float32). ``mamba_split_conv1d_scan_combined(zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D,
  chunk_size, initial_states=None, seq_idx=None, dt_limit=(0, inf), return_final_states=False,
  activation="silu", rmsnorm_weight=None, rmsnorm_eps=1e-6, outproj_weight=None, outproj_bias=None,
  headdim=None, ngroups=1, norm_before_gate=True)``: the whole Mamba2 mixer after ``in_proj``.

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

from .mixers import delta_rule_reference, selective_scan_reference, ssd_reference

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


def mamba_chunk_scan_combined(
    x: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    chunk_size: int,
    D: Tensor | None = None,
    z: Tensor | None = None,
    dt_bias: Tensor | None = None,
    initial_states: Tensor | None = None,
    seq_idx: Tensor | None = None,
    cu_seqlens: Tensor | None = None,
    dt_softplus: bool = False,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
    return_final_states: bool = False,
    return_varlen_states: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """mamba-ssm's ``mamba_chunk_scan_combined`` (see the module), without z / seq_idx / varlen states."""
    batch, seqlen, nheads, headdim = x.shape
    ngroups, dstate = B.shape[2], B.shape[3]
    _check(nheads % ngroups == 0, "nheads must be a multiple of ngroups")
    _check(B.shape == (batch, seqlen, ngroups, dstate) and C.shape == B.shape, f"B {B.shape} C {C.shape}")
    _check(dt.shape == (batch, seqlen, nheads) and A.shape == (nheads,), f"dt {dt.shape} A {A.shape}")
    _check(D is None or D.shape in ((nheads, headdim), (nheads,)), f"D {None if D is None else D.shape}")
    if initial_states is not None:
        _check(initial_states.shape == (batch, nheads, headdim, dstate), f"initial_states {initial_states.shape}")
    no_varlen = seq_idx is None and cu_seqlens is None and not return_varlen_states
    _check(z is None and no_varlen, "the stand-in: no z / varlen")
    _record("mamba_chunk_scan_combined", shape=tuple(x.shape), h0=initial_states is not None, final=return_final_states)
    out, state = ssd_reference(x.float(), dt.float(), A.float(), B.float(), C.float(), chunk_size,
                               D=None if D is None or D.dim() == 2 else D.float(), dt_bias=dt_bias,
                               initial_states=initial_states, dt_softplus=dt_softplus, dt_limit=dt_limit,
                               return_final_states=True)  # fmt: skip
    if D is not None and D.dim() == 2:
        out = out + x.float() * D.float()
    return (out.to(x.dtype), state) if return_final_states else out.to(x.dtype)


def selective_scan_fn(
    u: Tensor,
    delta: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    D: Tensor | None = None,
    z: Tensor | None = None,
    delta_bias: Tensor | None = None,
    delta_softplus: bool = False,
    return_last_state: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """mamba-ssm's ``selective_scan_fn`` (see the module), with B and C shared by the channels."""
    batch, dim, seqlen = u.shape
    _check(delta.shape == u.shape and (z is None or z.shape == u.shape), f"u {u.shape} delta {delta.shape}")
    _check(A.dim() == 2 and A.shape[0] == dim and A.dtype == torch.float32, "A: float32 [D, N]")
    _check(B.shape == (batch, A.shape[1], seqlen) and C.shape == B.shape, f"B {B.shape} C {C.shape} (stand-in: 3-D)")
    for name, t in (("D", D), ("delta_bias", delta_bias)):
        _check(t is None or (t.shape == (dim,) and t.dtype == torch.float32), f"{name}: float32 [D]")
    _record("selective_scan_fn", shape=tuple(u.shape), final=return_last_state)
    out, state = selective_scan_reference(u.float(), delta.float(), A, B.float(), C.float(), D=D,
                                          z=None if z is None else z.float(), delta_bias=delta_bias,
                                          delta_softplus=delta_softplus, return_last_state=True)  # fmt: skip
    return (out.to(u.dtype), state) if return_last_state else out.to(u.dtype)


def mamba_split_conv1d_scan_combined(
    zxbcdt: Tensor,
    conv1d_weight: Tensor,
    conv1d_bias: Tensor | None,
    dt_bias: Tensor,
    A: Tensor,
    D: Tensor,
    chunk_size: int,
    initial_states: Tensor | None = None,
    seq_idx: Tensor | None = None,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
    return_final_states: bool = False,
    activation: str = "silu",
    rmsnorm_weight: Tensor | None = None,
    rmsnorm_eps: float = 1e-6,
    outproj_weight: Tensor | None = None,
    outproj_bias: Tensor | None = None,
    headdim: int | None = None,
    ngroups: int = 1,
    norm_before_gate: bool = True,
) -> Tensor:
    """mamba-ssm's fused Mamba2 mixer (see the module): split, convolution, scan, gated norm, out_proj."""
    nheads = A.shape[0]
    headdim = headdim if headdim is not None else D.shape[1]
    dim = nheads * headdim
    dstate = (conv1d_weight.shape[0] - dim) // ngroups // 2
    _check(zxbcdt.shape[-1] == 2 * dim + 2 * ngroups * dstate + nheads, "the stand-in: no extra MLP part in zxbcdt")
    _check(initial_states is None and seq_idx is None and not return_final_states, "the stand-in: no states")
    _check(rmsnorm_weight is not None and not norm_before_gate, "the stand-in: the gated norm after the gate")
    _record("mamba_split_conv1d_scan_combined", shape=tuple(zxbcdt.shape))
    batch, seqlen = zxbcdt.shape[:2]
    z, xbc, dt = zxbcdt.float().split([dim, dim + 2 * ngroups * dstate, nheads], dim=-1)
    bias = None if conv1d_bias is None else conv1d_bias.float()
    xbc = causal_conv1d_fn(xbc.transpose(1, 2), conv1d_weight.float(), bias, activation=activation).transpose(1, 2)
    x, b, c = xbc.split([dim, ngroups * dstate, ngroups * dstate], dim=-1)
    b, c = b.reshape(batch, seqlen, ngroups, dstate), c.reshape(batch, seqlen, ngroups, dstate)
    y = ssd_reference(x.reshape(batch, seqlen, nheads, headdim), dt, A.float(), b, c, chunk_size, D=D.float(),
                      dt_bias=dt_bias.float(), dt_softplus=True, dt_limit=dt_limit)
    y = y.reshape(batch, seqlen, ngroups, dim // ngroups) * F.silu(z.reshape(batch, seqlen, ngroups, dim // ngroups))
    y = (y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + rmsnorm_eps)).reshape(batch, seqlen, dim)
    y = (y * rmsnorm_weight.float()).to(zxbcdt.dtype)
    return F.linear(y, outproj_weight, outproj_bias)


@contextmanager
def fake_packages() -> Iterator[None]:
    """``fla``, ``causal_conv1d`` and ``mamba_ssm`` in ``sys.modules`` with the stand-ins, while inside."""
    fla, conv, mamba = ModuleType("fla"), ModuleType("causal_conv1d"), ModuleType("mamba_ssm")
    fla.chunk_gated_delta_rule = chunk_gated_delta_rule  # type: ignore[attr-defined]
    fla.chunk_kda = chunk_kda  # type: ignore[attr-defined]
    conv.causal_conv1d_fn = causal_conv1d_fn  # type: ignore[attr-defined]
    mamba.mamba_chunk_scan_combined = mamba_chunk_scan_combined  # type: ignore[attr-defined]
    mamba.selective_scan_fn = selective_scan_fn  # type: ignore[attr-defined]
    mamba.mamba_split_conv1d_scan_combined = mamba_split_conv1d_scan_combined  # type: ignore[attr-defined]
    fakes = {"fla": fla, "causal_conv1d": conv, "mamba_ssm": mamba}
    saved = {name: sys.modules.get(name) for name in fakes}
    sys.modules.update(fakes)
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
