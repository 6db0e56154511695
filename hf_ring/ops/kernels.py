"""Block attention kernels: the compute under every ring step.

A kernel attends one block of queries to one block of keys and returns the block's output together
with the log-sum-exp (LSE) of its scores, which is all the ring needs to merge blocks exactly.
Layout everywhere is ``[B, S, H, D]``; keys and values may have fewer heads than queries
(grouped-query attention: query head ``h`` reads key head ``h // (Hq // Hkv)``).

``causal=True`` masks key ``j`` from query ``i`` when ``j > i`` (top-left aligned); the ring only asks
for it on square blocks. This module imports only torch.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Protocol

import torch
from torch import Tensor

__all__ = ["BlockKernel", "available_backends", "get_kernel"]


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
    """

    name: str
    heads_major: bool

    def forward(
        self, q: Tensor, k: Tensor, v: Tensor, *, causal: bool, scale: float
    ) -> tuple[Tensor, Tensor]: ...

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


class ReferenceKernel:
    """Plain-torch attention in float32 (float64 for float64 inputs): the oracle and the fallback."""

    name = "reference"
    heads_major = False

    @staticmethod
    def _scores(q: Tensor, k: Tensor, causal: bool, scale: float) -> Tensor:
        ct = torch.float64 if q.dtype == torch.float64 else torch.float32
        rep = q.shape[2] // k.shape[2]
        kx = k.to(ct).repeat_interleave(rep, dim=2)
        s = torch.einsum("bqhd,bkhd->bhqk", q.to(ct), kx) * scale  # (B, H, Sq, Sk)
        if causal:
            sq, sk = s.shape[-2:]
            mask = torch.ones(sq, sk, dtype=torch.bool, device=s.device).triu_(1)
            s = s.masked_fill(mask, float("-inf"))
        return s

    def forward(self, q, k, v, *, causal, scale):
        s = self._scores(q, k, causal, scale)
        lse = torch.logsumexp(s, dim=-1)  # (B, H, Sq)
        p = torch.exp(s - lse[..., None]).nan_to_num_(0.0)  # rows with no key: all zero
        rep = q.shape[2] // k.shape[2]
        vx = v.to(s.dtype).repeat_interleave(rep, dim=2)
        out = torch.einsum("bhqk,bkhd->bqhd", p, vx)
        return out.to(q.dtype), lse.transpose(1, 2)

    def backward(self, dout, q, k, v, out, lse, *, causal, scale):
        s = self._scores(q, k, causal, scale)
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
    nothing is copied or expanded on the way in.
    """

    name = "torch"
    heads_major = True  # its backward reads K/V 3-5% faster from [B, H, S, D] memory (benchmarks/NOTES.md)

    def forward(self, q, k, v, *, causal, scale):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), 0.0, causal, scale=scale
        )
        return out.transpose(1, 2), lse.transpose(1, 2)

    def backward(self, dout, q, k, v, out, lse, *, causal, scale):
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout.transpose(1, 2),
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            out.transpose(1, 2),
            lse.transpose(1, 2).to(torch.float64 if q.dtype == torch.float64 else torch.float32),
            0.0,
            causal,
            scale=scale,
        )
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


class TorchCUDAKernel:
    """torch's CUDA flash attention op (fp16/bf16). Its aten op wants equal head counts, so K/V
    heads are expanded here, after communication, and their gradients summed back."""

    name = "torch"
    heads_major = False

    def forward(self, q, k, v, *, causal, scale):
        rep = q.shape[2] // k.shape[2]
        k, v = (t.repeat_interleave(rep, dim=2) if rep > 1 else t for t in (k, v))
        res = torch.ops.aten._scaled_dot_product_flash_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), 0.0, causal, False, scale=scale
        )
        return res[0].transpose(1, 2), res[1].transpose(1, 2)

    def backward(self, dout, q, k, v, out, lse, *, causal, scale):
        rep = q.shape[2] // k.shape[2]
        kx, vx = (t.repeat_interleave(rep, dim=2) if rep > 1 else t for t in (k, v))
        sq, sk = q.shape[1], k.shape[1]
        empty = torch.empty(0, device=q.device, dtype=torch.int64)
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            dout.transpose(1, 2),
            q.transpose(1, 2),
            kx.transpose(1, 2),
            vx.transpose(1, 2),
            out.transpose(1, 2),
            lse.transpose(1, 2).contiguous(),
            empty,
            empty,
            sq,
            sk,
            0.0,
            causal,
            empty,
            empty,
            scale=scale,
        )
        dq, dk, dv = dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)
        if rep > 1:
            b, _, hkv, d = k.shape
            dk = dk.reshape(b, sk, hkv, rep, d).sum(3)
            dv = dv.reshape(b, sk, hkv, rep, d).sum(3)
        return dq, dk, dv


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

    Layout is ``[B, S, H, D]`` natively and fewer K/V heads are accepted. Since 2.7 the CUDA op
    takes only head dims that are multiples of 8 (``flash_attn_func`` pads in Python), so other
    head dims are zero-padded here (the scale is passed explicitly, so scores do not change).
    Two differences from the ``BlockKernel`` wording, harmless for the ring, which asks for
    ``causal`` only on square blocks where every row sees a key: flash-attn aligns the causal mask
    bottom-right when ``Sq != Sk``, and it gives rows that see no key ``lse = +inf``.
    """

    name = "flash_attn"
    heads_major = False  # flash-attn takes [B, S, H, D] memory

    def __init__(self, module: object | None = None) -> None:
        import inspect

        self.fa = module if module is not None else importlib.import_module("flash_attn.flash_attn_interface")
        try:  # 2.7+ custom ops show only (*args, **kwargs): that is the current form
            params = set(inspect.signature(self.fa._flash_attn_forward).parameters)
        except (TypeError, ValueError):
            params = set()
        self.legacy = "window_size" in params  # 2.6.x
        if "softmax_scale" in params and "softcap" not in params:
            raise ImportError(
                "flash-attn is too old for hf_ring (its _flash_attn_forward has no softcap "
                "argument); install flash-attn >= 2.6 or use backend='torch'."
            )

    @staticmethod
    def _pad(t: Tensor) -> Tensor:
        d = t.shape[-1]
        if d % 8:
            return torch.nn.functional.pad(t, (0, 8 - d % 8))
        return t if t.stride(-1) == 1 else t.contiguous()

    def forward(self, q, k, v, *, causal, scale):
        d = q.shape[-1]
        q, k, v = self._pad(q), self._pad(k), self._pad(v)
        if self.legacy:
            res = self.fa._flash_attn_forward(q, k, v, 0.0, scale, causal, (-1, -1), 0.0, None, False)
            out, lse = res[0], res[5]
        else:
            out, lse, _, _ = self.fa._flash_attn_forward(
                q, k, v, 0.0, scale, causal, -1, -1, 0.0, None, False
            )
        return out[..., :d], lse.transpose(1, 2)

    def backward(self, dout, q, k, v, out, lse, *, causal, scale):
        d = q.shape[-1]
        dout, q, k, v, out = (self._pad(t) for t in (dout, q, k, v, out))
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        lse = lse.transpose(1, 2).to(torch.float32).contiguous()  # [B, H, Sq]
        if self.legacy:
            self.fa._flash_attn_backward(
                dout, q, k, v, out, lse, dq, dk, dv,
                0.0, scale, causal, (-1, -1), 0.0, None, False, None,
            )  # fmt: skip
        else:
            self.fa._flash_attn_backward(
                dout, q, k, v, out, lse, dq, dk, dv,
                0.0, scale, causal, -1, -1, 0.0, None, False, None,
            )  # fmt: skip
        return dq[..., :d], dk[..., :d], dv[..., :d]


def _flash_attn_importable() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


def available_backends(device: torch.device | str = "cpu") -> list[str]:
    """Names accepted by ``get_kernel`` on this device, best first."""
    dev = torch.device(device)
    if dev.type == "cuda":
        names = ["flash_attn"] if _flash_attn_importable() else []
        return [*names, "torch", "reference"]
    return ["torch", "reference"]


def get_kernel(backend: str, device: torch.device, dtype: torch.dtype) -> BlockKernel:
    """Return the block kernel for ``backend`` ("auto", "torch", "flash_attn" or "reference").

    "auto" picks flash-attn on CUDA for fp16/bf16 when it is installed, then torch's fused op
    (CPU: any float dtype; CUDA: fp16/bf16), then the reference. An explicit backend that cannot
    run here raises ``ValueError``.
    """
    half = dtype in (torch.float16, torch.bfloat16)
    cuda = device.type == "cuda"
    if backend == "auto":
        if cuda and half:
            backend = "flash_attn" if _flash_attn_importable() else "torch"
        elif cuda:
            backend = "reference"
        else:
            backend = "torch"
    if backend == "reference":
        return ReferenceKernel()
    if backend == "torch":
        if device.type == "cpu":
            return TorchCPUKernel()
        if cuda and half:
            return TorchCUDAKernel()
        raise ValueError(
            f"backend='torch' has no kernel for {dtype} on {device.type}; its CUDA flash op takes "
            "float16/bfloat16 only. Use backend='reference' or cast the inputs."
        )
    if backend == "flash_attn":
        if not cuda or not half:
            raise ValueError(
                f"backend='flash_attn' needs CUDA tensors in float16/bfloat16, got {dtype} on "
                f"{device.type}. Use backend='auto'."
            )
        if not _flash_attn_importable():
            raise ValueError(
                "backend='flash_attn' but the flash_attn package is not installed; "
                "install it with `pip install hf-ring[flash]` or use backend='auto'."
            )
        return FlashAttnKernel()
    raise ValueError(
        f"unknown backend {backend!r}; choose one of 'auto', 'torch', 'flash_attn', 'reference'."
    )
