"""Timing on a GPU or the CPU for ``benchmarks.bench_gpu``: CUDA events or perf_counter (``Clock``), one timed
forward + backward (``fwd_bwd``), the growth of peak CUDA memory over one (``peak_growth``)."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from torch import Tensor

__all__ = ["Clock", "fwd_bwd", "peak_growth"]


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
