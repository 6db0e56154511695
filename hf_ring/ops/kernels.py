"""Block attention kernels: the compute under every ring step.

A kernel attends one block of queries to one block of keys and returns the block's output together
with the log-sum-exp (LSE) of its scores, which is all the ring needs to merge blocks exactly.
Layout everywhere is ``[B, S, H, D]``; keys and values may have fewer heads than queries
(grouped-query attention: query head ``h`` reads key head ``h // (Hq // Hkv)``).

``causal=True`` masks key ``j`` from query ``i`` when ``j > i`` (top-left aligned); the ring only asks
for it on square blocks. ``window=(left, right)`` (optional keyword) masks a band, aligned bottom-right
as in flash-attn: key ``j`` is visible to query ``i`` iff ``-left <= j - i - (Sk - Sq) <= right``
(``band_mask``); the ring passes it only for blocks that cross a sliding window's edge. The kernels
live in ``kernels_cpu``, ``kernels_cuda``, ``kernels_flash`` (flash-attn 2), ``kernels_cudnn`` (cuDNN through
torch), ``kernels_fa3`` and ``kernels_fa4`` (flash-attn 3 and 4) and are re-exported here. Each says what it
cannot run (``refuses(capability, dtype, head_dim, softcap, window)``); ``get_kernel`` hands out one cached
kernel object per (backend, device type, dtype, GPU), "auto" the fastest that runs the layer on that GPU
(``CANDIDATES``), and says once per process and choice which (a log line of the ``hf_ring`` logger).
This module imports only torch.
"""

from __future__ import annotations

import difflib
import functools
import importlib.util
import logging
import warnings
from typing import Protocol

import torch
from torch import Tensor

from .kernels_cpu import ReferenceKernel, TorchCPUKernel, band_mask
from .kernels_cuda import TorchCUDAKernel, TorchEfficientKernel
from .kernels_cudnn import CudnnKernel
from .kernels_fa3 import FlashAttn3Kernel
from .kernels_fa4 import FlashAttn4Kernel
from .kernels_flash import FlashAttnKernel
from .kernels_libs import INSTALL, cudnn_kernel, flash_attn_3_kernel, flash_attn_4_kernel

_flash_attn_3 = flash_attn_3_kernel  # module names the tests replace
_flash_attn_4 = flash_attn_4_kernel
_cudnn = cudnn_kernel

__all__ = [
    "BACKENDS",
    "CANDIDATES",
    "BlockKernel",
    "CudnnKernel",
    "FlashAttn3Kernel",
    "FlashAttn4Kernel",
    "FlashAttnKernel",
    "ReferenceKernel",
    "TorchCPUKernel",
    "TorchCUDAKernel",
    "TorchEfficientKernel",
    "available_backends",
    "band_mask",
    "check_backend",
    "get_kernel",
]

BACKENDS = ("auto", "torch", "flash_attn", "flash_attn_3", "flash_attn_4", "cudnn", "torch_efficient", "reference")

# What "auto" tries for fp16/bf16 on CUDA, fastest first, by GPU generation (then torch's flash op, its
# memory-efficient op, the reference kernel): flash-attn 3 / 4 on the GPUs their kernels are built for,
# cuDNN where torch itself prefers it (sm_90, sm_100: sdp_utils.cpp check_prefer_cudnn_attention), flash-attn 2.
CANDIDATES = {
    "sm_8x": ("flash_attn",),
    "sm_90": ("flash_attn_3", "cudnn", "flash_attn"),
    "sm_100+": ("flash_attn_4", "cudnn", "flash_attn"),
}
_LOG = logging.getLogger("hf_ring")


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
    both calls; kernels that take it have ``window = True``: ``ReferenceKernel``, ``TorchCPUKernel``,
    ``FlashAttnKernel`` (torch's CUDA ops refuse a band).

    Optional: a kernel with ``softcap = True`` takes a keyword ``softcap: float`` in every method
    (``0``: none; ``> 0``: scores capped to ``softcap * tanh(scores / softcap)`` before masking, as
    Gemma 2 does); the ring passes it only when it is nonzero. A kernel with ``varlen = True`` also
    has ``varlen_forward``/``varlen_backward`` over sequences packed along rows (``[T, H, D]`` with
    int32 cumulative lengths, one ``window`` for all, aligned to each sequence's bottom-right corner;
    ``FlashAttnKernel``), and the ring then makes a step's blocks one call per mask kind
    (``hf_ring.ops.varlen``). ``refuses(capability, dtype, head_dim, softcap, window) -> str`` says why
    the kernel cannot run a layer (``""``: it can); ``get_kernel``'s "auto" asks it.
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


def _library(name: str) -> tuple[BlockKernel | None, str]:
    """``(kernel, "")`` of an optional library's backend, or ``(None, why)`` (each probe runs once)."""
    probes = {"flash_attn": _flash_attn, "flash_attn_3": _flash_attn_3, "flash_attn_4": _flash_attn_4,
              "cudnn": _cudnn}  # fmt: skip
    return probes[name]()


def check_backend(name: object) -> str:
    """``name`` if it is one of ``BACKENDS``, else ``ValueError`` naming the closest one."""
    if isinstance(name, str) and name in BACKENDS:
        return name
    near = difflib.get_close_matches(str(name).lower(), BACKENDS, n=1, cutoff=0.6)
    hint = f" (did you mean {near[0]!r}?)" if near else ""
    raise ValueError(f"unknown attention backend {name!r}{hint}; choose one of " + ", ".join(map(repr, BACKENDS)))


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
        capability = _cuda_capability(device)
        if _pre_ampere(capability):
            return ["torch_efficient", "reference"]
        fused = [n for n in _fused(capability) if _library(n)[0] is not None]
        return [*fused, "torch", "torch_efficient", "reference"]
    return ["torch", "reference"]


def get_kernel(
    backend: str,
    device: torch.device | str,
    dtype: torch.dtype,
    softcap: bool = False,
    window: bool = False,
    head_dim: int | None = None,
) -> BlockKernel:
    """The block kernel for ``backend`` (one of ``BACKENDS``) on ``device`` for ``dtype`` inputs of
    ``head_dim`` (``None``: not checked here; the kernel raises on one it has no kernel for), with
    logit soft-capping (``softcap``) and/or band blocks (``window``: sliding windows, chunks).

    "auto" takes, on CUDA, the first of these that runs the layer on this GPU (each kernel's
    ``refuses``: compute capability, dtype, head dim, soft-capping, band): for fp16/bf16 flash-attn
    (when it imports: head dims up to 256, sm_8x/sm_90, any sm_80+ from 2.7.3), torch's flash op (sm_80+,
    head dims up to 256, no cap, no band), torch's memory-efficient op (head dims up to 65536; sm_50+
    in fp16, sm_80+ in bf16, and bf16 computed in float32 before sm_80, with one warning), the reference
    kernel (float32 math tiled over query rows: any shape, cap and band); for float32 the memory-efficient
    op, then the reference; for float64 the reference. On CPU: torch's fused CPU op (any float dtype, a
    band as a mask), the reference with soft-capping. Attention sinks need nothing of a kernel (they
    join the merged result in torch). Windowed blocks that fall back from a fused op to the reference
    warn once per process and op. An explicit backend that cannot run the layer raises ``ValueError``
    naming why. Kernel objects are cached per (backend, device type, dtype, compute capability), and the
    choice per (backend, device type, dtype, capability, head dim, softcap, window): they hold no
    per-call state the ring depends on.
    """
    device = torch.device(device)
    capability = _cuda_capability(device) if device.type == "cuda" else None
    return _choose(backend, device.type, dtype, capability, head_dim, bool(softcap), bool(window))


def _fused(capability: tuple[int, int] | None) -> tuple[str, ...]:
    """``CANDIDATES`` of a GPU (an unknown one: flash-attn 2's, which runs on any sm_80+ since 2.7.3)."""
    if capability is None or capability < (9, 0):
        return CANDIDATES["sm_8x"]
    return CANDIDATES["sm_90" if capability[0] == 9 else "sm_100+"]


def _candidates(device_type: str, dtype: torch.dtype, capability: tuple[int, int] | None) -> tuple[str, ...]:
    """The kernels "auto" tries, fastest first (those not installed are passed over)."""
    if device_type != "cuda":
        return ("torch", "reference")
    if dtype in (torch.float16, torch.bfloat16):
        return (*_fused(capability), "torch", "torch_efficient", "reference")
    return ("torch_efficient", "reference") if dtype == torch.float32 else ("reference",)


@functools.cache
def _choose(
    backend: str, device_type: str, dtype: torch.dtype, capability: tuple[int, int] | None, head_dim: int | None,
    softcap: bool, window: bool,
) -> BlockKernel:  # fmt: skip
    if backend != "auto":
        kernel = _kernel(backend, device_type, dtype, capability)
        why = kernel.refuses(capability, dtype, head_dim, softcap, window)  # type: ignore[attr-defined]
        if why:
            alt = "'auto', 'reference' or 'flash_attn' (CUDA, fp16/bf16)" if softcap or window else "'auto'"
            raise ValueError(f"backend={backend!r} cannot run this layer: {why}. Use backend={alt}.")
        return kernel
    for name in _candidates(device_type, dtype, capability):
        try:
            kernel = _kernel(name, device_type, dtype, capability)
        except ValueError:  # no such kernel for this device and dtype, or its library is not installed
            continue
        if kernel.refuses(capability, dtype, head_dim, softcap, window):  # type: ignore[attr-defined]
            continue
        if isinstance(kernel, TorchEfficientKernel) and kernel.compute_dtype is not None:
            _warn_pre_ampere(capability)
        if window and isinstance(kernel, ReferenceKernel):
            fused = _choose(backend, device_type, dtype, capability, head_dim, softcap, False)
            if not isinstance(fused, ReferenceKernel):
                _warn_no_band(fused.name)
        if device_type == "cuda":  # once per process and choice: _choose is cached
            what = f"head_dim {head_dim}, {dtype}, softcap={softcap}, window={window}, GPU {capability}"
            _LOG.info("hf_ring attention: backend='auto' runs layers of %s on %s (hf_ring.set_attention_backend "
                      "pins one)", what, kernel.name)  # fmt: skip
        return kernel
    raise AssertionError("unreachable: the reference kernel runs every layer")  # pragma: no cover


@functools.cache
def _warn_no_band(replaced: str) -> None:
    """Once per process and kernel: "auto" runs windowed layers on the reference kernel."""
    warnings.warn(
        f"backend {replaced!r} (torch's CUDA attention op) has no sliding-window (band) mask; hf_ring runs the "
        "blocks of sliding-window and chunked layers on its reference kernel instead (float32 math tiled over "
        "query rows: exact, slower than a fused kernel). Install flash-attn (`pip install hf-ring[flash]`) "
        "for a fused kernel with windows (head dims up to 256).",
        RuntimeWarning,
        stacklevel=5,
    )


@functools.cache
def _kernel(
    backend: str, device_type: str, dtype: torch.dtype, capability: tuple[int, int] | None = None
) -> BlockKernel:
    """The kernel object of an explicit backend (one per backend, device type, dtype, capability); raises
    ``ValueError`` where the backend has no kernel for the device or dtype at all."""
    half = dtype in (torch.float16, torch.bfloat16)
    cuda = device_type == "cuda"
    old_gpu = cuda and _pre_ampere(capability)
    if backend == "auto":  # the kernel of a layer without head dim, cap or band
        return _choose("auto", device_type, dtype, capability, None, False, False)
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
    if backend in ("flash_attn_3", "flash_attn_4", "cudnn"):
        if not cuda or not half:
            raise ValueError(
                f"backend={backend!r} needs CUDA tensors in float16/bfloat16, got {dtype} on {device_type}. "
                "Use backend='auto'."
            )
        kernel, why = _library(backend)
        if kernel is None:
            raise ValueError(f"backend={backend!r} but {why}; install {INSTALL[backend]} or use backend='auto'.")
        if isinstance(kernel, FlashAttn4Kernel):  # its head-dim limit depends on the GPU
            return FlashAttn4Kernel(module=kernel.fa, capability=capability)
        if isinstance(kernel, CudnnKernel):  # which blocks it keeps off cuDNN depends on the GPU (D10, D11)
            return CudnnKernel(ops=kernel.ops, version=kernel.version, capability=capability,
                               avoid_recompile=kernel.ragged)  # fmt: skip
        return kernel
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
    check_backend(backend)  # raises, naming the closest name
    raise AssertionError(f"unreachable: {backend!r}")  # pragma: no cover
