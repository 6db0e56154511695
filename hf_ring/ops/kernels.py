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
    both calls; kernels that take it have ``window = True``: ``ReferenceKernel``, ``TorchCPUKernel``,
    ``FlashAttnKernel`` (torch's CUDA ops refuse a band).

    Optional: a kernel with ``softcap = True`` takes a keyword ``softcap: float`` in every method
    (``0``: none; ``> 0``: scores capped to ``softcap * tanh(scores / softcap)`` before masking, as
    Gemma 2 does); the ring passes it only when it is nonzero. A kernel with ``varlen = True`` also
    has ``varlen_forward``/``varlen_backward`` over sequences packed along rows (``[T, H, D]`` with
    int32 cumulative lengths; ``FlashAttnKernel``), and the ring then makes a step's packed-document
    blocks one call per mask kind.
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


def band_mask(
    sq: int,
    sk: int,
    window: tuple[int, int],
    device: torch.device | str = "cpu",
    *,
    q0: int = 0,
    rows: int | None = None,
) -> Tensor:
    """``[Sq, Sk]`` bool, True where key ``j`` is visible to query ``i``: ``-left <= j - i - (Sk - Sq) <= right``
    (``window = (left, right)``, flash-attn's bottom-right alignment). ``q0``/``rows``: only query rows
    ``q0 ... q0 + rows - 1`` of the block (``[rows, Sk]``)."""
    left, right = window
    rows = sq - q0 if rows is None else rows
    d = torch.arange(sk, device=device)[None, :] - torch.arange(q0, q0 + rows, device=device)[:, None] - (sk - sq)
    return (d >= -left) & (d <= right)


class ReferenceKernel:
    """Plain-torch attention in float32 (float64 for float64 inputs): the oracle, the fallback, and the
    kernel for logit soft-capping where no fused kernel has it.

    ``softcap > 0`` caps the scaled scores as Gemma 2 does, ``s = softcap * tanh(scale * q.k / softcap)``,
    before the causal mask and the softmax; the backward applies the chain rule through the cap,
    ``dS_raw = dS * (1 - tanh^2)``, on the recomputed scores. Queries are processed in tiles of
    ``max(1, tile_elems // (B * Hq * Sk))`` rows, so a block holds at most ``tile_elems`` scores at once
    (O(S) memory per row of queries, like the fused kernels, not O(Sq * Sk)). Grouped-query heads are
    batched matmuls over ``[B, Hkv, Hq / Hkv, rows, D]`` views: K/V are never expanded.
    """

    name = "reference"
    heads_major = False
    softcap = True  # takes softcap > 0 (the fused CPU/CUDA torch ops do not)
    window = True  # takes window=(left, right)

    def __init__(self, tile_elems: int = 1 << 22) -> None:
        self.tile_elems = tile_elems

    def _tiles(self, q: Tensor, k: Tensor) -> range:
        b, sq, hq, _ = q.shape
        rows = max(1, self.tile_elems // max(1, b * hq * k.shape[1]))
        return range(0, sq, rows)

    @staticmethod
    def _grouped(t: Tensor, hkv: int, ct: torch.dtype) -> Tensor:
        """``[B, S, Hq, D]`` -> ``[B, Hkv, Hq / Hkv, S, D]`` in ``ct`` (query head h = g * rep + r)."""
        b, s, hq, d = t.shape
        return t.to(ct).view(b, s, hkv, hq // hkv, d).permute(0, 2, 3, 1, 4)

    @staticmethod
    def _ungrouped(t: Tensor) -> Tensor:
        """``[B, Hkv, rep, S, ...]`` -> ``[B, S, Hq, ...]``."""
        b, hkv, rep, s = t.shape[:4]
        return t.movedim(3, 1).reshape(b, s, hkv * rep, *t.shape[4:])

    @staticmethod
    def _scores(
        qg: Tensor,
        kt: Tensor,
        causal: bool,
        scale: float,
        softcap: float,
        q0: int,
        sq: int,
        window: tuple[int, int] | None,
    ) -> tuple[Tensor, Tensor | None]:
        """Scores ``[B, Hkv, rep, rows, Sk]`` of query rows ``q0 ...`` of a block of ``sq`` queries (``qg``
        grouped, ``kt [B, Hkv, 1, D, Sk]``), masked causally and/or to the band ``window``, and ``tanh`` of
        the capped ones (``None`` without a cap) for the backward's chain rule."""
        s = torch.matmul(qg, kt).mul_(scale)
        t = None
        if softcap:
            t = s.div_(softcap).tanh_()
            s = t * softcap
        if causal:
            rows, sk = s.shape[-2:]
            hide = torch.arange(sk, device=s.device)[None, :] > torch.arange(q0, q0 + rows, device=s.device)[:, None]
            s = s.masked_fill_(hide, float("-inf"))
        if window is not None:
            seen = band_mask(sq, s.shape[-1], window, s.device, q0=q0, rows=s.shape[-2])
            s = s.masked_fill_(~seen, float("-inf"))
        return s, t

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
        ct = torch.float64 if q.dtype == torch.float64 else torch.float32
        hkv = k.shape[2]
        kt = k.to(ct).permute(0, 2, 3, 1).unsqueeze(2)  # (B, Hkv, 1, D, Sk)
        vh = v.to(ct).transpose(1, 2).unsqueeze(2)  # (B, Hkv, 1, Sk, D)
        outs, lses = [], []
        tiles = self._tiles(q, k)
        for q0 in tiles:
            qg = self._grouped(q[:, q0 : q0 + tiles.step], hkv, ct)
            s, _ = self._scores(qg, kt, causal, scale, softcap, q0, q.shape[1], window)
            lse = torch.logsumexp(s, dim=-1)  # (B, Hkv, rep, rows)
            p = s.sub_(lse[..., None]).exp_().nan_to_num_(0.0)  # rows with no key: all zero
            outs.append(self._ungrouped(torch.matmul(p, vh)).to(q.dtype))
            lses.append(self._ungrouped(lse))
            del s, p
        return torch.cat(outs, 1), torch.cat(lses, 1)

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
        softcap: float = 0.0,
        window: tuple[int, int] | None = None,
    ) -> tuple[Tensor, Tensor, Tensor]:
        ct = torch.float64 if q.dtype == torch.float64 else torch.float32
        hkv = k.shape[2]
        kt = k.to(ct).permute(0, 2, 3, 1).unsqueeze(2)  # (B, Hkv, 1, D, Sk)
        vt = v.to(ct).permute(0, 2, 3, 1).unsqueeze(2)  # (B, Hkv, 1, D, Sk)
        dk = torch.zeros(k.shape[0], hkv, k.shape[1], k.shape[3], dtype=ct, device=k.device)  # (B, Hkv, Sk, D)
        dv, dqs = torch.zeros_like(dk), []
        tiles = self._tiles(q, k)
        for q0 in tiles:
            rows = slice(q0, q0 + tiles.step)
            qg = self._grouped(q[:, rows], hkv, ct)
            s, t = self._scores(qg, kt, causal, scale, softcap, q0, q.shape[1], window)
            lse_g = self._grouped(lse[:, rows, :, None], hkv, ct)  # (B, Hkv, rep, rows, 1)
            p = s.sub_(lse_g).exp_().nan_to_num_(0.0)
            do = self._grouped(dout[:, rows], hkv, ct)
            dv += torch.matmul(p.transpose(-1, -2), do).sum(2)
            delta = (do * self._grouped(out[:, rows], hkv, ct)).sum(-1, keepdim=True)  # (B, Hkv, rep, rows, 1)
            ds = torch.matmul(do, vt).sub_(delta).mul_(p)  # p * (dP - delta)
            if t is not None:  # through s = softcap * tanh(s_raw / softcap): times 1 - tanh^2
                ds.mul_(t.square_().neg_().add_(1.0))
            dqs.append(self._ungrouped(torch.matmul(ds, kt.transpose(-1, -2)).mul_(scale)).to(q.dtype))
            dk += torch.matmul(ds.transpose(-1, -2), qg).sum(2).mul_(scale)
            del s, t, p, ds
        return torch.cat(dqs, 1), dk.transpose(1, 2).to(k.dtype), dv.transpose(1, 2).to(v.dtype)


class TorchCPUKernel:
    """torch's fused CPU flash attention (``aten._scaled_dot_product_flash_attention_for_cpu``).

    Takes fewer K/V heads directly and ``[B, H, S, D]`` views over ``[B, S, H, D]`` memory, so
    nothing is copied or expanded on the way in. A band (``window``) goes in as an additive
    ``[Sq, Sk]`` mask in the inputs' dtype (the op's own ``attn_mask``; rows that see no key get
    ``lse = -inf`` here, where the op reports 0).
    """

    name = "torch"
    softcap = False
    window = True  # as an additive mask
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


def get_kernel(
    backend: str, device: torch.device | str, dtype: torch.dtype, softcap: bool = False, window: bool = False
) -> BlockKernel:
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

    ``softcap=True``: the kernel must take logit soft-capping (``softcap = True`` on it). "auto" then picks
    flash-attn on CUDA for fp16/bf16 when it imports, and the reference kernel (tiled over query rows,
    float32 math) everywhere else: torch's fused ops have no soft-capping. An explicit backend without it
    raises ``ValueError``.

    ``window=True``: the kernel must take a band (``window = True`` on it: blocks across a sliding window's
    or a chunk's edge). On CPU torch's fused op takes it; on CUDA, where torch's ops have no band, "auto"
    picks flash-attn when it imports, and otherwise the reference kernel with one warning per process and
    kernel it replaces (install flash-attn for a fused kernel). An explicit backend without it raises
    ``ValueError``.
    """
    device = torch.device(device)
    capability = _cuda_capability(device) if device.type == "cuda" else None
    kernel = _kernel(backend, device.type, dtype, capability)
    if (not softcap or getattr(kernel, "softcap", False)) and (not window or getattr(kernel, "window", False)):
        return kernel
    if backend == "auto":
        if window and not getattr(kernel, "window", False):
            _warn_no_band(kernel.name)
        return _kernel("reference", device.type, dtype, capability)
    if softcap and not getattr(kernel, "softcap", False):
        raise ValueError(
            f"backend={backend!r} has no attention logit soft-capping (torch's fused attention ops do not); "
            "use backend='auto', 'reference' or 'flash_attn' (CUDA, fp16/bf16) for a soft-capped model."
        )
    raise ValueError(
        f"backend={backend!r} has no sliding-window (band) mask (torch's CUDA attention ops do not); use "
        "backend='auto', 'reference' or 'flash_attn' (CUDA, fp16/bf16) for a model with sliding windows or "
        "chunked attention."
    )


@functools.cache
def _warn_no_band(replaced: str) -> None:
    """Once per process and kernel: "auto" runs windowed layers on the reference kernel."""
    warnings.warn(
        f"backend {replaced!r} (torch's CUDA attention op) has no sliding-window (band) mask; hf_ring runs the "
        "blocks of sliding-window and chunked layers on its reference kernel instead (float32 math tiled over "
        "query rows: exact, slower than a fused kernel). Install flash-attn (`pip install hf-ring[flash]`) "
        "for a fused kernel with windows.",
        RuntimeWarning,
        stacklevel=4,
    )


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
