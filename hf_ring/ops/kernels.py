"""Block attention kernels: the compute under every ring step.

A kernel attends one block of queries to one block of keys and returns the block's output together
with the log-sum-exp (LSE) of its scores, which is all the ring needs to merge blocks exactly.
Layout everywhere is ``[B, S, H, D]``; keys and values may have fewer heads than queries
(grouped-query attention: query head ``h`` reads key head ``h // (Hq // Hkv)``).

``causal=True`` masks key ``j`` from query ``i`` when ``j > i`` (top-left aligned); the ring only asks
for it on square blocks. ``window=(left, right)`` (optional keyword) masks a band, aligned bottom-right
as in flash-attn: key ``j`` is visible to query ``i`` iff ``-left <= j - i - (Sk - Sq) <= right``
(``band_mask``); the ring passes it only for blocks that cross a sliding window's edge. The CUDA
kernels live in ``kernels_cuda`` and are re-exported here. ``get_kernel`` hands out one cached kernel
object per (backend, device type, dtype). This module imports only torch.
"""

from __future__ import annotations

import functools
import importlib.util
import warnings
from typing import Protocol

import torch
from torch import Tensor

from .kernels_cuda import FlashAttnKernel, TorchCUDAKernel, TorchEfficientKernel

__all__ = [
    "BACKENDS",
    "BlockKernel",
    "FlashAttnKernel",
    "ReferenceKernel",
    "TorchCPUKernel",
    "TorchCUDAKernel",
    "TorchEfficientKernel",
    "available_backends",
    "band_mask",
    "get_kernel",
]

BACKENDS = ("auto", "torch", "flash_attn", "torch_efficient", "reference")


class BlockKernel(Protocol):
    """What the ring needs from a block attention implementation.

    ``forward(q, k, v)`` with ``q: [B, Sq, Hq, D]``, ``k, v: [B, Sk, Hkv, D]`` returns
    ``out: [B, Sq, Hq, D]`` (dtype of ``q``, normalised within the block) and
    ``lse: [B, Sq, Hq]`` (float32; float64 for float64 inputs; ``-inf`` for rows that see no key).
    ``backward(dout, q, k, v, out, lse)`` returns ``(dq, dk, dv)`` shaped like ``q, k, v``; ``out``
    and ``lse`` may be those of the *whole* attention (merged over all blocks), which makes the
    block gradients exact contributions to the full gradients.

    ``heads_major``: the kernel reads K/V faster from ``[B, H, S, D]`` memory; the ring then keeps
    the K/V message it sends around in that order and hands the kernel ``[B, S, H, D]`` views of it.

    Blocks that cross a sliding window's edge come with ``window=(left, right)`` (``band_mask``) in
    both calls; kernels that take it: ``ReferenceKernel``, ``TorchCPUKernel``, ``FlashAttnKernel``.

    Optional: a kernel with ``varlen = True`` also has ``varlen_forward``/``varlen_backward`` over
    sequences packed along rows (``[T, H, D]`` with int32 cumulative lengths; ``FlashAttnKernel``),
    and the ring then makes a step's packed-document blocks one call per mask kind.
    """

    name: str
    heads_major: bool

    def forward(self, q: Tensor, k: Tensor, v: Tensor, *, causal: bool, scale: float) -> tuple[Tensor, Tensor]: ...

    def backward(
        self,
        dout: Tensor,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        out: Tensor,
        lse: Tensor,
        *,
        causal: bool,
        scale: float,
    ) -> tuple[Tensor, Tensor, Tensor]: ...


def band_mask(sq: int, sk: int, window: tuple[int, int], device: torch.device | str = "cpu") -> Tensor:
    """``[Sq, Sk]`` bool, True where key ``j`` is visible to query ``i``: ``-left <= j - i - (Sk - Sq) <= right``
    (``window = (left, right)``, flash-attn's bottom-right alignment)."""
    left, right = window
    d = torch.arange(sk, device=device)[None, :] - torch.arange(sq, device=device)[:, None] - (sk - sq)
    return (d >= -left) & (d <= right)


class ReferenceKernel:
    """Plain-torch attention in float32 (float64 for float64 inputs): the oracle and the fallback."""

    name = "reference"
    heads_major = False

    @staticmethod
    def _scores(q: Tensor, k: Tensor, causal: bool, scale: float, window: tuple[int, int] | None = None) -> Tensor:
        ct = torch.float64 if q.dtype == torch.float64 else torch.float32
        rep = q.shape[2] // k.shape[2]
        kx = k.to(ct).repeat_interleave(rep, dim=2)
        s = torch.einsum("bqhd,bkhd->bhqk", q.to(ct), kx) * scale  # (B, H, Sq, Sk)
        if causal:
            sq, sk = s.shape[-2:]
            mask = torch.ones(sq, sk, dtype=torch.bool, device=s.device).triu_(1)
            s = s.masked_fill(mask, float("-inf"))
        if window is not None:
            s = s.masked_fill(~band_mask(s.shape[-2], s.shape[-1], window, s.device), float("-inf"))
        return s

    def forward(
        self, q: Tensor, k: Tensor, v: Tensor, *, causal: bool, scale: float, window: tuple[int, int] | None = None
    ) -> tuple[Tensor, Tensor]:
        s = self._scores(q, k, causal, scale, window)
        lse = torch.logsumexp(s, dim=-1)  # (B, H, Sq)
        p = torch.exp(s - lse[..., None]).nan_to_num_(0.0)  # rows with no key: all zero
        rep = q.shape[2] // k.shape[2]
        vx = v.to(s.dtype).repeat_interleave(rep, dim=2)
        out = torch.einsum("bhqk,bkhd->bqhd", p, vx)
        return out.to(q.dtype), lse.transpose(1, 2)

    def backward(
        self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, *, causal: bool, scale: float,
        window: tuple[int, int] | None = None,
    ) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
        s = self._scores(q, k, causal, scale, window)
        ct = s.dtype
        lse_t = lse.to(ct).transpose(1, 2)[..., None]  # (B, H, Sq, 1)
        p = torch.exp(s - lse_t).nan_to_num_(0.0)
        rep = q.shape[2] // k.shape[2]
        kx = k.to(ct).repeat_interleave(rep, dim=2)
        vx = v.to(ct).repeat_interleave(rep, dim=2)
        do = dout.to(ct)
        dv = torch.einsum("bhqk,bqhd->bkhd", p, do)
        dp = torch.einsum("bqhd,bkhd->bhqk", do, vx)
        delta = (do * out.to(ct)).sum(-1).transpose(1, 2)[..., None]  # (B, H, Sq, 1)
        ds = p * (dp - delta)
        dq = torch.einsum("bhqk,bkhd->bqhd", ds, kx) * scale
        dk = torch.einsum("bhqk,bqhd->bkhd", ds, q.to(ct)) * scale
        b, sk, hkv, d = k.shape
        dk = dk.view(b, sk, hkv, rep, d).sum(3)
        dv = dv.view(b, sk, hkv, rep, d).sum(3)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class TorchCPUKernel:
    """torch's fused CPU flash attention (``aten._scaled_dot_product_flash_attention_for_cpu``).

    Takes fewer K/V heads directly and ``[B, H, S, D]`` views over ``[B, S, H, D]`` memory, so
    nothing is copied or expanded on the way in. A band (``window``) goes in as an additive
    ``[Sq, Sk]`` mask in the inputs' dtype (the op's own ``attn_mask``; rows that see no key get
    ``lse = -inf`` here, where the op reports 0).
    """

    name = "torch"
    heads_major = True  # its backward reads K/V 3-5% faster from [B, H, S, D] memory (benchmarks/NOTES.md)

    @staticmethod
    def _mask(q: Tensor, k: Tensor, window: tuple[int, int] | None) -> tuple[Tensor | None, Tensor | None]:
        if window is None:
            return None, None
        seen = band_mask(q.shape[1], k.shape[1], window, q.device)
        return torch.zeros(seen.shape, dtype=q.dtype, device=q.device).masked_fill_(~seen, float("-inf")), seen

    def forward(
        self, q: Tensor, k: Tensor, v: Tensor, *, causal: bool, scale: float, window: tuple[int, int] | None = None
    ) -> tuple[Tensor, Tensor]:
        mask, seen = self._mask(q, k, window)
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), 0.0, causal, attn_mask=mask, scale=scale
        )
        lse = lse.transpose(1, 2)
        if seen is not None and not bool(seen.any(1).all()):
            lse = lse.masked_fill(~seen.any(1)[None, :, None], float("-inf"))
        return out.transpose(1, 2), lse

    def backward(
        self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, *, causal: bool, scale: float,
        window: tuple[int, int] | None = None,
    ) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout.transpose(1, 2),
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            out.transpose(1, 2),
            lse.transpose(1, 2).to(torch.float64 if q.dtype == torch.float64 else torch.float32),
            0.0,
            causal,
            attn_mask=self._mask(q, k, window)[0],
            scale=scale,
        )
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


def _flash_attn_importable() -> bool:
    try:
        return importlib.util.find_spec("flash_attn") is not None
    except (ImportError, ValueError):
        return False


@functools.cache
def _flash_attn() -> tuple[FlashAttnKernel | None, str]:
    """``(kernel, "")`` when flash-attn imports and is recent enough, else ``(None, why)``.

    Cached, so the import and the signature inspection happen once per process. An installed package
    that fails to import (typically a binary built against another torch: ``undefined symbol``) is
    reported once with a warning; "auto" then uses torch's CUDA flash op instead of failing.
    """
    if not _flash_attn_importable():
        return None, "the flash_attn package is not installed"
    try:
        return FlashAttnKernel(), ""
    except Exception as e:  # ImportError / OSError from the extension, or too old: not usable either way
        why = f"flash_attn is installed but unusable ({type(e).__name__}: {e})"
        warnings.warn(f"{why}; hf_ring uses torch's CUDA flash op instead.", RuntimeWarning, stacklevel=2)
        return None, why


_AMPERE = (8, 0)  # flash-attn and torch's CUDA flash op need sm_80 or newer


def _cuda_capability(device: torch.device) -> tuple[int, int] | None:
    """``(major, minor)`` of a CUDA device (the current one for ``"cuda"``), ``None`` where CUDA cannot
    be asked (a CPU-only build: the CUDA paths are then only called against stand-ins)."""
    index = device.index
    if index is None:
        try:
            index = torch.cuda.current_device()
        except (AssertionError, RuntimeError):
            index = None
    return _capability(index)


@functools.cache
def _capability(index: int | None) -> tuple[int, int] | None:
    try:
        major, minor = torch.cuda.get_device_capability(index)
    except (AssertionError, RuntimeError):
        return None
    return int(major), int(minor)


def _pre_ampere(capability: tuple[int, int] | None) -> bool:
    return capability is not None and capability < _AMPERE


@functools.cache
def _warn_pre_ampere(capability: tuple[int, int]) -> None:
    """Once per process and GPU model: "auto" falls back from the flash kernels."""
    warnings.warn(
        f"this GPU is sm_{capability[0]}{capability[1]}, older than Ampere (sm_80), which flash-attn and torch's "
        "flash attention need; hf_ring's ring attention uses torch's memory-efficient op instead "
        "(backend='torch_efficient'), with bfloat16 inputs computed in float32 (that op has no bfloat16 "
        "kernel before sm_80: prefer float16 on this GPU).",
        RuntimeWarning,
        stacklevel=4,
    )


def available_backends(device: torch.device | str = "cpu") -> list[str]:
    """Names accepted by ``get_kernel`` on this device, best first."""
    device = torch.device(device)
    if device.type == "cuda":
        if _pre_ampere(_cuda_capability(device)):
            return ["torch_efficient", "reference"]
        names = ["flash_attn"] if _flash_attn()[0] is not None else []
        return [*names, "torch", "torch_efficient", "reference"]
    return ["torch", "reference"]


def get_kernel(backend: str, device: torch.device | str, dtype: torch.dtype) -> BlockKernel:
    """The block kernel for ``backend`` (one of ``BACKENDS``) on ``device`` for ``dtype`` inputs.

    "auto" picks, on CUDA: flash-attn for fp16/bf16 when it imports (else torch's flash op), torch's
    memory-efficient op for float32 (the reference would materialise float32 ``[B, H, Sq, Sk]`` scores:
    tens of GiB per block at long context; the efficient op keeps O(S) memory and returns the LSE), and
    the reference only for float64. On a GPU older than Ampere (compute capability below 8.0: T4, V100),
    where neither flash kernel runs, it picks the memory-efficient op for fp16/bf16 too (bf16 computed
    in float32 there, as the op has no bf16 kernel before sm_80), with one warning. On CPU it picks
    torch's fused CPU op (any float dtype). An explicit backend that cannot run here raises
    ``ValueError``. Kernel objects are cached per (backend, device type, dtype, compute capability):
    they hold no per-call state the ring depends on.
    """
    device = torch.device(device)
    capability = _cuda_capability(device) if device.type == "cuda" else None
    return _kernel(backend, device.type, dtype, capability)


@functools.cache
def _kernel(
    backend: str, device_type: str, dtype: torch.dtype, capability: tuple[int, int] | None = None
) -> BlockKernel:
    half = dtype in (torch.float16, torch.bfloat16)
    cuda = device_type == "cuda"
    old_gpu = cuda and _pre_ampere(capability)
    if backend == "auto":
        if not cuda:
            return _kernel("torch", device_type, dtype, capability)
        if half and old_gpu:
            _warn_pre_ampere(capability)
            return _kernel("torch_efficient", device_type, dtype, capability)
        if half:
            fa = _flash_attn()[0]
            return fa if fa is not None else _kernel("torch", device_type, dtype, capability)
        return _kernel("torch_efficient" if dtype == torch.float32 else "reference", device_type, dtype, capability)
    if old_gpu and backend in ("torch", "flash_attn"):
        raise ValueError(
            f"backend={backend!r} needs an Ampere or newer GPU (compute capability 8.0+); this one is "
            f"sm_{capability[0]}{capability[1]}. Use backend='torch_efficient' or backend='auto'."
        )
    if backend == "reference":
        return ReferenceKernel()
    if backend == "torch":
        if device_type == "cpu":
            return TorchCPUKernel()
        if cuda and half:
            return TorchCUDAKernel()
        raise ValueError(
            f"backend='torch' has no kernel for {dtype} on {device_type}; its CUDA flash op takes "
            "float16/bfloat16 only. Use backend='torch_efficient' (float32 on CUDA), backend='auto', "
            "or cast the inputs to bfloat16."
        )
    if backend == "torch_efficient":
        if not cuda or dtype not in (torch.float16, torch.bfloat16, torch.float32):
            raise ValueError(
                f"backend='torch_efficient' needs CUDA tensors in float16/bfloat16/float32, got {dtype} on "
                f"{device_type}. Use backend='auto'."
            )
        if old_gpu and dtype == torch.bfloat16:  # its cutlass kernels take bf16 on sm_80+ only
            return TorchEfficientKernel(compute_dtype=torch.float32)
        return TorchEfficientKernel()
    if backend == "flash_attn":
        if not cuda or not half:
            raise ValueError(
                f"backend='flash_attn' needs CUDA tensors in float16/bfloat16, got {dtype} on "
                f"{device_type}. Use backend='auto'."
            )
        fa, why = _flash_attn()
        if fa is None:
            hint = (
                "install it with `pip install hf-ring[flash]`"
                if "not installed" in why
                else "reinstall it for this torch"
            )
            raise ValueError(f"backend='flash_attn' but {why}; {hint} or use backend='auto'.")
        return fa
    raise ValueError(f"unknown backend {backend!r}; choose one of " + ", ".join(map(repr, BACKENDS)) + ".")
