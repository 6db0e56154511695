"""Workloads of the attention benchmarks: each runs one fwd+bwd of one provider and returns its
timings. ``bench_attention`` imports them inside its spawned gloo workers (per-rank shards);
``full_providers`` gives ``bench_gpu``'s full-sequence calls.

Providers
  hf_ring      hf_ring's ring_attention op (zigzag or contiguous layout) on this rank's ``Ring``,
               autograd fwd + bwd
  nocomm       the same op on a ``testkit.comm.NoCommRing`` of the same size and rank (channels that
               send nothing): the same schedule's kernel calls, merges and accumulations, no send/recv
  comm_alone   the same messages over the same ring channels, without any compute
  torch_ring   torch's own ring engine (_templated_ring_attention[_backward]) on the same shards
  sdpa         F.scaled_dot_product_attention(enable_gqa=True) over the whole sequence

Measurement probes: ``HfRing`` passes the op a ``probes.TimedRing`` and a ``probes.TimedKernel``
(``ring=`` and ``backend=``), which sum the wall time spent in the channels' ``wait`` and in the
block kernels per call (two ``perf_counter`` calls per kernel call / wait). hf_ring is not patched.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from benchmarks.probes import Probe, TimedKernel, TimedRing
from hf_ring.ops.comm import Ring
from hf_ring.ops.kernels import get_kernel
from hf_ring.ops.ring import ring_attention
from hf_ring.ops.zigzag import zigzag
from testkit.comm import NoCommRing

B, HQ, HKV, D = 1, 8, 2, 64
SEED = 1234


# --------------------------------------------------------------------------------------- inputs
def full_inputs(n: int, dtype=torch.float32):
    """q, k, v, dout of the whole sequence, [B, N, H, D], identical on every rank."""
    g = torch.Generator().manual_seed(SEED + n)
    q = torch.randn(B, n, HQ, D, generator=g, dtype=dtype)
    k = torch.randn(B, n, HKV, D, generator=g, dtype=dtype)
    v = torch.randn(B, n, HKV, D, generator=g, dtype=dtype)
    do = torch.randn(B, n, HQ, D, generator=g, dtype=dtype)
    return q, k, v, do


def local_inputs(n: int, rank: int, size: int, order: str = "zigzag"):
    """This rank's shards of ``full_inputs(n)``: zigzag (chunks r and 2P-1-r of 2P) or contiguous."""
    if order == "zigzag":
        return tuple(zigzag(t, 1, size, rank).contiguous() for t in full_inputs(n))
    return tuple(t.chunk(size, dim=1)[rank].contiguous() for t in full_inputs(n))


# --------------------------------------------------------------------------------------- hf_ring
class HfRing:
    """hf_ring's ring_attention on ``ring`` (a ``Ring``, or a ``NoCommRing``) with the CPU float32
    block kernel; the time spent in kernel calls and in the channels' ``wait`` goes to ``self.probe``."""

    def __init__(self, ring) -> None:
        self.probe = Probe()
        self.ring = TimedRing(ring, self.probe)
        self.kernel = TimedKernel(get_kernel("auto", torch.device("cpu"), torch.float32), self.probe)

    @classmethod
    def on(cls, group) -> HfRing:
        """This rank's ring over ``group``."""
        return cls(Ring(group))

    @classmethod
    def nocomm(cls, size: int, rank: int) -> HfRing:
        """Rank ``rank`` of ``size`` on channels that send nothing (receive buffers keep what they hold:
        the kernels' cost does not depend on values)."""
        return cls(NoCommRing(size, rank))

    def fwd_bwd(self, q, k, v, do, order: str = "zigzag") -> dict:
        """One fwd+bwd; wall, main-thread CPU, wait and kernel seconds."""
        q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
        probe = self.probe
        probe.reset()
        c0, t0 = time.thread_time(), time.perf_counter()
        with torch.profiler.record_function("hf_ring.forward"):  # for benchmarks.bench_profile
            out = ring_attention(q, k, v, ring=self.ring, backend=self.kernel, causal=True, order=order)
        t1 = time.perf_counter()
        w_f, k_f = probe.wait, probe.kernel
        grads = torch.autograd.grad(out, (q, k, v), do)
        t2, c2 = time.perf_counter(), time.thread_time()
        del grads, out
        return {
            "fwd": t1 - t0, "bwd": t2 - t1, "total": t2 - t0, "cpu": c2 - c0,
            "wait": probe.wait, "wait_fwd": w_f, "kernel": probe.kernel, "kernel_fwd": k_f,
        }  # fmt: skip


# --------------------------------------------------------------------------------------- comm alone
def comm_alone(k, v, *, ring: Ring) -> dict:
    """The ring's hops with the same messages and no compute: fwd P-1 K/V hops; bwd P-1 K/V hops
    interleaved with P hops of the float32 dK/dV accumulator, in the ring's order."""
    size = ring.size
    kv = torch.stack((k, v))
    bufs = (kv, torch.empty_like(kv))
    t0 = time.perf_counter()
    comm = ring.channel(0)
    for step in range(size - 1):
        comm.send_recv(bufs[step % 2], bufs[(step + 1) % 2])
        comm.commit()
        comm.wait()
    t1 = time.perf_counter()
    dkv_bufs = [torch.zeros(kv.shape, dtype=torch.float32) for _ in range(2)]
    kv_comm, dkv_comm = ring.channel(0), ring.channel(1)
    for step in range(size):
        if step + 1 < size:
            kv_comm.send_recv(bufs[step % 2], bufs[(step + 1) % 2])
            kv_comm.commit()
        if step > 0:
            dkv_comm.wait()
        dkv_comm.send_recv(dkv_bufs[step % 2], dkv_bufs[(step + 1) % 2])
        dkv_comm.commit()
        if step + 1 < size:
            kv_comm.wait()
    dkv_comm.wait()
    t2 = time.perf_counter()
    return {"fwd": t1 - t0, "bwd": t2 - t1, "total": t2 - t0}


# --------------------------------------------------------------------------------------- torch ring
def configure_torch_ring() -> None:
    from torch.distributed.tensor.experimental._context_parallel import _attention as cpa

    cpa._cp_options.enable_load_balance = True  # head-tail (zigzag) shards
    cpa._cp_options.convert_to_f32 = True
    cpa.set_rotate_method("alltoall")  # ring send/recv rotation, not one all-gather


def torch_ring_fwd_bwd(q, k, v, do, *, group) -> dict:
    """torch's ring engine on [B, H, S, D] zigzag shards with the CPU flash op (no autograd)."""
    from torch.distributed.tensor.experimental._context_parallel import _attention as cpa

    aten = torch.ops.aten
    c0, t0 = time.thread_time(), time.perf_counter()
    out, lse, *_ = cpa._templated_ring_attention(
        group, 2, aten._scaled_dot_product_flash_attention_for_cpu.default, q, k, v,
        is_causal=True, dropout_p=0.0, scale=None,
    )  # fmt: skip
    t1 = time.perf_counter()
    grads = cpa._templated_ring_attention_backward(
        group, 2, aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
        grad_out=do, grad_out_name="grad_out", query=q, key=k, value=v, out=out, logsumexp=lse,
        is_causal=True, dropout_p=0.0, scale=None,
    )  # fmt: skip
    t2, c2 = time.perf_counter(), time.thread_time()
    del grads
    return {"fwd": t1 - t0, "bwd": t2 - t1, "total": t2 - t0, "cpu": c2 - c0}


# --------------------------------------------------------------------------------------- sdpa
def sdpa_fwd_bwd(q, k, v, do) -> dict:
    """Single-process SDPA over the whole sequence; inputs [B, H, N, D] (its native layout)."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    c0, p0, t0 = time.thread_time(), time.process_time(), time.perf_counter()
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    t1 = time.perf_counter()
    grads = torch.autograd.grad(out, (q, k, v), do)
    t2, c2, p2 = time.perf_counter(), time.thread_time(), time.process_time()
    del grads, out
    # cpu: this thread's CPU seconds (all the compute with 1 thread); pcpu: the whole process's
    return {"fwd": t1 - t0, "bwd": t2 - t1, "total": t2 - t0, "cpu": c2 - c0, "pcpu": p2 - p0}


def to_bhsd(*ts):
    return tuple(t.transpose(1, 2).contiguous() for t in ts)


# --------------------------------------------------------------------------------------- full calls (bench_gpu)
_SDPA_NOTES = {
    "gqa": "SDPA flash backend, enable_gqa=True",
    "expand": "SDPA flash backend, K/V heads expanded inside the timed call (this torch's flash backend "
    "refused enable_gqa)",
    "default": "SDPA default backend choice, K/V heads expanded inside the timed call (the flash backend "
    "refused these inputs)",
}


def _sdpa_call(mode: str) -> Callable:
    """Full-sequence SDPA on [B, H, N, D]; ``mode`` from ``_SDPA_NOTES``."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def call(q, k, v):
        if mode != "gqa":
            rep = q.shape[1] // k.shape[1]
            k, v = (t.repeat_interleave(rep, 1) for t in (k, v))
        if mode == "default":
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=mode == "gqa")

    return call


def _sdpa_mode(device: torch.device, dtype: torch.dtype, hq: int, hkv: int, d: int) -> str:
    """The first SDPA form that runs forward and backward here: flash with enable_gqa, flash with
    expanded K/V, else the default backend choice."""
    q = torch.randn(1, hq, 256, d, device=device, dtype=dtype, requires_grad=True)
    kv = torch.randn(1, hkv, 256, d, device=device, dtype=dtype, requires_grad=True)
    for mode in ("gqa", "expand"):
        try:
            _sdpa_call(mode)(q, kv, kv).sum().backward()
            return mode
        except RuntimeError:
            continue
    return "default"


def full_providers(cfg: dict, cuda: bool, dtype: torch.dtype, device: torch.device) -> dict:
    """name -> (fn(q, k, v), layout 'bhsd'|'bshd', note)."""
    provs: dict = {}
    if cuda:
        mode = _sdpa_mode(device, dtype, cfg["Hq"], cfg["Hkv"], cfg["D"])
        provs["sdpa_full"] = (_sdpa_call(mode), "bhsd", _SDPA_NOTES[mode])
        try:
            from flash_attn import flash_attn_func

            provs["flash_attn_full"] = (
                lambda q, k, v: flash_attn_func(q, k, v, causal=True),
                "bshd",
                "flash_attn_func(causal=True)",
            )
        except ImportError:
            pass
    else:
        provs["sdpa_full"] = (
            lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
            "bhsd",
            "F.scaled_dot_product_attention(enable_gqa=True), CPU default backend",
        )
    return provs
