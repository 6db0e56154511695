"""CUDA block kernels: torch's flash op, torch's memory-efficient op, and flash-attn 2.

All three follow ``BlockKernel`` (``hf_ring.ops.kernels``): ``[B, S, H, D]`` tensors, ``lse [B, S, H]``
float32, K/V with ``Hkv`` heads where ``Hq % Hkv == 0``. Each takes its op namespace or module as a
constructor argument, so the call contract can be tested on CPU against stand-ins with the real
signatures and checks (``tests/test_kernels.py``). This module imports only torch.

Facts the code relies on (torch 2.13 / flash-attn 2.6-2.8 sources):

* The CUDA flash ops (``flash_api.cpp`` ``mha_fwd``/``mha_bwd``, in torch and in flash-attn) accept only
  head dims that are multiples of 8 and at most 256, and accept ``Hq % Hkv == 0`` (they expand and sum
  dK/dV themselves). SDPA pads the head dim before calling the op (``attention.cpp``); the raw op does not,
  so the kernels here zero-pad (the scale is passed explicitly, so scores do not change).
* ``_scaled_dot_product_flash_attention_backward`` takes the varlen path whenever ``cum_seq_q`` is a
  defined tensor (``attention_backward.cu``) and then requires int32 lengths; the dense forward returns
  ``None`` there, which is what the backward must get back.
* The memory-efficient op (cutlass, ``_efficient_attention_forward/backward``) runs fp32 as well as
  fp16/bf16, takes ``[B, M, H, K]`` memory directly, returns a natural-log LSE padded along the sequence
  to a multiple of 32 (pad value ``+inf``), and its backward checks the LSE's batch/head strides are
  multiples of 8 and reads ``out`` as dense ``[B, M, H, Kv]`` (``o_strideM`` is implied).
* GPUs (``sdp_utils.cpp``): the flash ops run on sm_80 and newer only ("FlashAttention only supports
  Ampere GPUs or newer", flash-attn too); the memory-efficient op from sm_50, in fp16/fp32 below sm_80
  (its bf16 kernels are built for sm_80+).
"""

from __future__ import annotations

import importlib
import inspect
from types import ModuleType
from typing import Any

import torch
from torch import Tensor

__all__ = ["FlashAttnKernel", "TorchCUDAKernel", "TorchEfficientKernel"]

_MAX_FLASH_HEAD_DIM = 256
_LSE_ALIGN = 32  # kAlignLSE of the memory-efficient forward


def _pad8(t: Tensor) -> Tensor:
    """Zero-pad the head dim (last) to a multiple of 8; otherwise return ``t`` with a unit last stride."""
    d = t.shape[-1]
    if d % 8:
        return torch.nn.functional.pad(t, (0, 8 - d % 8))
    return t if t.stride(-1) == 1 else t.contiguous()


def _dense8(t: Tensor) -> Tensor:
    """``_pad8`` that also returns contiguous ``[B, S, H, D]`` memory (for ops that imply row strides)."""
    return _pad8(t).contiguous()


def _check_flash_head_dim(d: int, who: str) -> None:
    if d > _MAX_FLASH_HEAD_DIM:
        raise ValueError(
            f"head_dim {d} > {_MAX_FLASH_HEAD_DIM}: {who} has no kernel above {_MAX_FLASH_HEAD_DIM} "
            "(nor has flash-attn 2). Use backend='torch_efficient' (torch's memory-efficient CUDA op) "
            "or backend='reference'."
        )


def _no_band(window: tuple[int, int] | None, name: str) -> None:
    """torch's CUDA ops take no band mask here: refuse a block that crosses a sliding window's edge."""
    if window is not None:
        raise ValueError(
            f"backend={name!r} has no sliding-window (band) mask; backend='auto' runs windowed layers on "
            "flash-attn (`pip install hf-ring[flash]`) or, without it, on the reference kernel."
        )


def _expand_kv(k: Tensor, v: Tensor, rep: int) -> tuple[Tensor, Tensor]:
    if rep == 1:
        return k, v
    return k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)


def _sum_kv_groups(g: Tensor, hkv: int) -> Tensor:
    """``[B, S, Hq, D]`` gradient of expanded K/V -> ``[B, S, Hkv, D]`` (query head h reads h // rep)."""
    b, s, hq, d = g.shape
    return g if hq == hkv else g.reshape(b, s, hkv, hq // hkv, d).sum(3)


class TorchCUDAKernel:
    """torch's CUDA flash attention (``aten._scaled_dot_product_flash_attention`` and ``_backward``), fp16/bf16.

    K/V go in with their own (fewer) heads: the op accepts ``Hq % Hkv == 0`` and returns dK/dV with
    ``Hkv`` heads. Tensors go in as ``[B, H, S, D]`` views of ``[B, S, H, D]`` memory, which is what the op
    transposes them back to internally, so nothing is copied unless the head dim needs padding.

    The backward gets ``cum_seq_q/k = None`` (dense path, as returned by the forward) and the forward's
    own ``rng_state``/``unused`` tensors as ``philox_seed/offset``, the way torch's autograd formula and its
    context-parallel ring pass them; with dropout 0 the kernel never reads them (``mha_bwd``). The kernel
    keeps the last pair per device (they carry no data-dependent state at dropout 0).

    Causal is bottom-right aligned when ``Sq != Sk`` (flash-attn 2 semantics); the ring asks for causal
    only on square blocks.
    """

    name = "torch"
    softcap = False  # the op has no logit soft-capping
    window = False  # nor a band mask here (_no_band)
    heads_major = False  # the op works on [B, S, H, D] memory

    def __init__(self, ops: Any = None) -> None:
        self.ops = ops if ops is not None else torch.ops.aten
        self._rng: dict[torch.device, tuple[Tensor, Tensor]] = {}

    def forward(
        self, q: Tensor, k: Tensor, v: Tensor, *, causal: bool, scale: float, window: tuple[int, int] | None = None
    ) -> tuple[Tensor, Tensor]:
        """``q [B, Sq, Hq, D]``, ``k, v [B, Sk, Hkv, D]`` -> ``out [B, Sq, Hq, D]``, ``lse [B, Sq, Hq]`` float32."""
        _no_band(window, self.name)
        d = q.shape[-1]
        _check_flash_head_dim(d, "torch's CUDA flash op")
        qp, kp, vp = (_pad8(t).transpose(1, 2) for t in (q, k, v))
        res = self.ops._scaled_dot_product_flash_attention(qp, kp, vp, 0.0, causal, False, scale=scale)
        self._rng[q.device] = (res[6], res[7])
        return res[0].transpose(1, 2)[..., :d], res[1].transpose(1, 2)

    def backward(
        self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, *, causal: bool, scale: float,
        window: tuple[int, int] | None = None,
    ) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
        """Gradients shaped like ``q, k, v``; ``out``/``lse`` may be those of the merged attention."""
        _no_band(window, self.name)
        d, sq, sk = q.shape[-1], q.shape[1], k.shape[1]
        _check_flash_head_dim(d, "torch's CUDA flash op")
        dop, qp, kp, vp, op = (_pad8(t).transpose(1, 2) for t in (dout, q, k, v, out))
        # the kernel reads the LSE by raw pointer as contiguous float32 [B, H, Sq]
        lse_h = lse.transpose(1, 2).to(torch.float32).contiguous()
        seed, offset = self._rng.get(q.device) or self._no_rng(q.device)
        dq, dk, dv = self.ops._scaled_dot_product_flash_attention_backward(
            dop, qp, kp, vp, op, lse_h, None, None, sq, sk, 0.0, causal, seed, offset, scale=scale
        )
        return dq.transpose(1, 2)[..., :d], dk.transpose(1, 2)[..., :d], dv.transpose(1, 2)[..., :d]

    @staticmethod
    def _no_rng(device: torch.device) -> tuple[Tensor, Tensor]:
        """What the CUDA forward returns without dropout (backward before any forward on this device)."""
        return torch.empty(2, dtype=torch.uint64, device=device), torch.empty((), dtype=torch.uint64, device=device)


class TorchEfficientKernel:
    """torch's memory-efficient CUDA attention (``aten._efficient_attention_forward`` / ``_backward``).

    The route for float32 on CUDA (and for head dims above 256): O(S) memory like flash, fp32 math on fp32
    inputs (the reference kernel would materialise fp32 ``[B, H, Sq, Sk]`` scores). Works on
    ``[B, S, H, D]`` memory directly. Its backward checks ``query.size(2) == key.size(2)`` in the torch
    sources read (only newer cutlass kernels know GQA groups), so K/V are expanded to ``Hq`` heads here,
    after communication, and dK/dV summed back; the head dim is zero-padded to a multiple of 8 (the
    kernel's fp16 alignment, twice its fp32 one).

    LSE: the forward's ``[B, H, ceil32(Sq)]`` (natural log, ``+inf`` padding) is cut to ``Sq``; the backward
    rebuilds that padded layout (strides multiple of 8, as the kernel checks). Causal is top-left aligned
    (mask type 1, ``CausalFromTopLeft``).

    ``compute_dtype``: run the op in this dtype whatever the inputs' (outputs and gradients come back in
    the inputs' dtypes): float32 for bf16 inputs on GPUs older than Ampere, where the op has no bf16
    kernel (``get_kernel`` sets it there).
    """

    name = "torch_efficient"
    softcap = False  # the op has no logit soft-capping
    window = False  # nor a band mask here (_no_band)
    heads_major = False

    def __init__(self, ops: Any = None, compute_dtype: torch.dtype | None = None) -> None:
        self.ops = ops if ops is not None else torch.ops.aten
        self.compute_dtype = compute_dtype
        self._rng: dict[torch.device, tuple[Tensor, Tensor]] = {}

    def _in(self, *ts: Tensor) -> tuple[Tensor, ...]:
        return ts if self.compute_dtype is None else tuple(t.to(self.compute_dtype) for t in ts)

    def forward(
        self, q: Tensor, k: Tensor, v: Tensor, *, causal: bool, scale: float, window: tuple[int, int] | None = None
    ) -> tuple[Tensor, Tensor]:
        """``q [B, Sq, Hq, D]``, ``k, v [B, Sk, Hkv, D]`` -> ``out [B, Sq, Hq, D]``, ``lse [B, Sq, Hq]`` float32."""
        _no_band(window, self.name)
        if self.compute_dtype is not None and q.dtype != self.compute_dtype:
            out, lse = self.forward(*self._in(q, k, v), causal=causal, scale=scale)
            return out.to(q.dtype), lse
        d, sq = q.shape[-1], q.shape[1]
        kx, vx = _expand_kv(k, v, q.shape[2] // k.shape[2])
        out, lse, seed, offset, _, _ = self.ops._efficient_attention_forward(
            _pad8(q), _pad8(kx), _pad8(vx), None, None, None, None, None, 0.0, int(causal), True, scale=scale
        )
        self._rng[q.device] = (seed, offset)
        return out[..., :d], lse[..., :sq].transpose(1, 2)

    def backward(
        self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, *, causal: bool, scale: float,
        window: tuple[int, int] | None = None,
    ) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
        """Gradients shaped like ``q, k, v``; ``out``/``lse`` may be those of the merged attention."""
        _no_band(window, self.name)
        if self.compute_dtype is not None and q.dtype != self.compute_dtype:
            grads = self.backward(*self._in(dout, q, k, v, out), lse, causal=causal, scale=scale)
            return tuple(g.to(x.dtype) for g, x in zip(grads, (q, k, v)))  # type: ignore[return-value]
        (b, sq, hq, d), sk, hkv = q.shape, k.shape[1], k.shape[2]
        kx, vx = _expand_kv(k, v, hq // hkv)
        lse_p = torch.full(
            (b, hq, -(-sq // _LSE_ALIGN) * _LSE_ALIGN), float("inf"), dtype=torch.float32, device=q.device
        )
        lse_p[..., :sq] = lse.transpose(1, 2)
        seed, offset = self._rng.get(q.device) or self._no_rng(q.device)
        dq, dk, dv, _ = self.ops._efficient_attention_backward(
            _dense8(dout), _pad8(q), _pad8(kx), _pad8(vx), None, _dense8(out), None, None, sq, sk, lse_p,
            0.0, seed, offset, int(causal), False, scale=scale,
        )  # fmt: skip
        return dq[..., :d], _sum_kv_groups(dk[..., :d], hkv), _sum_kv_groups(dv[..., :d], hkv)

    @staticmethod
    def _no_rng(device: torch.device) -> tuple[Tensor, Tensor]:
        """What the forward returns without dropout (backward before any forward on this device)."""
        return torch.empty((), dtype=torch.int64, device=device), torch.empty((), dtype=torch.int64, device=device)


class FlashAttnKernel:
    """flash-attn 2 (CUDA, fp16/bf16), through its private forward/backward entry points.

    Call contract of ``flash_attn.flash_attn_interface`` from 2.7.0 through 2.8.x (checked up to
    2.8.4, where both names are ``torch.library`` custom ops; the public names
    ``_wrapped_flash_attn_*`` are ``torch.ops`` handles to the same ops)::

        _flash_attn_forward(q, k, v, dropout_p, softmax_scale, causal, window_size_left,
                            window_size_right, softcap, alibi_slopes, return_softmax)
            -> (out, softmax_lse [B, H, Sq] float32, S_dmask, rng_state)
        _flash_attn_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p,
                             softmax_scale, causal, window_size_left, window_size_right, softcap,
                             alibi_slopes, deterministic, rng_state=None)
            -> softmax_d                      (dq, dk, dv are filled in place)

    2.6.x takes one ``window_size`` tuple instead of the left/right pair; its forward returns
    ``(out, q, k, v, out_padded, softmax_lse, S_dmask, rng_state)`` and its backward
    ``(dq, dk, dv, softmax_d)``. Both forms are handled; older releases (no ``softcap``) are not.

    Packed documents (2.7+): ``_flash_attn_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k,
    max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal, window_size_left, window_size_right,
    softcap, alibi_slopes, return_softmax, ...) -> (out, softmax_lse [H, total_q], S_dmask, rng_state)``
    on ``[total, H, D]`` tensors with int32 cumulative lengths, and ``_flash_attn_varlen_backward(dout,
    q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
    dropout_p, softmax_scale, causal, window_size_left, window_size_right, softcap, alibi_slopes,
    deterministic, rng_state) -> softmax_d``. The ring hands a step's document blocks to them in one call
    per mask kind (``varlen = True``); with 2.6.x it calls the dense functions block by block.

    Layout is ``[B, S, H, D]`` natively and fewer K/V heads are accepted. Since 2.7 the CUDA op
    takes only head dims that are multiples of 8 (``flash_attn_func`` pads in Python), so other
    head dims are zero-padded here (the scale is passed explicitly, so scores do not change); above 256
    there is no kernel. Two differences from the ``BlockKernel`` wording, harmless for the ring, which
    asks for ``causal`` only on square blocks where every row sees a key: flash-attn aligns the causal
    mask bottom-right when ``Sq != Sk``, and it gives rows that see no key ``lse = +inf``.
    """

    name = "flash_attn"
    softcap = True  # passed to flash-attn's own softcap argument
    window = True  # passed as its window_size
    heads_major = False  # flash-attn takes [B, S, H, D] memory

    def __init__(self, module: ModuleType | Any = None) -> None:
        self.fa = module if module is not None else importlib.import_module("flash_attn.flash_attn_interface")
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
        return out[..., :d], lse.transpose(1, 2)

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
        scale: float, softcap: float = 0.0,
    ) -> tuple[Tensor, Tensor]:  # fmt: skip
        """Sequences packed along rows: ``q [Tq, Hq, D]``, ``k, v [Tk, Hkv, D]``, ``cu_q/cu_k`` int32
        ``[n + 1]`` -> ``out [Tq, Hq, D]``, ``lse [Tq, Hq]`` float32 (causal: square sequences only)."""
        d = q.shape[-1]
        _check_flash_head_dim(d, "flash-attn")
        q, k, v = _pad8(q), _pad8(k), _pad8(v)
        out, lse, _, _ = self.fa._flash_attn_varlen_forward(
            q, k, v, cu_q, cu_k, max_q, max_k, 0.0, scale, causal, -1, -1, softcap, None, False
        )
        return out[..., :d], lse.transpose(0, 1)

    def varlen_backward(
        self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, cu_q: Tensor, cu_k: Tensor,
        max_q: int, max_k: int, *, causal: bool, scale: float, softcap: float = 0.0,
    ) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
        """Gradients shaped like ``q, k, v`` (``[T, H, D]``) of ``varlen_forward``; ``out``/``lse``
        (``[Tq, Hq]``) may be those of the merged attention."""
        d = q.shape[-1]
        _check_flash_head_dim(d, "flash-attn")
        dout, q, k, v, out = (_pad8(t).contiguous() for t in (dout, q, k, v, out))
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        lse = lse.transpose(0, 1).to(torch.float32).contiguous()  # [H, Tq]
        self.fa._flash_attn_varlen_backward(
            dout, q, k, v, out, lse, dq, dk, dv, cu_q, cu_k, max_q, max_k,
            0.0, scale, causal, -1, -1, softcap, None, False, None,
        )  # fmt: skip
        return dq[..., :d], dk[..., :d], dv[..., :d]
