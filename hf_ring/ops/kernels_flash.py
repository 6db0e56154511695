"""flash-attn 2 as a block kernel (``FlashAttnKernel``), dense and varlen. This module imports only torch
(flash-attn itself is imported when the kernel is made)."""

from __future__ import annotations

import importlib
import inspect
from types import ModuleType
from typing import Any

import torch
from torch import Tensor

from .kernels_cuda import _HALF, _MAX_FLASH_HEAD_DIM, _check_flash_head_dim, _no_key_rows, _pad8, _sm

__all__ = ["FlashAttnKernel"]


class FlashAttnKernel:
    """flash-attn 2 (CUDA, fp16/bf16), through its private forward/backward entry points.

    Call contract of ``flash_attn.flash_attn_interface`` 2.7.0-2.8.3 (``torch.library`` custom ops on
    torch >= 2.4)::

        _flash_attn_forward(q, k, v, dropout_p, softmax_scale, causal, window_size_left,
                            window_size_right, softcap, alibi_slopes, return_softmax)
            -> (out, softmax_lse [B, H, Sq] float32, S_dmask, rng_state)
        _flash_attn_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale,
                             causal, window_size_left, window_size_right, softcap, alibi_slopes,
                             deterministic, rng_state=None) -> softmax_d    (dq, dk, dv filled in place)

    2.6.x takes one ``window_size`` tuple; its forward returns ``(out, q, k, v, out_padded, softmax_lse,
    S_dmask, rng_state)`` and its backward ``(dq, dk, dv, softmax_d)``; older releases (no ``softcap``)
    are refused. Packed documents (2.7+, ``varlen = True``): ``_flash_attn_varlen_forward/backward`` on
    ``[total, H, D]`` rows with int32 cumulative lengths and ``softmax_lse [H, total_q]``; the ring hands
    them a step's blocks, one call per mask kind. Layout ``[B, S, H, D]``, fewer K/V heads accepted;
    head dims zero-padded to a multiple of 8 (the scale is explicit, scores do not change); none above 256.

    Windows go in as ``(window_size_left, window_size_right)``; flash-attn clamps an edge ``>= Sk`` (varlen:
    ``max_seqlen_k``) and then reads it as ``Sk``, which changes a band only when ``right >= Sk`` and
    ``Sq >= Sk + 2``: the schedules make no such block (``schedule.flash_exact``). Causal is aligned
    bottom-right (the ring asks for it on square blocks only). A row that sees no key comes back with
    ``lse = -inf`` (flash-attn's ``+inf``, mapped). ``version``: the release (``flash_attn.__version__``),
    which decides the GPUs it runs on (``refuses``).
    """

    name = "flash_attn"
    softcap = True  # passed to flash-attn's own softcap argument
    window = True  # passed as its window_size
    heads_major = False  # flash-attn takes [B, S, H, D] memory

    def __init__(self, module: ModuleType | Any = None, version: str | None = None) -> None:
        self.fa = module if module is not None else importlib.import_module("flash_attn.flash_attn_interface")
        if version is None:
            version = getattr(self.fa, "__version__", None)
        if version is None and module is None:
            version = getattr(importlib.import_module("flash_attn"), "__version__", None)
        self.version = _release(version)
        try:  # 2.7+ custom ops show only (*args, **kwargs): that is the current form
            params = set(inspect.signature(self.fa._flash_attn_forward).parameters)
        except (TypeError, ValueError):
            params = set()
        self.legacy = "window_size" in params  # 2.6.x
        self.varlen = not self.legacy and hasattr(self.fa, "_flash_attn_varlen_forward")
        if "softmax_scale" in params and "softcap" not in params:
            raise ImportError(
                "flash-attn is too old for hf_ring (its _flash_attn_forward has no softcap "
                "argument); install flash-attn >= 2.6 or use backend='torch'."
            )

    def refuses(self, capability: tuple[int, int] | None, dtype: torch.dtype, head_dim: int | None,
                softcap: bool, window: bool) -> str:  # fmt: skip
        """Why this kernel cannot run a layer (``""``: it can): fp16/bf16, head dims up to 256, sm_8x and
        sm_90 (2.6.3-2.7.2) or any sm_80+ (2.7.3+)."""
        if dtype not in _HALF:
            return f"flash-attn takes float16/bfloat16 only, not {dtype}"
        if head_dim is not None and head_dim > _MAX_FLASH_HEAD_DIM:
            return f"flash-attn has no kernel for head_dim {head_dim} > {_MAX_FLASH_HEAD_DIM}"
        if capability is None:
            return ""
        if self.version is not None and self.version >= (2, 7, 3):
            ok = capability[0] >= 8
        else:  # 2.6.3-2.7.2 check major == 8 or sm_90 exactly (an unknown release: the same)
            ok = capability[0] == 8 or capability == (9, 0)
        v = ".".join(map(str, self.version)) if self.version else "of unknown version"
        return "" if ok else f"flash-attn {v} does not run on {_sm(capability)} (2.7.3+ runs on any sm_80+)"

    def forward(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        *,
        causal: bool,
        scale: float,
        softcap: float = 0.0,
        window: tuple[int, int] | None = None,
    ) -> tuple[Tensor, Tensor]:
        """``q [B, Sq, Hq, D]``, ``k, v [B, Sk, Hkv, D]`` -> ``out [B, Sq, Hq, D]``, ``lse [B, Sq, Hq]`` float32.
        ``window``: flash-attn's own ``(window_size_left, window_size_right)``."""
        d = q.shape[-1]
        _check_flash_head_dim(d, "flash-attn")
        q, k, v = _pad8(q), _pad8(k), _pad8(v)
        left, right = window if window is not None else (-1, -1)
        if self.legacy:
            res = self.fa._flash_attn_forward(q, k, v, 0.0, scale, causal, (left, right), softcap, None, False)
            out, lse = res[0], res[5]
        else:
            out, lse, _, _ = self.fa._flash_attn_forward(q, k, v, 0.0, scale, causal, left, right, softcap, None, False)
        return out[..., :d], _no_key_rows(lse).transpose(1, 2)

    def backward(
        self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, *, causal: bool, scale: float,
        softcap: float = 0.0, window: tuple[int, int] | None = None,
    ) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
        """Gradients shaped like ``q, k, v``; ``out``/``lse`` may be those of the merged attention."""
        d = q.shape[-1]
        _check_flash_head_dim(d, "flash-attn")
        dout, q, k, v, out = (_pad8(t) for t in (dout, q, k, v, out))
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        lse = lse.transpose(1, 2).to(torch.float32).contiguous()  # [B, H, Sq]
        left, right = window if window is not None else (-1, -1)
        if self.legacy:
            self.fa._flash_attn_backward(
                dout, q, k, v, out, lse, dq, dk, dv,
                0.0, scale, causal, (left, right), softcap, None, False, None,
            )  # fmt: skip
        else:
            self.fa._flash_attn_backward(
                dout, q, k, v, out, lse, dq, dk, dv,
                0.0, scale, causal, left, right, softcap, None, False, None,
            )  # fmt: skip
        return dq[..., :d], dk[..., :d], dv[..., :d]

    def varlen_forward(
        self, q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor, cu_k: Tensor, max_q: int, max_k: int, *, causal: bool,
        scale: float, softcap: float = 0.0, window: tuple[int, int] | None = None,
    ) -> tuple[Tensor, Tensor]:  # fmt: skip
        """Sequences packed along rows: ``q [Tq, Hq, D]``, ``k, v [Tk, Hkv, D]``, ``cu_q/cu_k`` int32
        ``[n + 1]`` -> ``out [Tq, Hq, D]``, ``lse [Tq, Hq]`` float32 (causal: square sequences only;
        ``window``: one band for every sequence, aligned to each one's bottom-right corner)."""
        d = q.shape[-1]
        _check_flash_head_dim(d, "flash-attn")
        q, k, v = _pad8(q), _pad8(k), _pad8(v)
        left, right = window if window is not None else (-1, -1)
        out, lse, _, _ = self.fa._flash_attn_varlen_forward(
            q, k, v, cu_q, cu_k, max_q, max_k, 0.0, scale, causal, left, right, softcap, None, False
        )
        return out[..., :d], _no_key_rows(lse).transpose(0, 1)

    def varlen_backward(
        self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, cu_q: Tensor, cu_k: Tensor,
        max_q: int, max_k: int, *, causal: bool, scale: float, softcap: float = 0.0,
        window: tuple[int, int] | None = None,
    ) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
        """Gradients shaped like ``q, k, v`` (``[T, H, D]``) of ``varlen_forward``; ``out``/``lse``
        (``[Tq, Hq]``) may be those of the merged attention."""
        d = q.shape[-1]
        _check_flash_head_dim(d, "flash-attn")
        dout, q, k, v, out = (_pad8(t).contiguous() for t in (dout, q, k, v, out))
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        lse = lse.transpose(0, 1).to(torch.float32).contiguous()  # [H, Tq]
        left, right = window if window is not None else (-1, -1)
        self.fa._flash_attn_varlen_backward(
            dout, q, k, v, out, lse, dq, dk, dv, cu_q, cu_k, max_q, max_k,
            0.0, scale, causal, left, right, softcap, None, False, None,
        )  # fmt: skip
        return dq[..., :d], dk[..., :d], dv[..., :d]


def _release(version: str | None) -> tuple[int, int, int] | None:
    """``"2.7.0.post2"`` -> ``(2, 7, 0)``; ``None`` when it cannot be read."""
    parts = []
    for piece in (version or "").split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit()) if piece[:1].isdigit() else ""
        if not digits:
            return None
        parts.append(int(digits))
    return (parts[0], parts[1], parts[2]) if len(parts) == 3 else None
