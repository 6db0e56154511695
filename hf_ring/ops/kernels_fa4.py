"""flash-attn 4 (flash-attention's CuTe DSL kernels, ``flash_attn.cute``; package ``flash-attn-4``) as a block
kernel, dense and varlen. This module imports only torch (flash-attn 4 is imported when the kernel is made).

Call contract of ``flash_attn/cute/interface.py``, tags fa4-v4.0.0.beta0 (2026-03) to beta27 (2026-08), called
with keywords after the tensors (the positional order changed between betas)::

    _flash_attn_fwd(q, k, v, *, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
                    softmax_scale=None, causal=False, softcap=None, window_size_left=None,
                    window_size_right=None, return_lse=False, ...) -> (out, lse, ...)
    _flash_attn_bwd(q, k, v, out, dout, lse, *, softmax_scale=None, causal=False, softcap=0.0,
                    window_size_left=None, window_size_right=None, cu_seqlens_q=None, cu_seqlens_k=None,
                    max_seqlen_q=None, max_seqlen_k=None, ...) -> (dq, dk, dv, ...)

``lse`` is ``[B, H, Sq]`` float32 (varlen ``[H, total_q]``; ``return_lse=True`` makes the forward compute it);
a row that sees no key gets ``lse = -inf`` and out 0. A window edge of ``None`` is unbounded and there are
no clamps: key ``j`` is kept for query ``i`` iff ``i + Sk - Sq - left <= j <= i + Sk - Sq + right`` (the
band, bottom-right aligned), so every band is exact. The backward runs on sm_90 and newer (the forward also
on sm_80), in fp16/bf16; head dims: 8-256 on sm_90, 8-128 on sm_100/sm_110 (a (256, 256) kernel exists only
in later betas, refused here). Rules, files and lines: ``docs/standins.md`` (B1-B8).
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

import torch
from torch import Tensor

from .kernels_cuda import _HALF, _no_key_rows, _pad8, _sm

__all__ = ["FlashAttn4Kernel"]


def _max_head_dim(capability: tuple[int, int] | None) -> int:
    """``_validate_head_dims``: 256 on sm_90; 128 on sm_100/sm_110 (and where the GPU is not known)."""
    return 256 if capability is not None and capability[0] == 9 else 128


class FlashAttn4Kernel:
    """flash-attn 4 (CUDA, fp16/bf16) through ``flash_attn.cute.interface._flash_attn_fwd`` / ``_flash_attn_bwd``.

    ``module``: the interface module (imported when ``None``); ``capability``: the GPU's, for the head-dim
    limit of a call (``refuses`` takes it per layer). Layout ``[B, S, H, D]``, fewer K/V heads accepted;
    head dims zero-padded to a multiple of 8 (the 16-byte alignment of fp16/bf16). ``varlen = True``.
    """

    name = "flash_attn_4"
    softcap = True
    window = True
    heads_major = False
    varlen = True

    def __init__(self, module: ModuleType | Any = None, capability: tuple[int, int] | None = None) -> None:
        self.fa = module if module is not None else importlib.import_module("flash_attn.cute.interface")
        if not (hasattr(self.fa, "_flash_attn_fwd") and hasattr(self.fa, "_flash_attn_bwd")):
            raise ImportError("flash_attn.cute.interface has no _flash_attn_fwd/_flash_attn_bwd (not flash-attn 4)")
        self.capability = capability

    def refuses(self, capability: tuple[int, int] | None, dtype: torch.dtype, head_dim: int | None,
                softcap: bool, window: bool) -> str:  # fmt: skip
        """Why this kernel cannot run a layer (``""``: it can): fp16/bf16; a backward on sm_90, sm_100 or
        sm_110; head dims up to 256 on sm_90, 128 on sm_100/sm_110."""
        if dtype not in _HALF:
            return f"flash-attn 4 trains in float16/bfloat16 only, not {dtype}"
        if capability is not None and capability[0] not in (9, 10, 11):
            return f"flash-attn 4's backward runs on sm_90, sm_100 and sm_110, this GPU is {_sm(capability)}"
        most = _max_head_dim(capability)
        if head_dim is not None and head_dim > most:
            where = _sm(capability) if capability is not None else "an unknown GPU"
            return f"flash-attn 4 has no kernel for head_dim {head_dim} > {most} on {where}"
        return ""

    def _head_dim(self, d: int) -> None:
        most = _max_head_dim(self.capability)
        if d > most:
            raise ValueError(f"head_dim {d} > {most}: flash-attn 4 has no kernel for it here. Use backend='auto'.")

    @staticmethod
    def _window(window: tuple[int, int] | None) -> dict[str, int | None]:
        left, right = window if window is not None else (None, None)
        return {"window_size_left": left, "window_size_right": right}

    def _fwd(self, q, k, v, varlen: dict[str, Any], causal, scale, softcap, window) -> tuple[Tensor, Tensor]:
        d = q.shape[-1]
        self._head_dim(d)
        q, k, v = _pad8(q), _pad8(k), _pad8(v)
        res = self.fa._flash_attn_fwd(
            q, k, v, softmax_scale=scale, causal=causal, softcap=softcap or None, return_lse=True,
            **self._window(window), **varlen,
        )  # fmt: skip
        return res[0][..., :d], _no_key_rows(res[1])

    def _bwd(self, dout, q, k, v, out, lse, varlen: dict[str, Any], causal, scale, softcap, window):
        d = q.shape[-1]
        self._head_dim(d)
        dout, q, k, v, out = (_pad8(t).contiguous() for t in (dout, q, k, v, out))
        res = self.fa._flash_attn_bwd(
            q, k, v, out, dout, lse, softmax_scale=scale, causal=causal, softcap=float(softcap),
            **self._window(window), **varlen,
        )  # fmt: skip
        return res[0][..., :d], res[1][..., :d], res[2][..., :d]

    def forward(
        self, q: Tensor, k: Tensor, v: Tensor, *, causal: bool, scale: float, softcap: float = 0.0,
        window: tuple[int, int] | None = None,
    ) -> tuple[Tensor, Tensor]:  # fmt: skip
        """``q [B, Sq, Hq, D]``, ``k, v [B, Sk, Hkv, D]`` -> ``out [B, Sq, Hq, D]``, ``lse [B, Sq, Hq]`` float32."""
        out, lse = self._fwd(q, k, v, {}, causal, scale, softcap, window)
        return out, lse.transpose(1, 2)

    def backward(
        self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, *, causal: bool, scale: float,
        softcap: float = 0.0, window: tuple[int, int] | None = None,
    ) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
        """Gradients shaped like ``q, k, v``; ``out``/``lse`` may be those of the merged attention."""
        lse = lse.transpose(1, 2).to(torch.float32).contiguous()  # [B, H, Sq]
        return self._bwd(dout, q, k, v, out, lse, {}, causal, scale, softcap, window)

    @staticmethod
    def _packed(cu_q: Tensor, cu_k: Tensor, max_q: int, max_k: int) -> dict[str, Any]:
        return {"cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k, "max_seqlen_q": max_q, "max_seqlen_k": max_k}

    def varlen_forward(
        self, q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor, cu_k: Tensor, max_q: int, max_k: int, *, causal: bool,
        scale: float, softcap: float = 0.0, window: tuple[int, int] | None = None,
    ) -> tuple[Tensor, Tensor]:  # fmt: skip
        """Sequences packed along rows: ``q [Tq, Hq, D]``, ``k, v [Tk, Hkv, D]``, ``cu_q/cu_k`` int32 ``[n + 1]``
        -> ``out [Tq, Hq, D]``, ``lse [Tq, Hq]`` float32 (one ``window`` for all, each sequence bottom-right)."""
        out, lse = self._fwd(q, k, v, self._packed(cu_q, cu_k, max_q, max_k), causal, scale, softcap, window)
        return out, lse.transpose(0, 1)

    def varlen_backward(
        self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, cu_q: Tensor, cu_k: Tensor,
        max_q: int, max_k: int, *, causal: bool, scale: float, softcap: float = 0.0,
        window: tuple[int, int] | None = None,
    ) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
        """Gradients shaped like ``q, k, v`` (``[T, H, D]``) of ``varlen_forward``; ``lse [Tq, Hq]``."""
        lse = lse.transpose(0, 1).to(torch.float32).contiguous()  # [H, Tq]
        packed = self._packed(cu_q, cu_k, max_q, max_k)
        return self._bwd(dout, q, k, v, out, lse, packed, causal, scale, softcap, window)
