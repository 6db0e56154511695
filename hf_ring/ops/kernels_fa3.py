"""flash-attn 3 (the Hopper kernels of flash-attention's ``hopper/``) as a block kernel, dense and varlen.
This module imports only torch (flash-attn 3 itself is imported when the kernel is made).

Call contract of ``flash_attn_interface`` (package ``flash_attn_3``; also ``flash_attn_3.flash_attn_interface``
from 2026-07, and the ``flash_attn_interface`` of the HF kernels hub build ``kernels-community/flash-attn3``,
which is built from the same sources), flash-attention commits 7ae5f8c (2025-03-21) to 0251105 (2026-08)::

    _flash_attn_forward(q, k, v, k_new, v_new, qv, out, cu_seqlens_q, cu_seqlens_k, cu_seqlens_k_new,
                        seqused_q, seqused_k, max_seqlen_q, max_seqlen_k, page_table, kv_batch_idx, leftpad_k,
                        rotary_cos, rotary_sin, seqlens_rotary, q_descale, k_descale, v_descale,
                        softmax_scale, causal, window_size_left=-1, window_size_right=-1, attention_chunk=0,
                        softcap=0.0, ...) -> (out, softmax_lse, out_accum, softmax_lse_accum)
    _flash_attn_backward(dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k,
                         max_seqlen_q, max_seqlen_k, dq, dk, dv, softmax_scale, causal,
                         window_size_left=-1, window_size_right=-1, softcap=0.0, deterministic=False,
                         sm_margin=0) -> softmax_d            (dq, dk, dv filled in place)

``torch.library`` custom ops ``flash_attn_3::*`` since 2025-07; before, plain functions taking one
``window_size=(left, right)`` tuple (the backward also returning ``dq, dk, dv``): both are called here with the
same positional arguments and the window as keywords. ``softmax_lse`` is ``[B, H, Sq]`` float32 (varlen
``[H, total_q]``), read back by the backward as that contiguous layout; a row that sees no key gets
``lse = -inf`` and out 0. FA3's window clamps (``left >= Sk - 1``, ``right >= Sq - 1`` -> ``-1``, then
``Sk - 1`` / ``Sq - 1``) never change a band, so any ``(left, right)`` is exact. GPUs: sm_8x (its Ampere
path) and sm_90; the sm_90 kernels are built for sm_90a only, so sm_100 and newer are refused. A build may
leave out head dims, local (band) masks, soft-capping or varlen (``flash_attn_config.CONFIG["build_flags"]``):
``refuses`` reads them. Rules, files and lines: ``docs/standins.md`` (H1-H11).
"""

from __future__ import annotations

import importlib
import inspect
from types import ModuleType
from typing import Any

import torch
from torch import Tensor

from .kernels_cuda import _HALF, _no_key_rows, _pad8, _sm

__all__ = ["FlashAttn3Kernel", "import_flash_attn_3"]

_HEAD_DIMS = (64, 96, 128, 192, 256)  # the kernels' head dims; FLASHATTENTION_DISABLE_HDIM<d> drops one


def import_flash_attn_3() -> tuple[ModuleType, dict[str, bool]]:
    """flash-attn 3's interface module and its build flags (``{}`` when the build does not say them)."""
    try:
        fa = importlib.import_module("flash_attn_3.flash_attn_interface")
    except ImportError:
        fa = importlib.import_module("flash_attn_interface")
    try:
        flags = dict(importlib.import_module("flash_attn_config").CONFIG.get("build_flags", {}))
    except (ImportError, AttributeError):
        flags = {}
    return fa, flags


class FlashAttn3Kernel:
    """flash-attn 3 (CUDA, fp16/bf16) through its private forward/backward entry points.

    ``module``: the interface module (imported when ``None``); ``build_flags``: its
    ``flash_attn_config.CONFIG["build_flags"]``. Layout ``[B, S, H, D]``, fewer K/V heads accepted (dK/dV come
    back with ``Hkv`` heads); head dims zero-padded to a multiple of 8 (the scale is explicit). Windows are
    flash-attn's ``(window_size_left, window_size_right)``, aligned bottom-right; causal likewise (the ring
    asks for it on square blocks only). ``varlen = True`` unless the build has no varlen kernels.
    """

    name = "flash_attn_3"
    softcap = True
    window = True
    heads_major = False

    def __init__(self, module: ModuleType | Any = None, build_flags: dict[str, bool] | None = None) -> None:
        if module is None:
            module, found = import_flash_attn_3()
            build_flags = found if build_flags is None else build_flags
        self.fa = module
        self.flags = dict(build_flags or {})
        fwd = self.fa._flash_attn_forward
        try:  # a torch.library custom op (2025-07 on) keeps the function it was made from
            params = set(inspect.signature(getattr(fwd, "_init_fn", fwd)).parameters)
        except (TypeError, ValueError):
            params = set()
        self.legacy = "window_size" in params  # plain functions with one window tuple (2025-03 .. 2025-07)
        if params and "seqlens_rotary" not in params:
            raise ImportError(
                "flash-attn 3 is older than hf_ring knows (its _flash_attn_forward has no seqlens_rotary "
                "argument, added 2025-03-21); update flash-attn 3 or use backend='flash_attn'."
            )
        self.varlen = not self.flags.get("FLASHATTENTION_DISABLE_VARLEN", False)
        dims = [d for d in _HEAD_DIMS if not self.flags.get(f"FLASHATTENTION_DISABLE_HDIM{d}", False)]
        self.max_head_dim = max(dims, default=0)

    def refuses(self, capability: tuple[int, int] | None, dtype: torch.dtype, head_dim: int | None,
                softcap: bool, window: bool) -> str:  # fmt: skip
        """Why this kernel cannot run a layer (``""``: it can): fp16/bf16, head dims up to 256 (or the build's
        largest), sm_8x (unless the build left it out) or sm_90, and the band and cap when the build has them."""
        if dtype not in _HALF:
            return f"flash-attn 3 trains in float16/bfloat16 only, not {dtype}"
        if head_dim is not None and head_dim > self.max_head_dim:
            return f"flash-attn 3 (this build) has no kernel for head_dim {head_dim} > {self.max_head_dim}"
        if window and self.flags.get("FLASHATTENTION_DISABLE_LOCAL", False):
            return "this flash-attn 3 build has no local (sliding-window) attention"
        if softcap and self.flags.get("FLASHATTENTION_DISABLE_SOFTCAP", False):
            return "this flash-attn 3 build has no soft-capping"
        if capability is None:
            return ""
        if capability[0] < 8:
            return f"flash-attn 3 needs sm_80 or newer, this GPU is {_sm(capability)}"
        if capability[0] >= 10:
            return f"flash-attn 3's Hopper kernels are built for sm_90a and do not run on {_sm(capability)}"
        if capability[0] == 8 and self.flags.get("FLASHATTENTION_DISABLE_SM8x", False):
            return f"this flash-attn 3 build has no sm_8x kernels ({_sm(capability)})"
        return ""

    def _head_dim(self, d: int) -> None:
        if d > self.max_head_dim:
            raise ValueError(
                f"head_dim {d} > {self.max_head_dim}: flash-attn 3 has no kernel for it. Use backend='auto' "
                "(torch's memory-efficient op takes any head dim)."
            )

    def _window(self, window: tuple[int, int] | None) -> dict[str, Any]:
        left, right = window if window is not None else (-1, -1)
        if self.legacy:
            return {"window_size": (left, right)}
        return {"window_size_left": left, "window_size_right": right}

    def _fwd(self, q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, softcap, window) -> tuple[Tensor, Tensor]:
        d = q.shape[-1]
        self._head_dim(d)
        q, k, v = _pad8(q), _pad8(k), _pad8(v)
        nothing = (None,) * 6  # page_table, kv_batch_idx, leftpad_k, rotary_cos, rotary_sin, seqlens_rotary
        res = self.fa._flash_attn_forward(
            q, k, v, None, None, None, None, cu_q, cu_k, None, None, None, max_q, max_k, *nothing,
            None, None, None, scale, causal, softcap=softcap, **self._window(window),
        )  # fmt: skip
        return res[0][..., :d], _no_key_rows(res[1])

    def _bwd(self, dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale, softcap, window):
        d = q.shape[-1]
        self._head_dim(d)
        dout, q, k, v, out = (_pad8(t).contiguous() for t in (dout, q, k, v, out))
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        self.fa._flash_attn_backward(
            dout, q, k, v, out, lse, cu_q, cu_k, None, None, max_q, max_k, dq, dk, dv, scale, causal,
            softcap=softcap, **self._window(window),
        )  # fmt: skip
        return dq[..., :d], dk[..., :d], dv[..., :d]

    def forward(
        self, q: Tensor, k: Tensor, v: Tensor, *, causal: bool, scale: float, softcap: float = 0.0,
        window: tuple[int, int] | None = None,
    ) -> tuple[Tensor, Tensor]:  # fmt: skip
        """``q [B, Sq, Hq, D]``, ``k, v [B, Sk, Hkv, D]`` -> ``out [B, Sq, Hq, D]``, ``lse [B, Sq, Hq]`` float32."""
        out, lse = self._fwd(q, k, v, None, None, None, None, causal, scale, softcap, window)
        return out, lse.transpose(1, 2)

    def backward(
        self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, *, causal: bool, scale: float,
        softcap: float = 0.0, window: tuple[int, int] | None = None,
    ) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
        """Gradients shaped like ``q, k, v``; ``out``/``lse`` may be those of the merged attention."""
        lse = lse.transpose(1, 2).to(torch.float32).contiguous()  # [B, H, Sq]
        return self._bwd(dout, q, k, v, out, lse, None, None, None, None, causal, scale, softcap, window)

    def varlen_forward(
        self, q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor, cu_k: Tensor, max_q: int, max_k: int, *, causal: bool,
        scale: float, softcap: float = 0.0, window: tuple[int, int] | None = None,
    ) -> tuple[Tensor, Tensor]:  # fmt: skip
        """Sequences packed along rows: ``q [Tq, Hq, D]``, ``k, v [Tk, Hkv, D]``, ``cu_q/cu_k`` int32 ``[n + 1]``
        -> ``out [Tq, Hq, D]``, ``lse [Tq, Hq]`` float32 (one ``window`` for all, each sequence bottom-right)."""
        out, lse = self._fwd(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, softcap, window)
        return out, lse.transpose(0, 1)

    def varlen_backward(
        self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, cu_q: Tensor, cu_k: Tensor,
        max_q: int, max_k: int, *, causal: bool, scale: float, softcap: float = 0.0,
        window: tuple[int, int] | None = None,
    ) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
        """Gradients shaped like ``q, k, v`` (``[T, H, D]``) of ``varlen_forward``; ``lse [Tq, Hq]``."""
        lse = lse.transpose(0, 1).to(torch.float32).contiguous()  # [H, Tq]
        return self._bwd(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale, softcap, window)
