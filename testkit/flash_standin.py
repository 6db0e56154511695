"""flash-attn 2.6.3 - 2.8.3 on CPU: its private entry points, with the checks and the argument
preprocessing of its C++ (``csrc/flash_attn/flash_api.cpp``), the mask of ``src/mask.h``
(``testkit.flash_rules``) and what its kernels do with rows that see no key.

``FlashAttnStandIn(version, capability, allow_fp32)`` answers for one release on one GPU;
``.module()`` gives the names of ``flash_attn.flash_attn_interface`` that release has (2.6.x: one
``window_size`` tuple, 8-tuple returns; 2.7+: separate edges, and the varlen functions). Every rule
cites ``docs/standins.md``'s row (``[F<n>]``), which gives the file, lines and versions.
``allow_fp32`` is a test allowance, not a library rule: float32 inputs run the same glue with
float32 results, so the comparison with float64 is tight (the library takes fp16/bf16 only, [F5]).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import SimpleNamespace

import torch
from torch import Tensor

from testkit.flash_rules import flash_mask, flash_window

__all__ = ["FlashAttnStandIn"]


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise RuntimeError(msg)  # what TORCH_CHECK raises


def _contig(x: Tensor | None) -> Tensor | None:
    """``maybe_contiguous`` of the Python wrapper [F13]."""
    return x.contiguous() if x is not None and x.stride(-1) != 1 else x


@dataclass(frozen=True)
class FlashAttnStandIn:
    """One flash-attn release (``version``) on a GPU of compute ``capability``."""

    version: tuple[int, int, int] = (2, 8, 3)
    capability: tuple[int, int] = (9, 0)
    allow_fp32: bool = False

    # ------------------------------------------------------------------ checks of every entry point

    def _gpu(self) -> None:
        major, minor = self.capability  # [F4]: sm_8x / sm_90 before 2.7.3, any sm_80+ after
        ok = major >= 8 if self.version >= (2, 7, 3) else major == 8 or (major, minor) == (9, 0)
        _check(ok, "FlashAttention only supports Ampere GPUs or newer.")

    def _inputs(self, q: Tensor, k: Tensor, v: Tensor, dropout_p: float, softcap: float, *extra: Tensor) -> None:
        self._gpu()
        fp = (torch.float16, torch.bfloat16) + ((torch.float32,) if self.allow_fp32 else ())
        _check(q.dtype in fp, "FlashAttention only support fp16 and bf16 data type")  # [F5]
        for t in (k, v, *extra):
            _check(t.dtype == q.dtype, "query and key/value/out/dout must have the same dtype")
        for t in (q, k, v, *extra):
            _check(t.stride(-1) == 1, "Input tensor must have contiguous last dimension")
        d = q.shape[-1]
        _check(d <= 256, "FlashAttention forward only supports head dimension at most 256")  # [F6]
        if self.version >= (2, 7, 0):  # 2.6.x pads the head dim in C++ [F6]
            _check(d % 8 == 0, "query, key, value, and out_ must have a head_size that is a multiple of 8")
        _check(q.shape[-2] % k.shape[-2] == 0, "Number of heads in key/value must divide number of heads in query")
        _check(k.shape == v.shape and k.shape[-1] == d and k.shape[:-3] == q.shape[:-3], "CHECK_SHAPE(k/v)")
        _check(isinstance(softcap, float) and math.isfinite(softcap), "softcap: a float")
        if softcap > 0.0:
            _check(dropout_p == 0.0, "Softcapping does not support dropout for now")  # [F8]
        _check(dropout_p == 0.0, "stand-in: dropout is not modelled")

    # ------------------------------------------------------------------ what the kernels compute

    @staticmethod
    def _scores(q: Tensor, k: Tensor, scale: float, softcap: float) -> Tensor:
        """``[B, H, Sq, Sk]`` float32 scores: ``softcap * tanh(scale * q.k / softcap)`` with a cap [F8]."""
        rep = q.shape[2] // k.shape[2]
        s = torch.einsum("bqhd,bkhd->bhqk", q.float(), k.float().repeat_interleave(rep, 2)) * scale
        return torch.tanh(s / softcap) * softcap if softcap > 0 else s

    def _fwd(self, q, k, v, scale, softcap, keep) -> tuple[Tensor, Tensor]:
        """out ``[B, Sq, H, D]`` (q's dtype) and lse ``[B, H, Sq]`` float32 of one batch of sequences."""
        s = self._scores(q, k, scale, softcap).masked_fill(~keep, -math.inf)
        lse = torch.logsumexp(s, -1)
        lse = lse.masked_fill(torch.isneginf(lse), math.inf)  # a row without keys: lse +inf [F9]
        p = torch.exp(s - lse[..., None])  # and out 0 [F9]
        rep = q.shape[2] // k.shape[2]
        out = torch.einsum("bhqk,bkhd->bqhd", p, v.float().repeat_interleave(rep, 2))
        return out.to(q.dtype), lse

    def _bwd(self, dout, q, k, v, out, lse, scale, softcap, keep) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """dq, dk, dv (float32; dK/dV summed over each K/V head's query group [F7]) and ``Delta``."""
        b, sk, hkv, d = k.shape
        rep = q.shape[2] // hkv
        s = self._scores(q, k, scale, softcap)
        # scale_apply_exp2 reads an lse of -inf as 0; +inf (a row without keys) gives p = 0 [F10]
        p = torch.exp(s.masked_fill(~keep, -math.inf) - lse.masked_fill(torch.isneginf(lse), 0.0)[..., None])
        do, vx = dout.float(), v.float().repeat_interleave(rep, 2)
        delta = (do * out.float()).sum(-1).transpose(1, 2)  # rowsum(dO * O) of the given out [F10]
        ds = p * (torch.einsum("bqhd,bkhd->bhqk", do, vx) - delta[..., None])
        if softcap > 0:  # through the cap: times 1 - tanh^2 [F8]
            ds = ds * (1.0 - (s / softcap) ** 2)
        dq = torch.einsum("bhqk,bkhd->bqhd", ds, k.float().repeat_interleave(rep, 2)) * scale
        dk = (torch.einsum("bhqk,bqhd->bkhd", ds, q.float()) * scale).view(b, sk, hkv, rep, d).sum(3)
        dv = torch.einsum("bhqk,bqhd->bkhd", p, do).view(b, sk, hkv, rep, d).sum(3)
        return dq, dk, dv, delta

    @staticmethod
    def _keep(sq: int, sk: int, causal: bool, left: int, right: int, entry: str, max_q: int, max_k: int) -> Tensor:
        return flash_mask(sq, sk, flash_window(causal, left, right, max_q, max_k, entry))  # [F1]-[F3]

    # ------------------------------------------------------------------ mha_fwd / mha_bwd

    def fwd(self, q, k, v, dropout_p, softmax_scale, causal, window_size_left, window_size_right, softcap, alibi_slopes,
            return_softmax):  # fmt: skip
        """``_flash_attn_forward`` (2.7+ arguments) -> ``(out, softmax_lse [B, H, Sq], S_dmask, rng_state)``."""
        q, k, v = _contig(q), _contig(k), _contig(v)
        self._inputs(q, k, v, dropout_p, softcap)
        _check(q.shape[0] > 0, "batch size must be positive")
        _check(alibi_slopes is None, "stand-in: alibi is not modelled")
        _check(not return_softmax, "return_softmax is only supported when p_dropout > 0.0")
        sq, sk = q.shape[1], k.shape[1]
        if sk == 0:  # [F9]
            return torch.zeros_like(q), torch.full((q.shape[0], q.shape[2], sq), math.inf), *self._extras(q)
        keep = self._keep(sq, sk, causal, window_size_left, window_size_right, "fwd", sq, sk)
        out, lse = self._fwd(q, k, v, softmax_scale, softcap, keep)
        return out, lse.contiguous(), *self._extras(q)

    @staticmethod
    def _extras(q: Tensor) -> tuple[Tensor, Tensor]:
        return torch.empty((0,), dtype=q.dtype), torch.empty((2,), dtype=torch.int64)  # S_dmask, rng_state

    def bwd(self, dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal, window_size_left,
            window_size_right, softcap, alibi_slopes, deterministic, rng_state=None):  # fmt: skip
        """``_flash_attn_backward`` (2.7+ arguments): fills ``dq, dk, dv``; returns ``softmax_d``."""
        dout, q, k, v, out = (_contig(t) for t in (dout, q, k, v, out))
        self._inputs(q, k, v, dropout_p, softcap, out, dout)
        b, sq, h, _ = q.shape
        sk = k.shape[1]
        _check(out.shape == q.shape and dout.shape == q.shape, "CHECK_SHAPE(out/dout)")
        # read by raw pointer as a contiguous float32 [B, H, Sq] [F11]; the stand-in refuses other layouts
        _check(softmax_lse.dtype == torch.float32, "softmax_lse must be float32")
        _check(tuple(softmax_lse.shape) == (b, h, sq) and softmax_lse.is_contiguous(), "softmax_lse [B, H, Sq]")
        grads = self._grad_buffers(q, k, v, dq, dk, dv)
        keep = self._keep(sq, sk, causal, window_size_left, window_size_right, "bwd", sq, sk)
        g_q, g_k, g_v, delta = self._bwd(dout, q, k, v, out, softmax_lse, softmax_scale, softcap, keep)
        for g, x in zip(grads, (g_q, g_k, g_v)):
            g.copy_(x)
        softmax_d = torch.zeros(b, h, -(-sq // 128) * 128, dtype=torch.float32)
        softmax_d[..., :sq] = delta
        return softmax_d

    @staticmethod
    def _grad_buffers(q: Tensor, k: Tensor, v: Tensor, *given: Tensor | None) -> list[Tensor]:
        out = []
        for name, g, ref in zip(("dq", "dk", "dv"), given, (q, k, v)):
            g = torch.empty_like(ref) if g is None else g
            _check(g.dtype == q.dtype, f"{name} must have the same dtype as q")
            _check(g.stride(-1) == 1, f"{name} must have contiguous last dimension")
            _check(g.shape == ref.shape, f"CHECK_SHAPE({name})")
            out.append(g)
        return out

    # ------------------------------------------------------------------ mha_varlen_fwd / mha_varlen_bwd

    def _spans(self, q, k, cu_q, cu_k, max_q, max_k) -> list[tuple[int, int, int, int]]:
        for name, cu in (("cu_seqlens_q", cu_q), ("cu_seqlens_k", cu_k)):
            _check(cu.dtype == torch.int32, f"{name} must have dtype int32")
            _check(cu.dim() == 1 and cu.is_contiguous(), f"{name} must be contiguous")
        _check(cu_q.numel() == cu_k.numel() and cu_q.numel() > 1, "CHECK_SHAPE(cu_seqlens_k, batch_size + 1)")
        spans = []
        for i in range(cu_q.numel() - 1):
            q0, q1, k0, k1 = int(cu_q[i]), int(cu_q[i + 1]), int(cu_k[i]), int(cu_k[i + 1])
            # stand-in strictness: the kernel would read out of bounds or skip rows without a word
            _check(0 <= q0 <= q1 <= q.shape[0] and 0 <= k0 <= k1 <= k.shape[0], "cu_seqlens beyond the rows")
            _check(q1 - q0 <= max_q and k1 - k0 <= max_k, "a sequence longer than max_seqlen")
            spans.append((q0, q1, k0, k1))
        return spans

    def varlen_fwd(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
                   causal, window_size_left=-1, window_size_right=-1, softcap=0.0, alibi_slopes=None,
                   return_softmax=False, block_table=None, leftpad_k=None, seqused_k=None,
                   zero_tensors=False):  # fmt: skip
        """``_flash_attn_varlen_forward``: ``[total, H, D]`` rows, ``softmax_lse [H, total_q]``. Each
        sequence under the window clamped against ``max_seqlen_k`` [F2]; rows of no sequence keep what
        ``torch::empty`` left (NaN here)."""
        q, k, v = _contig(q), _contig(k), _contig(v)
        self._inputs(q, k, v, dropout_p, softcap)
        _check(block_table is None and leftpad_k is None and seqused_k is None and alibi_slopes is None, "options")
        _check(not return_softmax, "return_softmax is only supported when p_dropout > 0.0")
        out = torch.full_like(q, math.nan)
        lse = torch.full((q.shape[1], q.shape[0]), math.nan, dtype=torch.float32)
        for q0, q1, k0, k1 in self._spans(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
            if k1 == k0:
                out[q0:q1], lse[:, q0:q1] = 0.0, math.inf
                continue
            keep = self._keep(q1 - q0, k1 - k0, causal, window_size_left, window_size_right, "varlen_fwd",
                              max_seqlen_q, max_seqlen_k)  # fmt: skip
            o, l_ = self._fwd(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], softmax_scale, softcap, keep)
            out[q0:q1], lse[:, q0:q1] = o[0], l_[0]
        return out, lse, *self._extras(q)

    def varlen_bwd(self, dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                   max_seqlen_k, dropout_p, softmax_scale, causal, window_size_left, window_size_right, softcap,
                   alibi_slopes, deterministic, rng_state=None, zero_tensors=False):  # fmt: skip
        """``_flash_attn_varlen_backward``: fills ``dq, dk, dv`` of the rows of some sequence from
        ``softmax_lse [H, total_q]`` (read raw, contiguous [F11]); returns ``softmax_d``."""
        dout, q, k, v, out = (_contig(t) for t in (dout, q, k, v, out))
        self._inputs(q, k, v, dropout_p, softcap, out, dout)
        h, tq = q.shape[1], q.shape[0]
        _check(out.shape == q.shape and dout.shape == q.shape, "CHECK_SHAPE(out/dout)")
        _check(softmax_lse.dtype == torch.float32, "softmax_lse must be float32")
        _check(tuple(softmax_lse.shape) == (h, tq) and softmax_lse.is_contiguous(), "softmax_lse [H, total_q]")
        grads = self._grad_buffers(q, k, v, dq, dk, dv)
        spans = self._spans(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
        for q0, q1, k0, k1 in spans:
            keep = self._keep(q1 - q0, k1 - k0, causal, window_size_left, window_size_right, "varlen_bwd",
                              max_seqlen_q, max_seqlen_k)  # fmt: skip
            g_q, g_k, g_v, _ = self._bwd(
                dout[None, q0:q1], q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], out[None, q0:q1],
                softmax_lse[None, :, q0:q1], softmax_scale, softcap, keep,
            )  # fmt: skip
            grads[0][q0:q1], grads[1][k0:k1], grads[2][k0:k1] = g_q[0], g_k[0], g_v[0]
        return torch.zeros(h, tq + 128 * len(spans), dtype=torch.float32)

    # ------------------------------------------------------------------ the release's Python names

    def fwd_26(self, q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, return_softmax):
        """2.6.x: ``window_size`` tuple; returns ``(out, q, k, v, out_padded, lse, S_dmask, rng_state)`` [F12]."""
        out, lse, s_dmask, rng = self.fwd(q, k, v, dropout_p, softmax_scale, causal, *window_size, softcap,
                                          alibi_slopes, return_softmax)  # fmt: skip
        return out, q, k, v, out, lse, s_dmask, rng

    def bwd_26(self, dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal, window_size,
               softcap, alibi_slopes, deterministic, rng_state=None):  # fmt: skip
        """2.6.x: ``window_size`` tuple; returns ``(dq, dk, dv, softmax_d)`` [F12]."""
        dq, dk, dv = self._grad_buffers(q, k, v, dq, dk, dv)
        d = self.bwd(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal, *window_size,
                     softcap, alibi_slopes, deterministic, rng_state)  # fmt: skip
        return dq, dk, dv, d

    def module(self) -> SimpleNamespace:
        """The private names of ``flash_attn.flash_attn_interface`` in this release (2.6.x: the dense pair
        only, as ``FlashAttnKernel`` uses them)."""
        if self.version < (2, 7, 0):
            return SimpleNamespace(_flash_attn_forward=self.fwd_26, _flash_attn_backward=self.bwd_26)
        return SimpleNamespace(
            _flash_attn_forward=self.fwd,
            _flash_attn_backward=self.bwd,
            _flash_attn_varlen_forward=self.varlen_fwd,
            _flash_attn_varlen_backward=self.varlen_bwd,
        )
