"""What ``benchmarks.bench_gpu`` and ``benchmarks.gpu_kernels`` time on one device: an emulated zigzag ring rank
(``emulated_rank``, and ``emulation_error``: its output and dQ against a full-sequence reference when
``oracle_fill`` delivers the K/V blocks the real ring would), and the timing itself: CUDA events or
perf_counter (``Clock``), one timed forward + backward (``fwd_bwd``), the growth of peak CUDA memory over
one (``peak_growth``)."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from hf_ring.ops.kernels import BlockKernel, get_kernel
from hf_ring.ops.ring import _kv_message, ring_attention
from hf_ring.ops.zigzag import zigzag
from testkit.comm import NoCommRing

__all__ = ["Clock", "emulated_rank", "emulation_error", "fwd_bwd", "oracle_fill", "peak_growth"]


class Clock:
    """CUDA events on CUDA (read after a synchronize), perf_counter on CPU."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda

    def mark(self):
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def seconds(self, a, b) -> float:
        return a.elapsed_time(b) / 1e3 if self.cuda else b - a


def fwd_bwd(fn: Callable, inputs: tuple, do: Tensor, clock: Clock) -> dict:
    """One timed forward + backward of ``fn(q, k, v)``; seconds of fwd, bwd and total."""
    q, k, v = (t.detach().requires_grad_() for t in inputs)
    clock.sync()
    a = clock.mark()
    out = fn(q, k, v)
    b = clock.mark()
    grads = torch.autograd.grad(out, (q, k, v), do)
    c = clock.mark()
    clock.sync()
    del grads, out
    return {"fwd": clock.seconds(a, b), "bwd": clock.seconds(b, c), "total": clock.seconds(a, c)}


def peak_growth(fn: Callable, inputs: tuple, do: Tensor) -> float:
    """Bytes: growth of torch.cuda.max_memory_allocated over one fwd+bwd (gradients included)."""
    q, k, v = (t.detach().requires_grad_() for t in inputs)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    m0 = torch.cuda.memory_allocated()
    out = fn(q, k, v)
    grads = torch.autograd.grad(out, (q, k, v), do)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - m0
    del grads, out
    return float(peak)


# ============================================================================ the emulated rank
def emulated_rank(rank: int, size: int, backend: str | BlockKernel = "auto", fill: Callable | None = None) -> Callable:
    """``fn(q, k, v)``: hf_ring's ring_attention as rank ``rank`` of a zigzag ring of ``size`` on a
    ``NoCommRing``: every kernel call, merge and accumulation of the rank's schedule, no transfer.
    Its receive buffers keep what they hold, or get what ``fill(tag, send, recv)`` writes."""

    def call(q, k, v):
        return ring_attention(q, k, v, ring=NoCommRing(size, rank, fill), causal=True, backend=backend)

    return call


def oracle_fill(messages: list[Tensor], rank: int, size: int) -> Callable:
    """A ``NoCommRing`` fill that receives what the real ring would: at hop ``s`` (1-based) of a K/V
    channel (tag 0), the K/V message of rank ``(rank - s) mod size``. ``messages[i]`` is rank i's
    message in the ring's own format (``hf_ring.ops.ring._kv_message``). The forward and then the
    backward each make ``size - 1`` K/V hops, so hops are counted modulo ``size - 1``. The dK/dV
    channel (tag 1) receives nothing, so only the output and dQ of the emulated rank are exact."""
    hops = 0

    def fill(tag: int, send: Tensor, recv: Tensor) -> None:
        nonlocal hops
        if tag == 0:
            hop = hops % max(1, size - 1) + 1
            hops += 1
            recv.copy_(messages[(rank - hop) % size])

    return fill


def emulation_error(q, k, v, do, size: int, backend: str | BlockKernel = "auto") -> dict:
    """Max over ranks of the relative error of the emulated ranks' out and dQ (exact K/V delivered by
    ``oracle_fill``) against a float32 full-sequence reference. Inputs [B, N, H, D], whole sequence."""
    rep = q.shape[2] // k.shape[2]
    x32 = [t.detach().float().transpose(1, 2).requires_grad_() for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(
        x32[0], x32[1].repeat_interleave(rep, 1), x32[2].repeat_interleave(rep, 1), is_causal=True
    )
    (ref_dq,) = torch.autograd.grad(ref, x32[0], do.float().transpose(1, 2))
    ref, ref_dq = ref.transpose(1, 2).detach(), ref_dq.transpose(1, 2)
    kernel = get_kernel(backend, q.device, q.dtype) if isinstance(backend, str) else backend
    messages = [_kv_message(zigzag(k, 1, size, r), zigzag(v, 1, size, r), kernel.heads_major) for r in range(size)]
    err = {"out": 0.0, "dq": 0.0}
    for r in range(size):
        ql, kl, vl = (zigzag(t, 1, size, r).detach().requires_grad_() for t in (q, k, v))
        out = emulated_rank(r, size, kernel, oracle_fill(messages, r, size))(ql, kl, vl)
        (dq,) = torch.autograd.grad(out, ql, zigzag(do, 1, size, r))
        for name, got, want in (("out", out, ref), ("dq", dq, ref_dq)):
            w = zigzag(want, 1, size, r)
            e = float((got.detach().float() - w).norm() / w.norm().clamp_min(1e-30))
            err[name] = max(err[name], e)
    return err
