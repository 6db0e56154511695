"""Block kernels against float64, merge_ on empty rows, and the call contracts of the CUDA kernels.

The CUDA kernels cannot run here, so each is checked against plain-torch stand-ins with the real
signatures of what it calls, run in float64 on CPU:

* flash-attn (``flash_attn.flash_attn_interface._flash_attn_forward`` / ``_flash_attn_backward``):
  2.7.0 .. 2.8.x (checked up to 2.8.4): separate ``window_size_left/right``; forward returns
  ``(out, softmax_lse, S_dmask, rng_state)``; backward fills ``dq, dk, dv`` in place and returns
  ``softmax_d``. With torch >= 2.4 both are ``torch.library`` custom ops, so their Python
  signature is ``(*args, **kwargs)``; the stand-in is registered the same way (and also used as
  plain functions, as on older torch). 2.6.x: one ``window_size`` tuple; forward returns ``(out, q, k,
  v, out_padded, softmax_lse, S_dmask, rng_state)``, backward ``(dq, dk, dv, softmax_d)``.
* torch's aten CUDA ops (``AtenCUDAStandIn``): ``_scaled_dot_product_flash_attention`` and its
  ``_backward`` (torch 2.13 schemas; varlen path whenever ``cum_seq_q`` is defined, then int32 required;
  head_dim a multiple of 8 and at most 256; ``Hq % Hkv == 0``; fp16/bf16 unless a test allows float32),
  and ``_efficient_attention_forward`` / ``_backward`` (equal head counts, LSE padded to 32 with
  aligned strides, ``out`` dense along the sequence).

Each stand-in keeps the CUDA code's checks that matter to a caller and its semantics (bottom-right
causal alignment and ``lse = +inf`` for rows without keys in the flash ops; top-left for the efficient
op's mask type 1), and takes float32, so the comparison with float64 is tight.
"""

from __future__ import annotations

import importlib
import itertools
import math
import sys
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

import hf_ring
from hf_ring.ops import kernels as kernels_mod
from hf_ring.ops.comm import Ring
from hf_ring.ops.kernels import (
    BlockKernel,
    FlashAttnKernel,
    ReferenceKernel,
    TorchCPUKernel,
    TorchCUDAKernel,
    TorchEfficientKernel,
    available_backends,
    get_kernel,
)
from hf_ring.ops.ring import _RingAttention, merge_
from hf_ring.ops.schedule import make_schedule
from testkit.oracle import attention, rel_err
from testkit.spawn import run_ranks

# --------------------------------------------------------------------------- float64 oracle


def scores64(q: Tensor, k: Tensor, causal: bool, scale: float) -> Tensor:
    """``[B, H, Sq, Sk]`` float64 scores; causal is top-left aligned (key j hidden from query i > j)."""
    rep = q.shape[2] // k.shape[2]
    s = torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double().repeat_interleave(rep, 2)) * scale
    if causal:
        sq, sk = s.shape[-2:]
        s = s.masked_fill(torch.ones(sq, sk, dtype=torch.bool).triu(1), float("-inf"))
    return s


def attention64(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
    """``(out [B, Sq, Hq, D], lse [B, Sq, Hq])`` in float64, differentiable."""
    s = scores64(q, k, causal, scale)
    rep = q.shape[2] // k.shape[2]
    out = torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), v.double().repeat_interleave(rep, 2))
    return out, torch.logsumexp(s, -1).transpose(1, 2)


# --------------------------------------------------------------------------- flash-attn stand-in


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise RuntimeError(msg)  # what TORCH_CHECK raises


def _fa_scores(q: Tensor, k: Tensor, scale: float, causal: bool) -> Tensor:
    rep = q.shape[2] // k.shape[2]
    s = torch.einsum("bqhd,bkhd->bhqk", q.float(), k.float().repeat_interleave(rep, 2)) * scale
    if causal:  # flash-attn >= 2.1: aligned to the bottom-right corner
        sq, sk = s.shape[-2:]
        s = s.masked_fill(torch.ones(sq, sk, dtype=torch.bool).triu(sk - sq + 1), float("-inf"))
    return s


def _fa_check_inputs(q: Tensor, k: Tensor, v: Tensor) -> None:
    _check(q.dtype in (torch.float16, torch.bfloat16, torch.float32), "FlashAttention only supports fp16/bf16")
    _check(k.dtype == q.dtype and v.dtype == q.dtype, "query and key/value must have the same dtype")
    for t in (q, k, v):
        _check(t.dim() == 4 and t.stride(-1) == 1, "Input tensor must have contiguous last dimension")
    b, _, h, d = q.shape
    _check(d % 8 == 0, "query, key, value, and out_ must have a head_size that is a multiple of 8")
    _check(d <= 256, "FlashAttention forward only supports head dimension at most 256")
    _check(k.shape == v.shape and k.shape[0] == b and k.shape[3] == d, "k/v shapes")
    _check(h % k.shape[2] == 0, "Number of heads in key/value must divide number of heads in query")


def _fa_check_defaults(dropout_p: float, wl: int, wr: int, softcap: float, alibi_slopes: Tensor | None) -> None:
    # everything the ring must leave at its default
    _check(dropout_p == 0.0 and wl == -1 and wr == -1 and softcap == 0.0 and alibi_slopes is None, "options")


def flash_attn_forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    dropout_p: float,
    softmax_scale: float,
    causal: bool,
    window_size_left: int,
    window_size_right: int,
    softcap: float,
    alibi_slopes: Tensor | None,
    return_softmax: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``flash_attn_interface._flash_attn_forward`` of 2.7+, in plain torch."""
    _fa_check_inputs(q, k, v)
    _fa_check_defaults(dropout_p, window_size_left, window_size_right, softcap, alibi_slopes)
    _check(not return_softmax, "return_softmax")
    s = _fa_scores(q, k, softmax_scale, causal)
    lse = torch.logsumexp(s, -1)  # [B, H, Sq] float32
    lse = lse.masked_fill(torch.isneginf(lse), float("inf"))  # flash-attn: +inf for empty rows
    rep = q.shape[2] // k.shape[2]
    p = torch.exp(s - lse[..., None])
    out = torch.einsum("bhqk,bkhd->bqhd", p, v.float().repeat_interleave(rep, 2)).to(q.dtype)
    s_dmask = torch.empty((0,), dtype=q.dtype, device=q.device)
    rng_state = torch.empty((2,), dtype=torch.int64, device=q.device)
    return out.contiguous(), lse.contiguous(), s_dmask, rng_state


def flash_attn_backward(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    softmax_lse: Tensor,
    dq: Tensor | None,
    dk: Tensor | None,
    dv: Tensor | None,
    dropout_p: float,
    softmax_scale: float,
    causal: bool,
    window_size_left: int,
    window_size_right: int,
    softcap: float,
    alibi_slopes: Tensor | None,
    deterministic: bool,
    rng_state: Tensor | None = None,
) -> Tensor:
    """``flash_attn_interface._flash_attn_backward`` of 2.7+, in plain torch: fills dq, dk, dv."""
    _fa_check_inputs(q, k, v)
    _fa_check_defaults(dropout_p, window_size_left, window_size_right, softcap, alibi_slopes)
    b, sq, h, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    for name, t in (("out", out), ("dout", dout)):
        _check(t.dtype == q.dtype, f"query and {name} must have the same dtype")
        _check(t.stride(-1) == 1, f"{name} tensor must have contiguous last dimension")
        _check(t.shape == q.shape, f"{name} shape")
    # the kernel reads softmax_lse by raw pointer as a contiguous float32 [B, H, Sq]
    _check(softmax_lse.dtype == torch.float32, "softmax_lse must be float32")
    _check(tuple(softmax_lse.shape) == (b, h, sq) and softmax_lse.is_contiguous(), "softmax_lse [B, H, Sq]")
    grads = []
    for name, g, ref in (("dq", dq, q), ("dk", dk, k), ("dv", dv, v)):
        if g is None:
            g = torch.empty_like(ref)
        _check(g.dtype == q.dtype, f"{name} must have the same dtype as q")
        _check(g.stride(-1) == 1, f"{name} must have contiguous last dimension")
        _check(g.shape == ref.shape, f"{name} shape")
        grads.append(g)
    rep = h // hkv
    s = _fa_scores(q, k, softmax_scale, causal)
    p = torch.exp(s - softmax_lse[..., None])
    do, vx = dout.float(), v.float().repeat_interleave(rep, 2)
    delta = (do * out.float()).sum(-1).transpose(1, 2)  # [B, H, Sq]
    ds = p * (torch.einsum("bqhd,bkhd->bhqk", do, vx) - delta[..., None])
    g_q = torch.einsum("bhqk,bkhd->bqhd", ds, k.float().repeat_interleave(rep, 2)) * softmax_scale
    g_k = torch.einsum("bhqk,bqhd->bkhd", ds, q.float()) * softmax_scale
    g_v = torch.einsum("bhqk,bqhd->bkhd", p, do)
    grads[0].copy_(g_q)
    grads[1].copy_(g_k.view(b, sk, hkv, rep, d).sum(3))
    grads[2].copy_(g_v.view(b, sk, hkv, rep, d).sum(3))
    softmax_d = torch.zeros(b, h, (sq + 127) // 128 * 128, dtype=torch.float32, device=q.device)
    softmax_d[..., :sq] = delta
    return softmax_d


def flash_attn_forward_26(
    q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, return_softmax
):
    """2.6.x: ``window_size`` is a tuple; returns ``(out, q, k, v, out_padded, lse, S_dmask, rng)``."""
    out, lse, s_dmask, rng = flash_attn_forward(
        q, k, v, dropout_p, softmax_scale, causal, window_size[0], window_size[1], softcap, alibi_slopes,
        return_softmax,
    )  # fmt: skip
    return out, q, k, v, out, lse, s_dmask, rng


def flash_attn_backward_26(
    dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal, window_size, softcap,
    alibi_slopes, deterministic, rng_state=None,
):  # fmt: skip
    """2.6.x: ``window_size`` is a tuple; returns ``(dq, dk, dv, softmax_d)``."""
    softmax_d = flash_attn_backward(
        dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal, window_size[0],
        window_size[1], softcap, alibi_slopes, deterministic, rng_state,
    )  # fmt: skip
    return dq, dk, dv, softmax_d


def flash_attn_forward_25(q, k, v, dropout_p, softmax_scale, causal, window_size, alibi_slopes, return_softmax):
    raise AssertionError("not called: FlashAttnKernel refuses flash-attn without softcap")


# As in flash-attn >= 2.7 on torch >= 2.4: torch.library custom ops (the forward declares q, k, v
# mutated, like the real one). Registered once per process, at import (workers import this module).
_fwd_op = torch.library.custom_op(
    "hf_ring_tests::flash_attn_forward", flash_attn_forward, mutates_args=("q", "k", "v"), device_types="cpu"
)
_bwd_op = torch.library.custom_op(
    "hf_ring_tests::flash_attn_backward",
    flash_attn_backward,
    mutates_args=("dq", "dk", "dv"),
    device_types="cpu",
)

FAKES = {
    "2.8-custom-op": SimpleNamespace(_flash_attn_forward=_fwd_op, _flash_attn_backward=_bwd_op),
    "2.7-plain": SimpleNamespace(_flash_attn_forward=flash_attn_forward, _flash_attn_backward=flash_attn_backward),
    "2.6": SimpleNamespace(_flash_attn_forward=flash_attn_forward_26, _flash_attn_backward=flash_attn_backward_26),
}


# --------------------------------------------------------------------------- aten CUDA op stand-ins


def _attn64(
    q: Tensor, k: Tensor, v: Tensor, scale: float, causal: bool, bottom_right: bool
) -> tuple[Tensor, Tensor, Tensor]:
    """``[B, S, H, D]`` inputs -> float64 ``out [B, Sq, Hq, D]``, ``lse [B, Hq, Sq]`` (``-inf`` for empty rows),
    scores ``[B, Hq, Sq, Sk]``; causal aligned top-left or bottom-right."""
    rep = q.shape[2] // k.shape[2]
    s = torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double().repeat_interleave(rep, 2)) * scale
    if causal:
        sq, sk = s.shape[-2:]
        s = s.masked_fill(torch.ones(sq, sk, dtype=torch.bool).triu(1 + (sk - sq if bottom_right else 0)), -math.inf)
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)
    return torch.einsum("bhqk,bkhd->bqhd", p, v.double().repeat_interleave(rep, 2)), lse, s


def _grads64(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, s: Tensor, scale: float
) -> tuple[Tensor, Tensor, Tensor]:
    """What a flash-style backward computes from the given ``out`` and ``lse [B, H, Sq]`` (float64,
    ``[B, S, H, D]``, dK/dV summed over each K/V head's query group)."""
    b, sk, hkv, d = k.shape
    rep = q.shape[2] // hkv
    p = torch.exp(s - lse.double()[..., None])  # lse = +inf (empty row) -> 0
    do = dout.double()
    delta = (do * out.double()).sum(-1).transpose(1, 2)[..., None]  # [B, H, Sq, 1]
    ds = p * (torch.einsum("bqhd,bkhd->bhqk", do, v.double().repeat_interleave(rep, 2)) - delta)
    dq = torch.einsum("bhqk,bkhd->bqhd", ds, k.double().repeat_interleave(rep, 2)) * scale
    dk = (torch.einsum("bhqk,bqhd->bkhd", ds, q.double()) * scale).view(b, sk, hkv, rep, d).sum(3)
    dv = torch.einsum("bhqk,bqhd->bkhd", p, do).view(b, sk, hkv, rep, d).sum(3)
    return dq, dk, dv


class AtenCUDAStandIn:
    """``torch.ops.aten``'s CUDA attention ops used by the CUDA kernels, in float64 on CPU.

    Same names, signatures and output layouts as torch 2.13's schemas, and the checks the CUDA code makes
    that a caller can trip (``attention_backward.cu``, ``flash_api.cpp`` ``mha_fwd``/``mha_bwd``/
    ``mha_varlen_bwd``, ``_efficient_attention_forward/backward`` and the cutlass kernels'
    ``check_supported``). ``allow_fp32`` lets the flash ops take float32 (the real ones take fp16/bf16
    only), so their glue can be compared with float64 at 1e-5. ``calls`` records what each op received.
    """

    HALF = (torch.float16, torch.bfloat16)

    def __init__(self, allow_fp32: bool = False, record: bool = False) -> None:
        self.flash_dtypes = self.HALF + ((torch.float32,) if allow_fp32 else ())
        self.calls: dict[str, list[dict]] | None = {} if record else None

    def _record(self, op: str, **kw: object) -> None:
        if self.calls is not None:
            self.calls.setdefault(op, []).append(kw)

    # ------------------------------------------------------------------ flash (mha_fwd / mha_bwd)

    def _check_flash(self, q: Tensor, k: Tensor, v: Tensor) -> None:
        """``mha_fwd``/``mha_bwd`` on ``[B, S, H, D]`` tensors."""
        _check(q.dtype in self.flash_dtypes, "FlashAttention only support fp16 and bf16 data type")
        _check(k.dtype == q.dtype and v.dtype == q.dtype, "query and key/value must have the same dtype")
        for t in (q, k, v):
            _check(t.dim() == 4 and t.stride(-1) == 1, "Input tensor must have contiguous last dimension")
        b, _, h, d = q.shape
        _check(d % 8 == 0, "head_size must be a multiple of 8, this is ensured by padding!")
        _check(d <= 256, "FlashAttention forward only supports head dimension at most 256")
        _check(h % k.shape[2] == 0, "Number of heads in key/value must divide number of heads in query")
        _check(k.shape == v.shape and k.shape[0] == b and k.shape[3] == d, "CHECK_SHAPE(k/v)")

    def _scaled_dot_product_flash_attention(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        return_debug_mask: bool = False,
        *,
        scale: float | None = None,
    ) -> tuple[Tensor, Tensor, None, None, int, int, Tensor, Tensor, Tensor]:
        """Takes ``[B, H, S, D]`` (transposed to ``[B, S, H, D]`` for ``mha_fwd``); causal bottom-right."""
        q, k, v = (t.transpose(1, 2) for t in (query, key, value))
        self._record("flash_fwd", q=q, k=k, v=v)
        self._check_flash(q, k, v)
        _check(dropout_p == 0.0 and not return_debug_mask, "stand-in: no dropout, no debug mask")
        scale = scale if scale is not None else q.shape[-1] ** -0.5
        out, lse, _ = _attn64(q, k, v, scale, is_causal, bottom_right=True)
        lse = lse.masked_fill(torch.isneginf(lse), math.inf).float()  # mha_fwd: +inf for rows without keys
        rng_state = torch.empty(2, dtype=torch.uint64)  # dropout 0: allocated, never written
        unused = torch.empty((), dtype=torch.uint64)
        res = (out.to(q.dtype).contiguous().transpose(1, 2), lse.contiguous(), None, None)
        return (*res, q.shape[1], k.shape[1], rng_state, unused, torch.empty(0, dtype=q.dtype))

    def _scaled_dot_product_flash_attention_backward(
        self,
        grad_out: Tensor,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        out: Tensor,
        logsumexp: Tensor,
        cum_seq_q: Tensor | None,
        cum_seq_k: Tensor | None,
        max_q: int,
        max_k: int,
        dropout_p: float,
        is_causal: bool,
        philox_seed: Tensor | None,
        philox_offset: Tensor | None,
        *,
        scale: float | None = None,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """``_flash_attention_backward``: varlen iff ``cum_seq_q`` is defined, else ``mha_bwd``."""
        dout, q, k, v, o = (t.transpose(1, 2) for t in (grad_out, query, key, value, out))
        self._record("flash_bwd", q=q, k=k, lse=logsumexp, cum_seq_q=cum_seq_q, philox=(philox_seed, philox_offset))
        dout, o = dout.contiguous(), o.contiguous()  # "CUDA code assumes that dout is contiguous"
        if cum_seq_q is not None:  # mha_varlen_bwd
            _check(cum_seq_q.dtype == torch.int32, "cu_seqlens_q must have dtype int32")
            _check(cum_seq_k is not None and cum_seq_k.dtype == torch.int32, "cu_seqlens_k must have dtype int32")
            _check(q.dim() == 3, "varlen: q must be [total_q, num_heads, head_size]")
        self._check_flash(q, k, v)
        _check(dropout_p == 0.0, "stand-in: no dropout (mha_bwd reads philox_seed only with dropout)")
        b, sq, h, d = q.shape
        for name, t in (("out", o), ("dout", dout)):
            _check(t.dtype == q.dtype, f"query and {name} must have the same dtype")
            _check(t.shape == q.shape, f"CHECK_SHAPE({name})")
        # read by raw pointer as contiguous float32 [B, H, Sq]
        _check(logsumexp.dtype == torch.float32, "logsumexp must be float32")
        _check(tuple(logsumexp.shape) == (b, h, sq) and logsumexp.is_contiguous(), "logsumexp [B, H, Sq] contiguous")
        scale = scale if scale is not None else d**-0.5
        _, _, s = _attn64(q, k, v, scale, is_causal, bottom_right=True)
        grads = _grads64(dout, q, k, v, o, logsumexp, s, scale)
        return tuple(g.to(q.dtype).contiguous().transpose(1, 2) for g in grads)  # type: ignore[return-value]

    # ------------------------------------------------------------------ memory-efficient (cutlass)

    def _check_efficient(self, q: Tensor, k: Tensor, v: Tensor, cu_q: object, cu_k: object, bias: object) -> None:
        _check(q.dim() == 4 and k.dim() == 4 and v.dim() == 4, "query.dim() == 4")
        _check(q.shape[0] == k.shape[0] == v.shape[0], "query.size(0) == key.size(0)")
        _check(k.shape[1] == v.shape[1], "key.size(1) == value.size(1)")
        _check(q.shape[2] == k.shape[2] == v.shape[2], "query.size(2) == key.size(2)")  # num heads
        _check(q.shape[3] == k.shape[3], "query.size(3) == key.size(3)")
        _check(q.dtype in (*self.HALF, torch.float32), "invalid dtype")
        _check(k.dtype == q.dtype and v.dtype == q.dtype, "same dtype")
        for t in (q, k, v):
            _check(t.stride(-1) == 1, "tensor must have its last dimension contiguous")
            # cutlass check_supported: strides multiples of kMinimumAlignment (4 on sm80)
            _check(t.stride(1) % 4 == 0, "query is not correctly aligned (strideM)")
            _check(t.shape[2] <= 1 or t.stride(2) % 4 == 0, "query is not correctly aligned (strideH)")
            _check(t.shape[0] <= 1 or t.stride(0) % 4 == 0, "query is not correctly aligned (strideB)")
        _check(cu_q is None and cu_k is None and bias is None, "stand-in: dense, no bias")

    def _efficient_attention_forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        bias: Tensor | None,
        cu_seqlens_q: Tensor | None,
        cu_seqlens_k: Tensor | None,
        max_seqlen_q: int | None,
        max_seqlen_k: int | None,
        dropout_p: float,
        custom_mask_type: int,
        compute_log_sumexp: bool = False,
        *,
        scale: float | None = None,
        seqlen_k: Tensor | None = None,
        window_size: int | None = None,
    ) -> tuple[Tensor, Tensor, Tensor, Tensor, int, int]:
        """``[B, M, H, K]`` in; ``lse [B, H, ceil32(M)]`` float32, ``+inf`` past ``M``; mask 1 top-left."""
        self._record("eff_fwd", q=query, k=key)
        self._check_efficient(query, key, value, cu_seqlens_q, cu_seqlens_k, bias)
        _check(dropout_p == 0.0 and window_size is None and seqlen_k is None, "stand-in: defaults")
        _check(custom_mask_type in (0, 1, 2), "Invalid value for `custom_mask_type`")
        b, m, h, d = query.shape
        scale = scale if scale is not None else d**-0.5
        out, lse, _ = _attn64(query, key, value, scale, custom_mask_type > 0, bottom_right=custom_mask_type == 2)
        lse_p = torch.full((b, h, -(-m // 32) * 32 if compute_log_sumexp else 0), math.inf, dtype=torch.float32)
        if compute_log_sumexp:
            lse_p[..., :m] = lse
        seed, offset = torch.empty((), dtype=torch.int64), torch.empty((), dtype=torch.int64)
        return out.to(query.dtype).contiguous(), lse_p, seed, offset, m, key.shape[1]

    def _efficient_attention_backward(
        self,
        grad_out_: Tensor,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        bias: Tensor | None,
        out: Tensor,
        cu_seqlens_q: Tensor | None,
        cu_seqlens_k: Tensor | None,
        max_seqlen_q: int,
        max_seqlen_k: int,
        logsumexp: Tensor,
        dropout_p: float,
        philox_seed: Tensor,
        philox_offset: Tensor,
        custom_mask_type: int,
        bias_requires_grad: bool,
        *,
        scale: float | None = None,
        num_splits_key: int | None = None,
        window_size: int | None = None,
        shared_storage_dqdkdv: bool = False,
    ) -> tuple[Tensor, Tensor, Tensor, None]:
        self._record("eff_bwd", q=query, k=key, lse=logsumexp, out=out)
        self._check_efficient(query, key, value, cu_seqlens_q, cu_seqlens_k, bias)
        _check(dropout_p == 0.0 and window_size is None and not bias_requires_grad, "stand-in: defaults")
        b, m, h, d = query.shape
        _check(grad_out_.shape == query.shape[:3] + value.shape[3:], "grad_out shape")
        _check(out.dtype == query.dtype and grad_out_.dtype == query.dtype, "out/grad_out dtype")
        # o_strideM() == head_dim_value * num_heads: out is read as dense [B, M, H, Kv]
        _check(out.stride(-1) == 1 and out.stride(1) == h * value.shape[3], "out must be dense [B, M, H, Kv]")
        _check(logsumexp.dtype == torch.float32 and logsumexp.dim() == 3, "logsumexp float32 [B, H, M']")
        _check(logsumexp.shape[:2] == (b, h) and logsumexp.shape[2] >= m and logsumexp.stride(2) == 1, "lse shape")
        _check(h <= 1 or logsumexp.stride(1) % 8 == 0, "LSE is not correctly aligned (strideH)")
        _check(b <= 1 or logsumexp.stride(0) % 8 == 0, "LSE is not correctly aligned (strideB)")
        scale = scale if scale is not None else d**-0.5
        _, _, s = _attn64(query, key, value, scale, custom_mask_type > 0, bottom_right=custom_mask_type == 2)
        grads = _grads64(grad_out_.contiguous(), query, key, value, out, logsumexp[..., :m], s, scale)
        dq, dk, dv = (g.to(query.dtype).contiguous() for g in grads)
        return dq, dk, dv, None


ATEN_FP32 = AtenCUDAStandIn(allow_fp32=True)  # shared by the parametrised tests (records nothing)


def make_kernel(name: str) -> BlockKernel:
    """``flash_attn:<fake>``: FlashAttnKernel over a flash-attn stand-in; ``torch_cuda`` / ``torch_efficient``:
    the CUDA kernels over the aten stand-in (flash ops taking float32 too); else ``get_kernel`` on CPU."""
    if name.startswith("flash_attn:"):
        return FlashAttnKernel(module=FAKES[name.split(":", 1)[1]])
    if name == "torch_cuda":
        return TorchCUDAKernel(ops=ATEN_FP32)
    if name == "torch_efficient":
        return TorchEfficientKernel(ops=ATEN_FP32)
    return get_kernel(name, torch.device("cpu"), torch.float32)


KERNELS = ["torch", "reference", "torch_cuda", "torch_efficient", *(f"flash_attn:{v}" for v in FAKES)]

# --------------------------------------------------------------------------- kernels vs float64

# (B, Sq, Sk, Hq, Hkv, D, causal); causal only on square blocks, the only ones the ring asks for
SHAPES = [
    (2, 13, 29, 8, 2, 80, False),
    (1, 29, 13, 8, 2, 80, False),
    (2, 19, 19, 8, 2, 80, True),
    (1, 17, 17, 4, 4, 64, True),
    (1, 11, 23, 6, 3, 36, False),  # head_dim not a multiple of 8: the CUDA kernels pad
    (1, 11, 11, 6, 3, 36, True),
    (1, 21, 21, 8, 2, 72, True),
    (2, 15, 9, 4, 1, 72, False),  # one K/V head
    (1, 9, 14, 4, 2, 100, False),  # padded to 104
]
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def inputs(shape: tuple, dtype: torch.dtype, seed: int = 0) -> tuple[Tensor, ...]:
    b, sq, sk, hq, hkv, d, _ = shape
    g = torch.Generator().manual_seed(seed)
    q, k, v, dout = (
        torch.randn(b, s, h, d, generator=g, dtype=torch.float64) for s, h in ((sq, hq), (sk, hkv), (sk, hkv), (sq, hq))
    )
    return q, k, v, dout


def reference(q: Tensor, k: Tensor, v: Tensor, dout: Tensor, causal: bool, scale: float) -> list[Tensor]:
    """``[out, lse, dq, dk, dv]`` in float64."""
    xs = [x.detach().double().requires_grad_() for x in (q, k, v)]
    out, lse = attention64(*xs, causal, scale)
    return [out.detach(), lse.detach(), *torch.autograd.grad(out, xs, dout.double())]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}_Sq{}_Sk{}_H{}/{}_D{}_{}".format(*s[:6], "c" * s[6]))
@pytest.mark.parametrize("name", KERNELS)
def test_kernel_forward_backward(name: str, shape: tuple, dtype: torch.dtype) -> None:
    kernel = make_kernel(name)
    causal, scale = shape[6], 0.9 / math.sqrt(shape[5])
    q64, k64, v64, dout64 = inputs(shape, dtype)
    q, k, v, dout = (x.to(dtype) for x in (q64, k64, v64, dout64))
    # the oracle sees the rounded inputs, so bf16 errors come from the kernel alone
    ref_out, ref_lse, *ref_grads = reference(q, k, v, dout, causal, scale)
    out, lse = kernel.forward(q, k, v, causal=causal, scale=scale)
    assert out.dtype == dtype and out.shape == q.shape
    assert lse.dtype == torch.float32 and lse.shape == q.shape[:3]
    assert rel_err(out, ref_out) <= TOL[dtype], f"out {rel_err(out, ref_out):.2e}"
    torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-5, atol=1e-5 if dtype == torch.float32 else 1e-3)
    grads = kernel.backward(dout, q, k, v, out, lse, causal=causal, scale=scale)
    for gname, g, x, r in zip(("dq", "dk", "dv"), grads, (q, k, v), ref_grads):
        assert g.shape == x.shape and g.dtype == dtype, gname
        assert rel_err(g, r) <= TOL[dtype], f"{gname} rel err {rel_err(g, r):.2e}"


@pytest.mark.parametrize("name", ["torch", "reference", "torch_efficient"])
@pytest.mark.parametrize("sq, sk", [(7, 19), (19, 7)])
def test_causal_non_square_is_top_left(name: str, sq: int, sk: int) -> None:
    """What the BlockKernel docstring promises for torch and reference (flash-attn aligns
    bottom-right; the ring never asks for a causal non-square block)."""
    shape = (1, sq, sk, 4, 2, 16, True)
    q, k, v, dout = (x.float() for x in inputs(shape, torch.float32, seed=3))
    kernel = make_kernel(name)
    ref_out, ref_lse, *ref_grads = reference(q, k, v, dout, True, 0.25)
    out, lse = kernel.forward(q, k, v, causal=True, scale=0.25)
    assert rel_err(out, ref_out) <= 1e-5
    torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-5, atol=1e-5)
    for g, r in zip(kernel.backward(dout, q, k, v, out, lse, causal=True, scale=0.25), ref_grads):
        assert rel_err(g, r) <= 1e-5


@pytest.mark.parametrize("name", KERNELS)
def test_block_gradients_with_merged_out_and_lse(name: str) -> None:
    """Keys split into two blocks: merging the block outputs gives full attention, and backward of
    each block with the *merged* out/lse gives exact contributions to the full gradients."""
    kernel = make_kernel(name)
    b, s, hq, hkv, d, cut = 2, 21, 8, 2, 80, 8
    q, k, v, dout = (x.float() for x in inputs((b, s, s, hq, hkv, d, False), torch.float32, seed=5))
    scale = d**-0.5
    ref_out, ref_lse, *ref_grads = reference(q, k, v, dout, False, scale)
    out = torch.zeros(q.shape)
    lse = torch.full(q.shape[:3], float("-inf"))
    parts = ((slice(0, cut), False), (slice(cut, s), False))
    for kr, causal in parts:
        o_b, l_b = kernel.forward(q, k[:, kr], v[:, kr], causal=causal, scale=scale)
        merge_(out, lse, o_b, l_b)
    assert rel_err(out, ref_out) <= 1e-5
    torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-5, atol=1e-5)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for kr, causal in parts:
        dq_b, dk_b, dv_b = kernel.backward(dout, q, k[:, kr], v[:, kr], out, lse, causal=causal, scale=scale)
        dq += dq_b
        dk[:, kr] += dk_b
        dv[:, kr] += dv_b
    for gname, g, r in zip(("dq", "dk", "dv"), (dq, dk, dv), ref_grads):
        assert rel_err(g, r) <= 1e-5, f"{gname} rel err {rel_err(g, r):.2e}"


def test_kernel_names_and_selection() -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert isinstance(get_kernel("auto", cpu, torch.float32), TorchCPUKernel)
    assert isinstance(get_kernel("auto", cpu, torch.bfloat16), TorchCPUKernel)
    assert isinstance(get_kernel("reference", cpu, torch.float32), ReferenceKernel)
    assert get_kernel("torch", cpu, torch.float32).name == "torch"
    assert FlashAttnKernel(module=FAKES["2.7-plain"]).name == "flash_attn"
    assert available_backends("cpu") == ["torch", "reference"]
    # CUDA selection needs no device: kernels touch CUDA only when called
    assert isinstance(get_kernel("auto", cuda, torch.float32), TorchEfficientKernel)  # not the O(S^2) reference
    assert isinstance(get_kernel("auto", cuda, torch.float64), ReferenceKernel)
    assert isinstance(get_kernel("torch_efficient", cuda, torch.bfloat16), TorchEfficientKernel)
    with pytest.raises(ValueError, match=r"backend='torch' has no kernel for torch.float32 on cuda.*torch_efficient"):
        get_kernel("torch", cuda, torch.float32)
    with pytest.raises(ValueError, match=r"backend='torch_efficient' needs CUDA tensors"):
        get_kernel("torch_efficient", cpu, torch.float32)
    if kernels_mod._flash_attn()[0] is None:
        assert isinstance(get_kernel("auto", cuda, torch.bfloat16), TorchCUDAKernel)
        assert available_backends("cuda") == ["torch", "torch_efficient", "reference"]


def test_get_kernel_caches_one_object_per_backend_device_type_dtype() -> None:
    cpu = torch.device("cpu")
    k = get_kernel("torch", cpu, torch.float32)
    assert get_kernel("torch", "cpu", torch.float32) is k
    assert get_kernel("auto", cpu, torch.float32) is k  # "auto" resolves to the same cached object
    assert get_kernel("torch", cpu, torch.float64) is not k
    assert get_kernel("reference", cpu, torch.float32) is not k
    cuda0, cuda1 = torch.device("cuda", 0), torch.device("cuda", 1)
    assert get_kernel("torch_efficient", cuda0, torch.float32) is get_kernel("auto", cuda1, torch.float32)
    assert get_kernel("torch", cuda0, torch.bfloat16) is get_kernel("torch", "cuda", torch.bfloat16)


# --------------------------------------------------------------------------- merge_


def _acc(b: int = 2, s: int = 5, h: int = 3, d: int = 4, seed: int = 0) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, s, h, d, generator=g), torch.randn(b, s, h, generator=g)


def test_merge_into_empty_accumulator_gives_the_block() -> None:
    blk_out, blk_lse = _acc(seed=1)
    out, lse = torch.zeros_like(blk_out), torch.full_like(blk_lse, float("-inf"))
    merge_(out, lse, blk_out, blk_lse)
    assert torch.equal(out, blk_out) and torch.equal(lse, blk_lse)


def test_merge_of_empty_block_leaves_accumulator_unchanged() -> None:
    out, lse = _acc(seed=2)
    out0, lse0 = out.clone(), lse.clone()
    blk_out = torch.randn_like(out)  # whatever a kernel leaves in rows without keys: weight 0
    merge_(out, lse, blk_out, torch.full_like(lse, float("-inf")))
    assert torch.equal(out, out0) and torch.equal(lse, lse0)


def test_merge_both_empty_stays_zero_without_nan() -> None:
    b_out, _ = _acc(seed=3)
    out, lse = torch.zeros_like(b_out), torch.full(b_out.shape[:3], float("-inf"))
    merge_(out, lse, b_out, torch.full_like(lse, float("-inf")))
    assert not out.isnan().any() and not lse.isnan().any()
    assert torch.equal(out, torch.zeros_like(out)) and bool(torch.isneginf(lse).all())


def test_merge_mixed_rows_in_place_through_views() -> None:
    """Per-row: empty/empty, empty/full, full/empty, full/full, merged through a slice of the
    accumulators the way the ring does (``out[:, rows]``)."""
    acc_out, acc_lse = _acc(b=1, s=6, seed=4)
    blk_out, blk_lse = _acc(b=1, s=4, seed=5)
    acc_lse[:, 1:3] = float("-inf")  # rows 1, 2 of the view (rows 2, 3 of the base) are empty
    acc_out[:, 1:3] = 0.0
    blk_lse[:, [0, 1]] = float("-inf")  # rows 0, 1 of the block are empty
    out, lse = acc_out.clone(), acc_lse.clone()
    merge_(out[:, 1:5], lse[:, 1:5], blk_out, blk_lse)
    a_o, a_l = acc_out[:, 1:5].double(), acc_lse[:, 1:5].double()
    b_o, b_l = blk_out.double(), blk_lse.double()
    want_l = torch.logaddexp(a_l, b_l)
    w_a = torch.exp(a_l - want_l).nan_to_num(0.0)
    w_b = torch.exp(b_l - want_l).nan_to_num(0.0)
    want_o = a_o * w_a[..., None] + b_o * w_b[..., None]
    assert not out.isnan().any() and not lse.isnan().any()
    assert torch.equal(out[:, [0, 5]], acc_out[:, [0, 5]]) and torch.equal(lse[:, [0, 5]], acc_lse[:, [0, 5]])
    torch.testing.assert_close(out[:, 1:5].double(), want_o, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(lse[:, 1:5].double(), want_l, rtol=1e-6, atol=1e-6)
    assert torch.equal(out[:, 2], torch.zeros_like(out[:, 2]))  # empty + empty
    assert bool(torch.isneginf(lse[:, 2]).all())
    assert torch.equal(out[:, 1], acc_out[:, 1])  # full + empty


# --------------------------------------------------------------------------- FlashAttnKernel


def test_flash_attn_kernel_refuses_too_old_flash_attn() -> None:
    fa25 = SimpleNamespace(_flash_attn_forward=flash_attn_forward_25, _flash_attn_backward=flash_attn_backward_26)
    with pytest.raises(ImportError, match=r"install flash-attn >= 2.6"):
        FlashAttnKernel(module=fa25)


def test_flash_attn_kernel_detects_api_version() -> None:
    assert FlashAttnKernel(module=FAKES["2.6"]).legacy
    assert not FlashAttnKernel(module=FAKES["2.7-plain"]).legacy
    assert not FlashAttnKernel(module=FAKES["2.8-custom-op"]).legacy


def test_flash_attn_stand_in_keeps_the_cuda_checks() -> None:
    """The stand-in rejects what the CUDA op rejects, so passing through it means something."""
    q, k, v = (torch.randn(1, 4, 2, d) for d in (36, 36, 36))
    with pytest.raises(RuntimeError, match="multiple of 8"):
        _fwd_op(q, k, v, 0.0, 1.0, False, -1, -1, 0.0, None, False)
    q, k, v = (torch.randn(1, 4, 2, 8) for _ in range(3))
    out, lse, _, _ = _fwd_op(q, k, v, 0.0, 1.0, False, -1, -1, 0.0, None, False)
    dq, dk, dv = (torch.empty_like(t) for t in (q, k, v))
    options = (0.0, 1.0, False, -1, -1, 0.0, None, False, None)
    with pytest.raises(RuntimeError, match=r"softmax_lse \[B, H, Sq\]"):
        _bwd_op(out, q, k, v, out, lse.transpose(1, 2), dq, dk, dv, *options)
    softmax_d = _bwd_op(out, q, k, v, out, lse, dq, dk, dv, *options)
    assert softmax_d.shape == (1, 2, 128) and softmax_d.dtype == torch.float32


def ring_errors(name: str, causal: bool, dtype_name: str, d: int) -> list[float] | None:
    """On every rank: the whole ring through ``make_kernel(name)``; rank 0 returns the relative errors
    of out, dq, dk, dv against float64."""
    dist = torch.distributed
    size, rank = (dist.get_world_size(), dist.get_rank()) if dist.is_initialized() else (1, 0)
    dtype = getattr(torch, dtype_name)
    b, n, hq, hkv = 1, 2 * size * 5, 8, 2
    g = torch.Generator().manual_seed(11)
    q, k, v, dout = (torch.randn(b, n, h, d, generator=g, dtype=torch.float64) for h in (hq, hkv, hkv, hq))
    xs = [x.requires_grad_() for x in (q, k, v)]
    ref = attention(*xs, causal)
    ref_grads = torch.autograd.grad(ref, xs, dout)
    kernel = make_kernel(name)
    loc = [hf_ring.shard(x.detach().to(dtype)).requires_grad_() for x in (q, k, v)]
    out = _RingAttention.apply(*loc, d**-0.5, make_schedule("zigzag", causal, rank, size), kernel, Ring())
    grads = torch.autograd.grad(out, loc, hf_ring.shard(dout.to(dtype)))
    got = [hf_ring.unshard(t) for t in (out, *grads)]
    if rank:
        return None
    return [rel_err(x, r) for x, r in zip(got, (ref.detach(), *ref_grads))]


RING_KERNELS = [*(f"flash_attn:{v}" for v in FAKES), "torch_cuda", "torch_efficient"]
RING_CASES = [
    (name, causal, dtype, d)
    for name, causal, (dtype, d) in itertools.product(
        RING_KERNELS, (True, False), (("float32", 80), ("bfloat16", 80), ("float32", 36))
    )
]


@pytest.mark.parametrize("name, causal, dtype, d", RING_CASES)
def test_ring_through_cuda_kernel_contracts_single_process(name: str, causal: bool, dtype: str, d: int) -> None:
    assert not torch.distributed.is_initialized()
    errs = ring_errors(name, causal, dtype, d)
    for gname, err in zip(("out", "dq", "dk", "dv"), errs):
        assert err <= TOL[getattr(torch, dtype)], f"{gname} rel err {err:.2e}"


@pytest.mark.parametrize("world", [2, 3])
def test_ring_through_cuda_kernel_contracts(world: int) -> None:
    cases = [c for c in RING_CASES if c[0] == "flash_attn:2.8-custom-op" or c[2:] == ("float32", 80)]
    for name, causal, dtype, d in cases:
        errs, *_ = run_ranks(world, ring_errors, name, causal, dtype, d)
        for gname, err in zip(("out", "dq", "dk", "dv"), errs):
            assert err <= TOL[getattr(torch, dtype)], f"{name} causal={causal} {dtype} D={d}: {gname} {err:.2e}"


def test_flash_attn_interface_module_is_the_default() -> None:
    """Without a module argument FlashAttnKernel imports flash_attn.flash_attn_interface."""
    if importlib.util.find_spec("flash_attn") is not None:
        pytest.skip("flash_attn is installed")
    with pytest.raises(ModuleNotFoundError, match="flash_attn"):
        FlashAttnKernel()


# --------------------------------------------------------------------------- torch's CUDA ops: call contract


def _bhsd(b: int, h: int, s: int, d: int, dtype: torch.dtype = torch.bfloat16) -> Tensor:
    """``[B, H, S, D]`` view of ``[B, S, H, D]`` memory, as the kernels pass them to the flash op."""
    return torch.randn(b, s, h, d).to(dtype).transpose(1, 2)


def test_aten_stand_in_keeps_the_cuda_checks() -> None:
    """The stand-in rejects what the CUDA ops reject, so passing through it means something."""
    aten = AtenCUDAStandIn()
    flash, flash_bwd = aten._scaled_dot_product_flash_attention, aten._scaled_dot_product_flash_attention_backward
    q, k = _bhsd(1, 4, 6, 16), _bhsd(1, 2, 6, 16)
    res = flash(q, k, k, 0.0, False, False, scale=0.25)
    assert res[2] is None and res[3] is None  # dense forward: no cumulative lengths
    out, lse, rng = res[0], res[1], res[6:8]
    i64 = torch.empty(0, dtype=torch.int64)
    with pytest.raises(RuntimeError, match="cu_seqlens_q must have dtype int32"):  # a defined tensor: varlen
        flash_bwd(out, q, k, k, out, lse, i64, i64, 6, 6, 0.0, False, i64, i64, scale=0.25)
    i32 = torch.tensor([0, 6], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="varlen"):
        flash_bwd(out, q, k, k, out, lse, i32, i32, 6, 6, 0.0, False, *rng, scale=0.25)
    with pytest.raises(RuntimeError, match=r"logsumexp \[B, H, Sq\]"):
        flash_bwd(out, q, k, k, out, lse.transpose(1, 2), None, None, 6, 6, 0.0, False, *rng, scale=0.25)
    dq, dk, dv = flash_bwd(out, q, k, k, out, lse, None, None, 6, 6, 0.0, False, *rng, scale=0.25)
    assert dq.shape == q.shape and dk.shape == dv.shape == k.shape  # dK/dV with the K/V head count
    for (hq, hkv, d, dtype), msg in [
        ((4, 2, 36, torch.bfloat16), "multiple of 8"),
        ((4, 2, 264, torch.bfloat16), "at most 256"),
        ((6, 4, 16, torch.bfloat16), "must divide number of heads"),
        ((4, 2, 16, torch.float32), "only support fp16 and bf16"),
    ]:
        with pytest.raises(RuntimeError, match=msg):
            flash(_bhsd(1, hq, 6, d, dtype), *[_bhsd(1, hkv, 6, d, dtype)] * 2, scale=0.25)
    # memory-efficient op: [B, M, H, K] memory, equal head counts, LSE padded to 32
    q, k = torch.randn(2, 13, 4, 16), torch.randn(2, 13, 4, 16)
    eff, eff_bwd = aten._efficient_attention_forward, aten._efficient_attention_backward
    with pytest.raises(RuntimeError, match=r"query.size\(2\) == key.size\(2\)"):
        eff(q, k[:, :, :2], k[:, :, :2], None, None, None, None, None, 0.0, 1, True, scale=0.25)
    out, lse, seed, offset, _, _ = eff(q, k, k, None, None, None, None, None, 0.0, 1, True, scale=0.25)
    assert lse.shape == (2, 4, 32) and bool(torch.isposinf(lse[..., 13:]).all())
    args = (None, None, 13, 13)
    with pytest.raises(RuntimeError, match=r"LSE is not correctly aligned \(strideH\)"):
        eff_bwd(out, q, k, k, None, out, *args, lse[..., :13].contiguous(), 0.0, seed, offset, 1, False, scale=0.25)
    with pytest.raises(RuntimeError, match=r"out must be dense"):
        strided = torch.randn(2, 4, 13, 16).transpose(1, 2)
        eff_bwd(out, q, k, k, None, strided, *args, lse, 0.0, seed, offset, 1, False, scale=0.25)
    dq, dk, dv, _ = eff_bwd(out, q, k, k, None, out, *args, lse, 0.0, seed, offset, 1, False, scale=0.25)
    assert dq.shape == q.shape and dk.shape == dv.shape == k.shape


def test_torch_cuda_kernel_call_contract() -> None:
    """K/V reach the op with their own head count, padded head dims, ``None`` cumulative lengths and the
    forward's own rng tensors; results come back unpadded with the input shapes."""
    aten = AtenCUDAStandIn(record=True)
    kernel = TorchCUDAKernel(ops=aten)
    q, k, v, dout = (x.bfloat16() for x in inputs((2, 13, 13, 8, 2, 36, True), torch.bfloat16))
    out, lse = kernel.forward(q, k, v, causal=True, scale=0.2)
    assert out.shape == q.shape and out.dtype == q.dtype and lse.shape == q.shape[:3] and lse.dtype == torch.float32
    fwd = aten.calls["flash_fwd"][0]
    assert fwd["k"].shape == (2, 13, 2, 40) and fwd["q"].shape == (2, 13, 8, 40)  # unexpanded, padded 36 -> 40
    rng = kernel._rng[q.device]
    dq, dk, dv = kernel.backward(dout, q, k, v, out, lse, causal=True, scale=0.2)
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
    bwd = aten.calls["flash_bwd"][0]
    assert bwd["cum_seq_q"] is None and bwd["k"].shape[2] == 2
    assert bwd["philox"][0] is rng[0] and bwd["philox"][1] is rng[1]  # the forward's rng_state / unused
    # a backward before any forward on the device gets what the CUDA forward returns without dropout
    fresh = TorchCUDAKernel(ops=aten)
    fresh.backward(dout, q, k, v, out, lse, causal=True, scale=0.2)
    seed, offset = aten.calls["flash_bwd"][1]["philox"]
    assert (seed.dtype, seed.shape, offset.dtype, offset.shape) == (torch.uint64, (2,), torch.uint64, ())


def test_torch_efficient_kernel_call_contract() -> None:
    """K/V expanded to the query heads (the op's backward wants equal counts), LSE cut to ``Sq`` on the
    way out and rebuilt padded on the way in, ``out`` handed over dense."""
    aten = AtenCUDAStandIn(record=True)
    kernel = TorchEfficientKernel(ops=aten)
    q, k, v, dout = (x.float() for x in inputs((2, 13, 13, 8, 2, 36, True), torch.float32))
    out, lse = kernel.forward(q, k, v, causal=True, scale=0.2)
    assert lse.shape == (2, 13, 8) and bool(torch.isfinite(lse).all())
    assert aten.calls["eff_fwd"][0]["k"].shape == (2, 13, 8, 40)
    merged_out = torch.randn(2, 8, 13, 36).transpose(1, 2)  # a strided view, like the ring's merged out
    dq, dk, dv = kernel.backward(dout, q, k, v, merged_out, lse, causal=True, scale=0.2)
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
    bwd = aten.calls["eff_bwd"][0]
    assert bwd["lse"].shape == (2, 8, 32) and bool(torch.isposinf(bwd["lse"][..., 13:]).all())
    assert bwd["out"].is_contiguous() and bwd["k"].shape[2] == 8


@pytest.mark.parametrize("name", ["torch_cuda", "flash_attn:2.8-custom-op"])
def test_head_dim_above_256_is_a_clear_error(name: str) -> None:
    kernel = make_kernel(name)
    q, k, v, dout = (x.bfloat16() for x in inputs((1, 4, 4, 2, 1, 264, False), torch.bfloat16))
    with pytest.raises(ValueError, match=r"head_dim 264 > 256.*backend='torch_efficient'.*backend='reference'"):
        kernel.forward(q, k, v, causal=False, scale=0.1)
    with pytest.raises(ValueError, match=r"head_dim 264 > 256"):
        kernel.backward(dout, q, k, v, dout, torch.zeros(1, 4, 2), causal=False, scale=0.1)


def test_torch_efficient_kernel_takes_head_dims_above_256() -> None:
    shape = (1, 7, 9, 4, 2, 264, False)
    q, k, v, dout = (x.float() for x in inputs(shape, torch.float32, seed=2))
    kernel = make_kernel("torch_efficient")
    ref_out, ref_lse, *ref_grads = reference(q, k, v, dout, False, 0.06)
    out, lse = kernel.forward(q, k, v, causal=False, scale=0.06)
    assert rel_err(out, ref_out) <= 1e-5
    torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-5, atol=1e-5)
    for g, r in zip(kernel.backward(dout, q, k, v, out, lse, causal=False, scale=0.06), ref_grads):
        assert rel_err(g, r) <= 1e-5


def sdpa_bf16(q: Tensor, k: Tensor, v: Tensor, dout: Tensor, causal: bool, scale: float) -> list[Tensor]:
    """``[out, dq, dk, dv]`` of torch's CPU SDPA in bfloat16 (autograd): the bf16 yardstick."""
    xs = [x.detach().transpose(1, 2).requires_grad_() for x in (q, k, v)]
    out = torch.nn.functional.scaled_dot_product_attention(*xs, is_causal=causal, scale=scale, enable_gqa=True)
    grads = torch.autograd.grad(out, xs, dout.transpose(1, 2))
    return [t.transpose(1, 2) for t in (out, *grads)]


@pytest.mark.parametrize("name", ["torch_cuda", "torch_efficient"])
@pytest.mark.parametrize(
    "shape", [(2, 19, 19, 8, 2, 80, True), (1, 11, 23, 6, 3, 36, False), (1, 21, 21, 8, 2, 72, True)]
)
def test_cuda_kernels_in_bf16_within_twice_sdpa_bf16(name: str, shape: tuple) -> None:
    """bf16 through the CUDA kernels' glue (padding, slicing, K/V expansion and group sums) loses at most
    twice what torch's own bf16 SDPA loses against float64 on the same rounded inputs."""
    causal, scale = shape[6], shape[5] ** -0.5
    q, k, v, dout = (x.bfloat16() for x in inputs(shape, torch.bfloat16, seed=7))
    ref = reference(q, k, v, dout, causal, scale)
    yard = sdpa_bf16(q, k, v, dout, causal, scale)
    kernel = make_kernel(name)
    out, lse = kernel.forward(q, k, v, causal=causal, scale=scale)
    got = [out, *kernel.backward(dout, q, k, v, out, lse, causal=causal, scale=scale)]
    for gname, g, y, r in zip(("out", "dq", "dk", "dv"), got, yard, (ref[0], *ref[2:])):
        assert g.dtype == torch.bfloat16
        assert rel_err(g, r) <= 2 * rel_err(y, r), f"{gname}: {rel_err(g, r):.2e} vs sdpa {rel_err(y, r):.2e}"


# --------------------------------------------------------------------------- flash-attn loading, kernel cache

BROKEN_FLASH_ATTN = {
    # a wheel built against another torch: the package is found, its import fails
    "abi": {"__init__.py": 'raise ImportError("flash_attn_2_cuda.so: undefined symbol: _ZN3c104cuda9SetDeviceEi")\n'},
    # imports, but older than hf_ring supports (no softcap)
    "too_old": {
        "__init__.py": "",
        "flash_attn_interface.py": (
            "def _flash_attn_forward(q, k, v, dropout_p, softmax_scale, causal, window_size, alibi_slopes,\n"
            "                        return_softmax):\n    raise AssertionError\n\n\n"
            "def _flash_attn_backward(*args):\n    raise AssertionError\n"
        ),
    },
}


@pytest.fixture
def fresh_kernel_caches():
    """Empty get_kernel's caches before and after (and forget any fake flash_attn package)."""
    kernels_mod._flash_attn.cache_clear()
    kernels_mod._kernel.cache_clear()
    yield
    for name in [m for m in sys.modules if m == "flash_attn" or m.startswith("flash_attn.")]:
        del sys.modules[name]
    importlib.invalidate_caches()
    kernels_mod._flash_attn.cache_clear()
    kernels_mod._kernel.cache_clear()


@pytest.mark.parametrize("case", BROKEN_FLASH_ATTN)
def test_auto_falls_back_to_torch_when_flash_attn_is_unusable(
    case: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fresh_kernel_caches: None
) -> None:
    (tmp_path / "flash_attn").mkdir()
    for fname, text in BROKEN_FLASH_ATTN[case].items():
        (tmp_path / "flash_attn" / fname).write_text(text)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert importlib.util.find_spec("flash_attn") is not None
    cuda = torch.device("cuda")
    with pytest.warns(RuntimeWarning, match=r"flash_attn is installed but unusable.*torch's CUDA flash op instead"):
        kernel = get_kernel("auto", cuda, torch.bfloat16)
    assert isinstance(kernel, TorchCUDAKernel)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once per process, not once per call or layer
        assert isinstance(get_kernel("auto", torch.device("cuda", 1), torch.float16), TorchCUDAKernel)
        assert available_backends("cuda") == ["torch", "torch_efficient", "reference"]
        with pytest.raises(ValueError, match=r"backend='flash_attn' but flash_attn is installed but unusable"):
            get_kernel("flash_attn", cuda, torch.bfloat16)


def test_flash_attn_is_loaded_once_for_all_layers(monkeypatch: pytest.MonkeyPatch, fresh_kernel_caches: None) -> None:
    """One FlashAttnKernel (one import, one signature inspection) however many layers ask for it."""
    made: list[FlashAttnKernel] = []

    class Counting(FlashAttnKernel):
        def __init__(self) -> None:
            made.append(self)
            super().__init__(module=FAKES["2.8-custom-op"])

    monkeypatch.setattr(kernels_mod, "FlashAttnKernel", Counting)
    monkeypatch.setattr(kernels_mod, "_flash_attn_importable", lambda: True)
    cuda = torch.device("cuda")
    layers = [get_kernel("auto", cuda, torch.bfloat16) for _ in range(32)]
    assert len(made) == 1 and all(k is made[0] for k in layers)
    assert get_kernel("flash_attn", cuda, torch.float16) is made[0]
    assert available_backends("cuda")[0] == "flash_attn"


class _AtenProbe(TorchDispatchMode):
    """Records the aten attention ops reached from Python: by then each call has been bound to the op's
    real schema (argument order, kwargs, ``None`` for a ``Tensor`` argument). Answers
    ``_efficient_attention_backward`` itself: torch 2.13's meta function for it lacks the ``out`` argument."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: dict[str, tuple] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        name = func.overloadpacket.__name__
        if "attention" in name:
            self.calls[name] = (args, kwargs or {})
        if name == "_efficient_attention_backward":
            return torch.empty_like(args[1]), torch.empty_like(args[2]), torch.empty_like(args[3]), torch.empty(0)
        return func(*args, **(kwargs or {}))


def test_cuda_kernels_match_the_real_aten_schemas_on_meta_tensors() -> None:
    meta = torch.device("meta")
    q = torch.empty(2, 13, 8, 36, device=meta, dtype=torch.bfloat16)
    k = torch.empty(2, 13, 2, 36, device=meta, dtype=torch.bfloat16)
    with _AtenProbe() as probe:
        kernel = TorchCUDAKernel()  # torch.ops.aten
        out, lse = kernel.forward(q, k, k, causal=True, scale=0.2)
        grads = kernel.backward(out, q, k, k, out, lse, causal=True, scale=0.2)
        eff = TorchEfficientKernel()
        qf, kf = q.float(), k.float()
        out_f, lse_f = eff.forward(qf, kf, kf, causal=True, scale=0.2)
        grads_f = eff.backward(out_f, qf, kf, kf, out_f, lse_f, causal=True, scale=0.2)
    assert (out.shape, lse.shape, lse.dtype) == (q.shape, q.shape[:3], torch.float32)
    assert [g.shape for g in grads] == [q.shape, k.shape, k.shape]
    args, kwargs = probe.calls["_scaled_dot_product_flash_attention_backward"]
    assert args[6] is None and args[7] is None and kwargs == {"scale": 0.2}  # dense path
    assert args[2].shape == (2, 2, 13, 40) and args[12].dtype == torch.uint64  # unexpanded K, padded; rng_state
    assert (out_f.shape, lse_f.shape) == (qf.shape, qf.shape[:3]) and [g.shape for g in grads_f] == [
        qf.shape,
        kf.shape,
        kf.shape,
    ]
    args, kwargs = probe.calls["_efficient_attention_backward"]
    assert args[10].shape == (2, 8, 32) and args[14] == 1 and kwargs == {"scale": 0.2}  # padded LSE; top-left causal
