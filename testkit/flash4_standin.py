"""flash-attn 4 (``flash_attn/cute/interface.py``, tags fa4-v4.0.0.beta0 .. beta27) on CPU: ``_flash_attn_fwd``
and ``_flash_attn_bwd`` with the checks of the interface (architecture, dtypes, ``_validate_head_dims``,
shapes), its window resolution (``_resolve_causal_local_window``), the mask of ``mask.py`` (no clamps: a
``None`` edge is unbounded) and what its kernels do with rows that see no key. Every rule cites
``docs/standins.md``'s row (``[B<n>]``).

``FlashAttn4StandIn(capability, allow_fp32)``: a GPU of ``capability``; ``allow_fp32`` is a test allowance (the
library trains in fp16/bf16 only, [B2]). ``.module()`` gives the names of ``flash_attn.cute.interface``.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import torch
from torch import Tensor

from testkit.flash_rules import FlashWindow, flash_mask
from testkit.flash_standin import FlashAttnStandIn

__all__ = ["FlashAttn4StandIn", "fa4_window"]

_MATH = FlashAttnStandIn(allow_fp32=True)  # the attention math: scores scaled, then capped, then masked [B6]


def _assert(cond: bool, msg: str) -> None:
    if not cond:
        raise AssertionError(msg)  # what the interface's asserts raise


def fa4_window(causal: bool, left: int | None, right: int | None, sq: int, sk: int) -> FlashWindow:
    """``_resolve_causal_local_window`` [B5]: ``causal`` sets ``right = 0``; ``left + right < 0`` drops both;
    ``(None, 0)`` is causal; any other edge makes a local mask whose ``None`` edge is unbounded (``mask.py``
    has no clamps: the edges ``sk + sq`` here, past every key)."""
    if causal:
        right = 0
    if left is not None and right is not None and left + right < 0:
        left = right = None
    if left is None and right is None:
        return FlashWindow(False, False, -1, -1)
    if left is None and right == 0:
        return FlashWindow(True, False, -1, 0)
    far = sq + sk
    return FlashWindow(False, True, far if left is None else left, far if right is None else right)


class FlashAttn4StandIn:
    """flash-attn 4's interface on a GPU of compute ``capability``."""

    def __init__(self, capability: tuple[int, int] = (10, 0), allow_fp32: bool = False) -> None:
        self.capability, self.allow_fp32 = capability, allow_fp32

    def _checks(self, q: Tensor, k: Tensor, v: Tensor, backward: bool) -> None:
        major = self.capability[0]
        archs = (9, 10, 11, 12) if backward else (8, 9, 10, 11, 12)
        _assert(
            major in archs, f"Unsupported compute capability. Supported: {', '.join(f'{a}.x' for a in archs)}"
        )  # [B1]
        fp = (torch.float16, torch.bfloat16) + ((torch.float32,) if self.allow_fp32 else ())
        _assert(q.dtype in fp, "inputs must be float16 or bfloat16")  # [B2]
        _assert(k.dtype == q.dtype and v.dtype == q.dtype, "q, k, v must have the same dtype")
        _assert(q.shape[-2] % k.shape[-2] == 0, "num_head must be divisible by num_head_kv")  # [B4]
        d, dv, align = q.shape[-1], v.shape[-1], 16 // q.element_size()
        if major == 9:  # _validate_head_dims [B3]
            ok = 8 <= d <= 256 and 8 <= dv <= 256
        elif major in (10, 11):
            ok = 8 <= d <= 128 and 8 <= dv <= 128
        else:
            ok = True
        _assert(ok and d % align == 0 and dv % align == 0, f"(head_dim, head_dim_v)=({d}, {dv}) is not supported")

    @staticmethod
    def _lengths(cu: Tensor | None, x: Tensor, max_len: int | None) -> list[tuple[int, int]]:
        if cu is None:
            return [(0, x.shape[1])]
        _assert(cu.dtype == torch.int32 and cu.stride(0) == 1, "cu_seqlens must be int32 and contiguous")  # [B8]
        _assert(max_len is not None, "stand-in: max_seqlen given with cu_seqlens")
        spans = [(int(a), int(b)) for a, b in zip(cu[:-1], cu[1:])]
        _assert(all(0 <= a <= b <= x.shape[0] and b - a <= max_len for a, b in spans), "cu_seqlens beyond the rows")
        return spans

    def _fwd(self, q, k, v, cu_seqlens_q=None, cu_seqlens_k=None, seqused_q=None, seqused_k=None, max_seqlen_q=None,
             max_seqlen_k=None, softmax_scale=None, causal=False, softcap=None, window_size_left=None,
             window_size_right=None, return_lse=False, **unused):  # fmt: skip
        """``_flash_attn_fwd`` -> ``(out, lse, None, None)``; ``lse [B, H, Sq]`` (varlen ``[H, total_q]``)
        float32, ``-inf`` for rows without keys [B6]."""
        _assert(not any(v_ is not None for v_ in unused.values()), f"stand-in: not modelled {sorted(unused)}")
        _assert(seqused_q is None and seqused_k is None, "stand-in: no seqused")
        q, k, v = (t.contiguous() if t.stride(-1) != 1 else t for t in (q, k, v))  # maybe_contiguous
        self._checks(q, k, v, backward=False)
        scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
        cap = 0.0 if softcap in (None, 0.0) else float(softcap)
        varlen = cu_seqlens_q is not None
        qs, ks = self._lengths(cu_seqlens_q, q, max_seqlen_q), self._lengths(cu_seqlens_k, k, max_seqlen_k)
        _assert(len(qs) == len(ks), "cu_seqlens_q and cu_seqlens_k must describe the same batch")
        out = torch.zeros_like(q)
        lse = torch.full((q.shape[-2], q.shape[0]) if varlen else (q.shape[0], q.shape[2], q.shape[1]), -math.inf)
        for (q0, q1), (k0, k1) in zip(qs, ks):
            rows = (slice(None), slice(q0, q1)) if not varlen else (slice(q0, q1),)
            keys = (slice(None), slice(k0, k1)) if not varlen else (slice(k0, k1),)
            qq, kk, vv = q[rows], k[keys], v[keys]
            if varlen:
                qq, kk, vv = qq[None], kk[None], vv[None]
            if kk.shape[1] == 0:  # seqlen_k == 0: out 0, lse -inf (interface) [B6]
                continue
            w = fa4_window(causal, window_size_left, window_size_right, qq.shape[1], kk.shape[1])
            o, l_ = _MATH._fwd(qq, kk, vv, scale, cap, flash_mask(qq.shape[1], kk.shape[1], w))
            l_ = l_.masked_fill(torch.isposinf(l_), -math.inf)  # softmax.py: row_sum 0 -> -inf [B6]
            if varlen:
                out[q0:q1], lse[:, q0:q1] = o[0], l_[0]
            else:
                out, lse = o, l_
        return out, (lse.contiguous() if return_lse else None), None, None

    def _bwd(self, q, k, v, out, dout, lse, softmax_scale=None, causal=False, softcap=0.0, window_size_left=None,
             window_size_right=None, cu_seqlens_q=None, cu_seqlens_k=None, seqused_q=None, seqused_k=None,
             max_seqlen_q=None, max_seqlen_k=None, deterministic=False, dq=None, dk=None, dv=None,
             **unused):  # fmt: skip
        """``_flash_attn_bwd`` -> ``(dq, dk, dv, None)``; dK/dV with the K/V heads [B4]; ``lse`` read as float32
        ``[B, H, Sq]`` (varlen ``[H, total_q]``), ``-inf`` read as 0 [B7]."""
        _assert(not any(v_ is not None for v_ in unused.values()), f"stand-in: not modelled {sorted(unused)}")
        q, k, v, out, dout, lse = (t.contiguous() if t.stride(-1) != 1 else t for t in (q, k, v, out, dout, lse))
        self._checks(q, k, v, backward=True)
        varlen = cu_seqlens_q is not None
        want = (q.shape[-2], q.shape[0]) if varlen else (q.shape[0], q.shape[2], q.shape[1])
        _assert(tuple(lse.shape) == want, f"lse must have shape {want}")  # [B7]
        _assert(lse.dtype == torch.float32, "lse must be float32")
        _assert(out.dtype == q.dtype and dout.dtype == q.dtype and out.shape == dout.shape == q.shape, "out/dout")
        scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
        grads = [torch.zeros_like(x) if g is None else g.zero_() for g, x in ((dq, q), (dk, k), (dv, v))]
        qs, ks = self._lengths(cu_seqlens_q, q, max_seqlen_q), self._lengths(cu_seqlens_k, k, max_seqlen_k)
        for (q0, q1), (k0, k1) in zip(qs, ks):
            if not varlen:
                parts = (dout, q, k, v, out, lse)
            else:
                parts = (dout[None, q0:q1], q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], out[None, q0:q1],
                         lse[None, :, q0:q1])  # fmt: skip
            sq, sk = parts[1].shape[1], parts[2].shape[1]
            if sk == 0:
                continue
            w = fa4_window(causal, window_size_left, window_size_right, sq, sk)
            g = _MATH._bwd(*parts, scale, float(softcap), flash_mask(sq, sk, w))[:3]
            if varlen:
                grads[0][q0:q1], grads[1][k0:k1], grads[2][k0:k1] = (x[0] for x in g)
            else:
                for dst, src in zip(grads, g):
                    dst.copy_(src)
        return grads[0], grads[1], grads[2], None

    def module(self) -> SimpleNamespace:
        """The private names of ``flash_attn.cute.interface``."""
        return SimpleNamespace(_flash_attn_fwd=self._fwd, _flash_attn_bwd=self._bwd)
