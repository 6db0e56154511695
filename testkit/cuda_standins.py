"""Stand-ins for the CUDA ops the kernels call, run in float64 on CPU, and a float64 attention.

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

Over 400 lines on purpose: one stand-in per op family with the checks of its CUDA code, kept in
one file so that their conventions (LSE layout, causal alignment, padding) read side by side.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import torch
from torch import Tensor

from hf_ring.ops.kernels import (
    BlockKernel,
    FlashAttnKernel,
    TorchCUDAKernel,
    TorchEfficientKernel,
    get_kernel,
)

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


def _fa_scores(
    q: Tensor, k: Tensor, scale: float, causal: bool, softcap: float = 0.0, wl: int = -1, wr: int = -1
) -> Tensor:
    """Scores as the kernel forms them: scaled, then ``softcap * tanh(s / softcap)`` when ``softcap > 0``
    (flash-attn folds the scale into the cap: ``params.softcap = softmax_scale / softcap``), then masked
    (causal, and the band ``window_size = (wl, wr)``, -1 unbounded)."""
    rep = q.shape[2] // k.shape[2]
    s = torch.einsum("bqhd,bkhd->bhqk", q.float(), k.float().repeat_interleave(rep, 2)) * scale
    if softcap > 0:
        s = torch.tanh(s / softcap) * softcap
    sq, sk = s.shape[-2:]
    if causal:  # flash-attn >= 2.1: aligned to the bottom-right corner
        s = s.masked_fill(torch.ones(sq, sk, dtype=torch.bool).triu(sk - sq + 1), float("-inf"))
    # window_size (left, right), -1 unbounded: key j visible iff i + sk - sq - left <= j <= i + sk - sq + right
    d = torch.arange(sk)[None, :] - torch.arange(sq)[:, None] - (sk - sq)
    if wl >= 0:
        s = s.masked_fill(d < -wl, float("-inf"))
    if wr >= 0:
        s = s.masked_fill(d > wr, float("-inf"))
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
    # the op's schema declares ``float softcap`` (0.0: off); the C++ checks softcap > 0 only with dropout 0
    _check(isinstance(softcap, float) and math.isfinite(softcap) and softcap >= 0.0, "softcap: a float >= 0")
    if softcap > 0.0:
        _check(dropout_p == 0.0, "Softcapping does not support dropout for now")
    # windows are ints, -1 unbounded (band blocks set them); everything else the ring must leave at its default
    _check(isinstance(wl, int) and isinstance(wr, int) and wl >= -1 and wr >= -1, "window_size")
    _check(dropout_p == 0.0 and alibi_slopes is None, "options")


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
    s = _fa_scores(q, k, softmax_scale, causal, softcap, window_size_left, window_size_right)
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
    s = _fa_scores(q, k, softmax_scale, causal, softcap, window_size_left, window_size_right)
    p = torch.exp(s - softmax_lse[..., None])
    do, vx = dout.float(), v.float().repeat_interleave(rep, 2)
    delta = (do * out.float()).sum(-1).transpose(1, 2)  # [B, H, Sq]
    ds = p * (torch.einsum("bqhd,bkhd->bhqk", do, vx) - delta[..., None])
    if softcap > 0:  # through the cap: d/ds_raw of softcap * tanh(s_raw / softcap) (masked entries have p = 0)
        ds = ds * (1.0 - (s.nan_to_num(0.0, neginf=0.0) / softcap) ** 2)
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


def _fa_check_varlen(q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor, cu_k: Tensor, max_q: int, max_k: int) -> list:
    """``mha_varlen_fwd``/``_bwd``'s checks on ``[total, H, D]`` tensors; returns the sequences' row spans.
    Beyond the CUDA checks: a length above ``max_seqlen`` or ``cu_seqlens`` past the rows raise here (the
    kernel would read out of bounds or skip rows silently)."""
    for name, cu in (("cu_seqlens_q", cu_q), ("cu_seqlens_k", cu_k)):
        _check(cu.dtype == torch.int32, f"{name} must have dtype int32")
        _check(cu.dim() == 1 and cu.is_contiguous(), f"{name} must be contiguous")
    _check(cu_q.numel() == cu_k.numel(), "CHECK_SHAPE(cu_seqlens_k, batch_size + 1)")
    for t in (q, k, v):
        _check(t.dim() == 3 and t.stride(-1) == 1, "Input tensor must have contiguous last dimension")
    _fa_check_inputs(q[None], k[None], v[None])
    spans = []
    for i in range(cu_q.numel() - 1):
        q0, q1, k0, k1 = int(cu_q[i]), int(cu_q[i + 1]), int(cu_k[i]), int(cu_k[i + 1])
        _check(0 <= q0 <= q1 <= q.shape[0] and 0 <= k0 <= k1 <= k.shape[0], "cu_seqlens beyond the rows")
        _check(q1 - q0 <= max_q and k1 - k0 <= max_k, "a sequence longer than max_seqlen")
        spans.append((q0, q1, k0, k1))
    return spans


def flash_attn_varlen_forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float,
    softmax_scale: float,
    causal: bool,
    window_size_left: int = -1,
    window_size_right: int = -1,
    softcap: float = 0.0,
    alibi_slopes: Tensor | None = None,
    return_softmax: bool = False,
    block_table: Tensor | None = None,
    leftpad_k: Tensor | None = None,
    seqused_k: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``flash_attn_interface._flash_attn_varlen_forward`` of 2.7+: ``[total, H, D]`` rows,
    ``softmax_lse [H, total_q]``; each sequence as the dense forward (bottom-right causal)."""
    spans = _fa_check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    _check(block_table is None and leftpad_k is None and seqused_k is None and not return_softmax, "options")
    out, lse = torch.zeros_like(q), torch.full((q.shape[1], q.shape[0]), float("inf"), dtype=torch.float32)
    for q0, q1, k0, k1 in spans:
        o, l_, _, _ = flash_attn_forward(
            q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], dropout_p, softmax_scale, causal,
            window_size_left, window_size_right, softcap, alibi_slopes, False,
        )  # fmt: skip
        out[q0:q1], lse[:, q0:q1] = o[0], l_[0]
    return out, lse, torch.empty((0,), dtype=q.dtype), torch.empty((2,), dtype=torch.int64)


def flash_attn_varlen_backward(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    softmax_lse: Tensor,
    dq: Tensor | None,
    dk: Tensor | None,
    dv: Tensor | None,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
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
    """``flash_attn_interface._flash_attn_varlen_backward`` of 2.7+: fills ``dq, dk, dv`` (rows of no
    sequence get zeros) from ``softmax_lse [H, total_q]``; returns ``softmax_d``."""
    spans = _fa_check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    h, tq = q.shape[1], q.shape[0]
    _check(softmax_lse.dtype == torch.float32, "softmax_lse must be float32")
    _check(tuple(softmax_lse.shape) == (h, tq) and softmax_lse.is_contiguous(), "softmax_lse [H, total_q]")
    grads = []
    for name, g, ref in (("dq", dq, q), ("dk", dk, k), ("dv", dv, v)):
        g = torch.empty_like(ref) if g is None else g
        _check(g.shape == ref.shape and g.dtype == q.dtype and g.stride(-1) == 1, f"{name} shape/dtype")
        g.zero_()
        grads.append(g)
    for t in (out, dout):
        _check(t.shape == q.shape and t.dtype == q.dtype and t.stride(-1) == 1, "out/dout shape")
    for q0, q1, k0, k1 in spans:
        gq, gk, gv = (torch.empty_like(t[None, a:b]) for t, a, b in ((q, q0, q1), (k, k0, k1), (v, k0, k1)))
        flash_attn_backward(
            dout[None, q0:q1], q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], out[None, q0:q1],
            softmax_lse[None, :, q0:q1].contiguous(), gq, gk, gv, dropout_p, softmax_scale, causal,
            window_size_left, window_size_right, softcap, alibi_slopes, deterministic, rng_state,
        )  # fmt: skip
        grads[0][q0:q1], grads[1][k0:k1], grads[2][k0:k1] = gq[0], gk[0], gv[0]
    return torch.zeros(h, tq + 128 * len(spans), dtype=torch.float32)


def flash_attn_forward_25(q, k, v, dropout_p, softmax_scale, causal, window_size, alibi_slopes, return_softmax):
    raise AssertionError("not called: FlashAttnKernel refuses flash-attn without softcap")


# As in flash-attn >= 2.7 on torch >= 2.4: torch.library custom ops that declare what the real ones
# declare (2.7.0 .. 2.8.3.post1 and main): the forwards mutate nothing, the backwards fill dq, dk, dv.
# Registered once per process, at import (workers import this module).
_fwd_op = torch.library.custom_op(
    "hf_ring_tests::flash_attn_forward", flash_attn_forward, mutates_args=(), device_types="cpu"
)
_bwd_op = torch.library.custom_op(
    "hf_ring_tests::flash_attn_backward",
    flash_attn_backward,
    mutates_args=("dq", "dk", "dv"),
    device_types="cpu",
)

_varlen_fwd_op = torch.library.custom_op(
    "hf_ring_tests::flash_attn_varlen_forward", flash_attn_varlen_forward, mutates_args=(), device_types="cpu"
)
_varlen_bwd_op = torch.library.custom_op(
    "hf_ring_tests::flash_attn_varlen_backward",
    flash_attn_varlen_backward,
    mutates_args=("dq", "dk", "dv"),
    device_types="cpu",
)

FAKES = {
    "2.8-custom-op": SimpleNamespace(
        _flash_attn_forward=_fwd_op,
        _flash_attn_backward=_bwd_op,
        _flash_attn_varlen_forward=_varlen_fwd_op,
        _flash_attn_varlen_backward=_varlen_bwd_op,
    ),
    "2.7-plain": SimpleNamespace(
        _flash_attn_forward=flash_attn_forward,
        _flash_attn_backward=flash_attn_backward,
        _flash_attn_varlen_forward=flash_attn_varlen_forward,
        _flash_attn_varlen_backward=flash_attn_varlen_backward,
    ),
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
    ``capability``: the GPU's compute capability, as the CUDA code checks it (flash ops: sm_80+; the
    memory-efficient op's bf16 kernels: sm_80+, its fp16/fp32 ones from sm_50).
    """

    HALF = (torch.float16, torch.bfloat16)

    def __init__(self, allow_fp32: bool = False, record: bool = False, capability: tuple[int, int] = (9, 0)) -> None:
        self.flash_dtypes = self.HALF + ((torch.float32,) if allow_fp32 else ())
        self.capability = capability
        self.calls: dict[str, list[dict]] | None = {} if record else None

    def _record(self, op: str, **kw: object) -> None:
        if self.calls is not None:
            self.calls.setdefault(op, []).append(kw)

    # ------------------------------------------------------------------ flash (mha_fwd / mha_bwd)

    def _check_flash(self, q: Tensor, k: Tensor, v: Tensor) -> None:
        """``mha_fwd``/``mha_bwd`` on ``[B, S, H, D]`` tensors."""
        _check(self.capability >= (8, 0), "FlashAttention only supports Ampere GPUs or newer.")
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

    def _check_efficient(
        self, q: Tensor, k: Tensor, v: Tensor, cu_q: object, cu_k: object, bias: object, direction: str = "F"
    ) -> None:
        # the dispatch over kernels built per architecture finds none for bf16 below sm_80
        bf16_ok = q.dtype != torch.bfloat16 or self.capability >= (8, 0)
        _check(bf16_ok, f"cutlass{direction}: no kernel found to launch!")
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
        self._check_efficient(query, key, value, cu_seqlens_q, cu_seqlens_k, bias, "B")
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
