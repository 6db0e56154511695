"""CUDA block kernels: torch's flash op and torch's memory-efficient op (flash-attn 2: ``kernels_flash``).

Both follow ``BlockKernel`` (``hf_ring.ops.kernels``): ``[B, S, H, D]`` tensors, ``lse [B, S, H]``
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
* GPUs: torch's flash op runs on sm_80 and newer ("FlashAttention only supports Ampere GPUs or newer");
  flash-attn 2.6.3-2.7.2 on sm_8x and sm_90 only (sm_100 refused), 2.7.3+ on any sm_80+; the
  memory-efficient op's cutlass kernels are built for sm_50-sm_121 in fp16/fp32 and sm_80-sm_121 in
  bf16, up to a head dim of 65536.
* flash kernels (torch's and flash-attn's) give a row that sees no key ``lse = +inf`` (and out 0); the
  kernels here hand the ring ``-inf`` instead, the ``BlockKernel`` convention the merge relies on.

Each kernel's ``refuses(capability, dtype, head_dim, softcap, window)`` says what it cannot run, from
these facts; ``get_kernel``'s "auto" asks it. Sources, lines and versions: ``docs/standins.md``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

__all__ = ["TorchCUDAKernel", "TorchEfficientKernel"]

_MAX_FLASH_HEAD_DIM = 256
_MAX_EFFICIENT_HEAD_DIM = 65536  # kMaxK of the memory-efficient op's largest kernels
_LSE_ALIGN = 32  # kAlignLSE of the memory-efficient forward
_HALF = (torch.float16, torch.bfloat16)


def _no_key_rows(lse: Tensor) -> Tensor:
    """A flash kernel's ``lse`` with ``+inf`` (its mark of a row that sees no key) as ``-inf``."""
    return lse.masked_fill(torch.isposinf(lse), float("-inf"))


def _sm(capability: tuple[int, int]) -> str:
    return f"sm_{capability[0]}{capability[1]}"


def _beyond(op: str, head_dim: int | None, most: int, softcap: bool, window: bool) -> str:
    """What a torch op (no cap, no band) cannot run of a layer: a head dim above ``most``, a cap, a band."""
    if head_dim is not None and head_dim > most:
        return f"{op} has no kernel for head_dim {head_dim} > {most}"
    return f"{op} has no {'soft-capping' if softcap else 'sliding-window (band) mask'}" if softcap or window else ""


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

    def refuses(self, capability: tuple[int, int] | None, dtype: torch.dtype, head_dim: int | None,
                softcap: bool, window: bool) -> str:  # fmt: skip
        """Why this kernel cannot run a layer (``""``: it can)."""
        if capability is not None and capability[0] < 8:
            return f"torch's CUDA flash op needs sm_80 or newer, this GPU is {_sm(capability)}"
        if dtype not in _HALF:
            return f"torch's CUDA flash op takes float16/bfloat16 only, not {dtype}"
        return _beyond("torch's CUDA flash op", head_dim, _MAX_FLASH_HEAD_DIM, softcap, window)

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
        return res[0].transpose(1, 2)[..., :d], _no_key_rows(res[1]).transpose(1, 2)

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

    def refuses(self, capability: tuple[int, int] | None, dtype: torch.dtype, head_dim: int | None,
                softcap: bool, window: bool) -> str:  # fmt: skip
        """Why this kernel cannot run a layer (``""``: it can): its cutlass kernels are built for fp16/fp32
        on sm_50-sm_121 and bf16 on sm_80-sm_121 (``compute_dtype`` float32 runs bf16 below sm_80), up to a
        head dim of 65536."""
        run = self.compute_dtype or dtype
        if run not in (*_HALF, torch.float32):
            return f"torch's memory-efficient op takes float16/bfloat16/float32, not {dtype}"
        if capability is not None:
            cc = capability[0] * 10 + capability[1]
            if not (80 if run == torch.bfloat16 else 50) <= cc <= 121:
                return f"torch's memory-efficient op has no {run} kernel for {_sm(capability)}"
        return _beyond("torch's memory-efficient op", head_dim, _MAX_EFFICIENT_HEAD_DIM, softcap, window)

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
