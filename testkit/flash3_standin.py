"""flash-attn 3 (flash-attention's ``hopper/``, commits 7ae5f8c 2025-03-21 .. 0251105 2026-08-15) on CPU: its
private entry points with the checks and window preprocessing of ``hopper/flash_api.cpp`` (``mha_fwd``,
``mha_bwd``, ``set_params_fprop``), the mask of ``hopper/mask.h`` and what its kernels do with rows that see no
key. Every rule cites ``docs/standins.md``'s row (``[H<n>]``).

``FlashAttn3StandIn(capability, build_flags, allow_fp32)`` answers for one build on one GPU; ``fwd``/``bwd``
have the custom ops' signatures (2025-07 on), ``fwd_plain``/``bwd_plain`` the plain functions' before
(one ``window_size`` tuple; the backward returns ``dq, dk, dv`` too). ``allow_fp32`` is a test allowance
(the library trains in fp16/bf16 only, [H2]), so the glue is compared with float64 tightly.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import torch
from torch import Tensor

from testkit.flash_rules import FlashWindow, flash_mask
from testkit.flash_standin import FlashAttnStandIn

__all__ = ["FlashAttn3StandIn", "fa3_window"]

_MATH = FlashAttnStandIn(allow_fp32=True)  # the same float32 attention math as flash-attn 2's kernels


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise RuntimeError(msg)  # what TORCH_CHECK raises


def _contig(x: Tensor | None) -> Tensor | None:
    """``maybe_contiguous`` of the Python wrapper [H3]."""
    return x.contiguous() if x is not None and x.stride(-1) != 1 else x


def fa3_window(causal: bool, left: int, right: int, seqlen_q: int, seqlen_k: int, forward: bool = True) -> FlashWindow:
    """The window ``mha_fwd`` / ``mha_bwd`` hand the kernel [H6]: ``left >= seqlen_k - 1 -> -1``,
    ``right >= seqlen_q - 1 -> -1`` (dense lengths, or a varlen call's ``max_seqlen_*``); forward only:
    ``seqlen_q == 1`` with no window turns ``causal`` off; ``causal`` sets ``right = 0``; then
    ``set_params_fprop``: ``is_causal = left < 0 and right == 0``, ``is_local`` otherwise when an edge is set,
    and a ``-1`` edge becomes ``seqlen_k - 1`` (left) / ``seqlen_q - 1`` (right)."""
    if left >= seqlen_k - 1:
        left = -1
    if right >= seqlen_q - 1:
        right = -1
    if forward and seqlen_q == 1 and left == -1 and right == -1:
        causal = False
    if causal:
        right = 0
    is_causal = left < 0 and right == 0
    is_local = (left >= 0 or right >= 0) and not is_causal
    left = seqlen_k - 1 if left < 0 else left
    right = seqlen_q - 1 if right < 0 else right
    return FlashWindow(is_causal, is_local, left, right)


class FlashAttn3StandIn:
    """One flash-attn 3 build (``build_flags``: ``flash_attn_config.CONFIG["build_flags"]``) on a GPU of
    compute ``capability``."""

    def __init__(
        self, capability: tuple[int, int] = (9, 0), build_flags: dict[str, bool] | None = None, allow_fp32: bool = False
    ) -> None:
        self.capability, self.flags, self.allow_fp32 = capability, dict(build_flags or {}), allow_fp32

    # ------------------------------------------------------------------ checks

    def _gpu(self) -> None:
        major = self.capability[0]
        _check(major >= 8, "FlashAttention only supports Ampere GPUs or newer.")  # [H1]
        # ARCH_SWITCH sends arch >= 90 to the sm_90a kernels, which run on sm_90 only [H1]
        sm8x_gone = major == 8 and self.flags.get("FLASHATTENTION_DISABLE_SM8x", False)
        _check(
            major in (8, 9) and not sm8x_gone, "CUDA error: no kernel image is available for execution on the device"
        )

    def _inputs(self, q: Tensor, k: Tensor, v: Tensor, softcap: float, window: tuple[int, int], *extra: Tensor) -> None:
        self._gpu()
        fp = (torch.float16, torch.bfloat16) + ((torch.float32,) if self.allow_fp32 else ())
        _check(q.dtype in fp, "FlashAttention only supports fp16, bf16, and fp8_e4m3 data type")  # [H2]
        for t in (k, v, *extra):
            _check(t.dtype == q.dtype, "query and key/value/out/dout must have the same dtype")
        for t in (q, k, v, *extra):
            _check(t.stride(-1) == 1, "Input tensor must have contiguous last dimension")  # [H3]
        d = q.shape[-1]
        dims = [h for h in (64, 96, 128, 192, 256) if not self.flags.get(f"FLASHATTENTION_DISABLE_HDIM{h}", False)]
        _check(d <= max(dims), f"FlashAttention forward only supports head dimension at most {max(dims)}")  # [H4]
        _check(d % 8 == 0 and v.shape[-1] % 8 == 0, "head_size should be a multiple of 8")  # [H4]
        _check(v.shape[-1] == d, "stand-in: equal Q/K and V head dims")
        _check(
            q.shape[-2] % k.shape[-2] == 0, "Number of heads in key/value must divide number of heads in query"
        )  # [H5]
        _check(k.shape == v.shape, "CHECK_SHAPE(k/v)")
        local = window != (-1, -1)
        _check(
            not (local and self.flags.get("FLASHATTENTION_DISABLE_LOCAL", False)),
            "This flash attention build does not support local attention.",
        )  # fmt: skip  [H7]
        _check(
            not (softcap > 0 and self.flags.get("FLASHATTENTION_DISABLE_SOFTCAP", False)),
            "This flash attention build does not support tanh softcapping.",
        )  # fmt: skip  [H7]

    def _varlen_ok(self) -> None:
        _check(
            not self.flags.get("FLASHATTENTION_DISABLE_VARLEN", False),
            "This flash attention build does not support varlen.",
        )  # fmt: skip  [H7]

    @staticmethod
    def _spans(q: Tensor, k: Tensor, cu_q: Tensor, cu_k: Tensor, max_q: int | None, max_k: int | None) -> list:
        for name, cu in (("cu_seqlens_q", cu_q), ("cu_seqlens_k", cu_k)):
            _check(cu.dtype == torch.int32, f"{name} must have dtype torch.int32")  # [H8]
            _check(cu.dim() == 1 and cu.is_contiguous(), f"{name} must be contiguous")
        _check(max_q is not None and max_k is not None, "max_seqlen_q/k must be provided if cu_seqlens_q/k is")
        _check(cu_q.numel() == cu_k.numel() and cu_q.numel() > 1, "CHECK_SHAPE(cu_seqlens_k, batch_size + 1)")
        spans = []
        for i in range(cu_q.numel() - 1):
            q0, q1, k0, k1 = int(cu_q[i]), int(cu_q[i + 1]), int(cu_k[i]), int(cu_k[i + 1])
            # stand-in strictness: the kernel would skip rows or read past the tensor without a word
            _check(0 <= q0 <= q1 <= q.shape[0] and 0 <= k0 <= k1 <= k.shape[0], "cu_seqlens beyond the rows")
            _check(q1 - q0 <= max_q and k1 - k0 <= max_k, "a sequence longer than max_seqlen")
            spans.append((q0, q1, k0, k1))
        return spans

    # ------------------------------------------------------------------ what the kernels compute

    @staticmethod
    def _attend(q, k, v, scale, softcap, w: FlashWindow) -> tuple[Tensor, Tensor]:
        """One batch of ``[B, S, H, D]`` sequences: out and ``lse [B, H, Sq]``, ``-inf`` for rows without keys [H9]."""
        out, lse = _MATH._fwd(q, k, v, scale, softcap, flash_mask(q.shape[1], k.shape[1], w))  # [H6]
        return out, lse.masked_fill(torch.isposinf(lse), -math.inf)

    @staticmethod
    def _grads(dout, q, k, v, out, lse, scale, softcap, w: FlashWindow):
        """The backward reads an lse of ``-inf`` as 0 (``flash_bwd_preprocess_kernel.h``) [H10]."""
        keep = flash_mask(q.shape[1], k.shape[1], w)
        return _MATH._bwd(dout, q, k, v, out, lse, scale, softcap, keep)[:3]

    # ------------------------------------------------------------------ the entry points (custom-op forms)

    def fwd(self, q, k, v, k_new=None, v_new=None, qv=None, out_=None, cu_seqlens_q=None, cu_seqlens_k=None,
            cu_seqlens_k_new=None, seqused_q=None, seqused_k=None, max_seqlen_q=None, max_seqlen_k=None,
            page_table=None, kv_batch_idx=None, leftpad_k=None, rotary_cos=None, rotary_sin=None, seqlens_rotary=None,
            q_descale=None, k_descale=None, v_descale=None, softmax_scale=None, causal=False, window_size_left=-1,
            window_size_right=-1, attention_chunk=0, softcap=0.0, rotary_interleaved=True, scheduler_metadata=None,
            num_splits=1, pack_gqa=None, sm_margin=0):  # fmt: skip
        """``_flash_attn_forward`` -> ``(out, softmax_lse, out_accum, softmax_lse_accum)``; ``softmax_lse``
        ``[B, H, Sq]`` (varlen ``[H, total_q]``) float32 [H8]."""
        q, k = _contig(q), _contig(k)
        v = v.contiguous() if v.stride(-1) != 1 and v.stride(-3) != 1 else v  # [H3]
        unused = (k_new, v_new, qv, out_, cu_seqlens_k_new, seqused_q, seqused_k, page_table, kv_batch_idx, leftpad_k,
                  rotary_cos, q_descale, scheduler_metadata)  # fmt: skip
        _check(all(x is None for x in unused) and attention_chunk == 0 and num_splits == 1, "stand-in: not modelled")
        self._inputs(q, k, v, softcap, (window_size_left, window_size_right))
        scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
        if cu_seqlens_q is None:
            sq, sk = q.shape[1], k.shape[1]
            if sk == 0:  # "If seqlen_k == 0 ... out zero, lse +inf" [H9]
                return (
                    torch.zeros_like(q),
                    torch.full((q.shape[0], q.shape[2], sq), math.inf),
                    torch.tensor([]),
                    torch.tensor([]),
                )
            w = fa3_window(causal, window_size_left, window_size_right, sq, sk)
            out, lse = self._attend(q, k, v, scale, softcap, w)
            return out, lse.contiguous(), torch.tensor([]), torch.tensor([])
        self._varlen_ok()
        out = torch.full_like(q, math.nan)  # rows of no sequence keep torch::empty's contents
        lse = torch.full((q.shape[1], q.shape[0]), math.nan, dtype=torch.float32)
        w = fa3_window(causal, window_size_left, window_size_right, max_seqlen_q, max_seqlen_k)
        for q0, q1, k0, k1 in self._spans(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
            o, l_ = self._attend(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], scale, softcap, w)
            out[q0:q1], lse[:, q0:q1] = o[0], l_[0]
        return out, lse, torch.tensor([]), torch.tensor([])

    def bwd(self, dout, q, k, v, out, softmax_lse, cu_seqlens_q=None, cu_seqlens_k=None, sequed_q=None, sequed_k=None,
            max_seqlen_q=None, max_seqlen_k=None, dq=None, dk=None, dv=None, softmax_scale=None, is_causal=False,
            window_size_left=-1, window_size_right=-1, softcap=0.0, deterministic=False, sm_margin=0):  # fmt: skip
        """``_flash_attn_backward``: fills ``dq, dk, dv`` (dK/dV summed over each K/V head's group [H5]), reading
        ``softmax_lse`` as a contiguous ``[B, H, Sq]`` (varlen ``[H, total_q]``) float32 [H8]; returns ``softmax_d``."""
        dout, q, k, v, out = (_contig(t) for t in (dout, q, k, v, out))
        _check(sequed_q is None and sequed_k is None, "stand-in: no seqused")
        self._inputs(q, k, v, softcap, (window_size_left, window_size_right), out, dout)
        _check(out.shape == q.shape and dout.shape == q.shape, "CHECK_SHAPE(out/dout)")
        _check(softmax_lse.dtype == torch.float32 and softmax_lse.is_contiguous(), "softmax_lse: contiguous float32")
        scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
        grads = [torch.empty_like(x) if g is None else g for g, x in ((dq, q), (dk, k), (dv, v))]
        for g, x in zip(grads, (q, k, v)):
            _check(g.shape == x.shape and g.dtype == x.dtype and g.stride(-1) == 1, "dq/dk/dv like q/k/v")
        if cu_seqlens_q is None:
            b, sq, h, _ = q.shape
            _check(tuple(softmax_lse.shape) == (b, h, sq), "softmax_lse [B, H, Sq]")
            w = fa3_window(is_causal, window_size_left, window_size_right, sq, k.shape[1], forward=False)
            for g, x in zip(grads, self._grads(dout, q, k, v, out, softmax_lse, scale, softcap, w)):
                g.copy_(x)
            return torch.zeros(b, h, sq + 128, dtype=torch.float32)
        self._varlen_ok()
        _check(tuple(softmax_lse.shape) == (q.shape[1], q.shape[0]), "softmax_lse [H, total_q]")
        w = fa3_window(is_causal, window_size_left, window_size_right, max_seqlen_q, max_seqlen_k, forward=False)
        for q0, q1, k0, k1 in self._spans(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
            parts = self._grads(dout[None, q0:q1], q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], out[None, q0:q1],
                                softmax_lse[None, :, q0:q1], scale, softcap, w)  # fmt: skip
            grads[0][q0:q1], grads[1][k0:k1], grads[2][k0:k1] = (p[0] for p in parts)
        return torch.zeros(q.shape[1], q.shape[0] + 128, dtype=torch.float32)

    # ------------------------------------------------------------------ the plain functions (2025-03 .. 2025-07)

    def fwd_plain(self, q, k, v, k_new, v_new, qv, out, cu_seqlens_q, cu_seqlens_k, cu_seqlens_k_new, seqused_q,
                  seqused_k, max_seqlen_q, max_seqlen_k, page_table, kv_batch_idx, leftpad_k, rotary_cos, rotary_sin,
                  seqlens_rotary, q_descale, k_descale, v_descale, softmax_scale, causal, window_size=(-1, -1),
                  attention_chunk=0, softcap=0.0, rotary_interleaved=True, scheduler_metadata=None, num_splits=1,
                  pack_gqa=None, sm_margin=0):  # fmt: skip
        """The plain ``_flash_attn_forward``: one ``window_size`` tuple [H11]."""
        return self.fwd(q, k, v, k_new, v_new, qv, out, cu_seqlens_q, cu_seqlens_k, cu_seqlens_k_new, seqused_q,
                        seqused_k, max_seqlen_q, max_seqlen_k, page_table, kv_batch_idx, leftpad_k, rotary_cos,
                        rotary_sin, seqlens_rotary, q_descale, k_descale, v_descale, softmax_scale, causal,
                        window_size[0], window_size[1], attention_chunk, softcap)  # fmt: skip

    def bwd_plain(self, dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, sequed_q, sequed_k, max_seqlen_q,
                  max_seqlen_k, dq, dk, dv, softmax_scale, causal, window_size=(-1, -1), softcap=0.0,
                  deterministic=False, sm_margin=0):  # fmt: skip
        """The plain ``_flash_attn_backward``: one ``window_size`` tuple; returns ``(dq, dk, dv, softmax_d)`` [H11]."""
        dq, dk, dv = (torch.empty_like(x) if g is None else g for g, x in ((dq, q), (dk, k), (dv, v)))
        left, right = window_size
        d = self.bwd(dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, sequed_q, sequed_k, max_seqlen_q,
                     max_seqlen_k, dq, dk, dv, softmax_scale, causal, left, right, softcap)  # fmt: skip
        return dq, dk, dv, d

    def module(self, plain: bool = False) -> SimpleNamespace:
        """``flash_attn_interface`` of this build (plain functions)."""
        if plain:
            return SimpleNamespace(_flash_attn_forward=self.fwd_plain, _flash_attn_backward=self.bwd_plain)
        return SimpleNamespace(_flash_attn_forward=self.fwd, _flash_attn_backward=self.bwd)
