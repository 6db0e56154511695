"""Per-rank workloads for the attention benchmark: each function runs one fwd+bwd of one provider
on this rank's shard and returns its timings. Imported inside the spawned gloo workers.

Providers
  hf_ring      hf_ring.ring_attention (zigzag or contiguous layout), autograd fwd + bwd
  nocomm       hf_ring's own autograd Function with its RingComm swapped for one that sends nothing:
               the same schedule's kernel calls, merges and accumulations, without any send/recv
  comm_alone   the same messages over the same RingComm hops, without any compute
  torch_ring   torch's own ring engine (_templated_ring_attention[_backward]) on the same shards
  sdpa         F.scaled_dot_product_attention(enable_gqa=True) over the whole sequence

Measurement probes (installed by ``install_probes``, only inside benchmark processes): the wall time
spent in ``RingComm.wait`` and in the block kernels is summed per call by wrapping
``hf_ring.comm.RingComm.wait`` and ``hf_ring.ring.get_kernel``. hf_ring's code is not edited; the
wrappers cost two ``perf_counter`` calls per kernel call / wait.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F

import hf_ring
import hf_ring.ops.comm as hcomm
import hf_ring.ops.ring as hring

B, HQ, HKV, D = 1, 8, 2, 64
SEED = 1234


# --------------------------------------------------------------------------------------- probes
@dataclass
class Probe:
    wait: float = 0.0  # wall seconds inside RingComm.wait
    kernel: float = 0.0  # wall seconds inside block kernel calls
    kernel_calls: int = 0
    regions: list = field(default_factory=list)

    def reset(self) -> None:
        self.wait = self.kernel = 0.0
        self.kernel_calls = 0


PROBE = Probe()
_INSTALLED = False


class _TimedKernel:
    def __init__(self, inner):
        self.inner = inner
        self.name = inner.name

    def __getattr__(self, name):  # any other attribute of the wrapped kernel
        return getattr(self.inner, name)

    def _timed(self, which: str, *a, **kw):
        t0 = time.perf_counter()
        with torch.profiler.record_function(f"hf_ring.kernel.{which}"):
            r = getattr(self.inner, which)(*a, **kw)
        PROBE.kernel += time.perf_counter() - t0
        PROBE.kernel_calls += 1
        return r

    def forward(self, *a, **kw):
        return self._timed("forward", *a, **kw)

    def backward(self, *a, **kw):
        return self._timed("backward", *a, **kw)


def install_probes() -> None:
    """Wrap RingComm.wait and the kernel factory used by hf_ring.ring (this process only)."""
    global _INSTALLED
    if _INSTALLED:
        return
    orig_wait = hcomm.RingComm.wait
    orig_get_kernel = hring.get_kernel

    def wait(self):
        t0 = time.perf_counter()
        with torch.profiler.record_function("hf_ring.comm.wait"):
            orig_wait(self)
        PROBE.wait += time.perf_counter() - t0

    hcomm.RingComm.wait = wait
    hring.get_kernel = lambda *a, **kw: _TimedKernel(orig_get_kernel(*a, **kw))
    _INSTALLED = True


# --------------------------------------------------------------------------------------- inputs
def full_inputs(n: int, dtype=torch.float32):
    """q, k, v, dout of the whole sequence, [B, N, H, D], identical on every rank."""
    g = torch.Generator().manual_seed(SEED + n)
    q = torch.randn(B, n, HQ, D, generator=g, dtype=dtype)
    k = torch.randn(B, n, HKV, D, generator=g, dtype=dtype)
    v = torch.randn(B, n, HKV, D, generator=g, dtype=dtype)
    do = torch.randn(B, n, HQ, D, generator=g, dtype=dtype)
    return q, k, v, do


def zigzag(x: torch.Tensor, rank: int, size: int, dim: int = 1) -> torch.Tensor:
    """Rank ``rank``'s zigzag shard (chunks r and 2P-1-r of 2P): same as hf_ring.shard, without
    its cross-rank shape check."""
    if size == 1:
        return x.contiguous()
    c = x.chunk(2 * size, dim=dim)
    return torch.cat((c[rank], c[2 * size - 1 - rank]), dim=dim).contiguous()


def contiguous_shard(x: torch.Tensor, rank: int, size: int, dim: int = 1) -> torch.Tensor:
    return x.chunk(size, dim=dim)[rank].contiguous()


def local_inputs(n: int, rank: int, size: int, layout: str = "zigzag"):
    cut = zigzag if layout == "zigzag" else contiguous_shard
    return tuple(cut(t, rank, size) for t in full_inputs(n))


# --------------------------------------------------------------------------------------- hf_ring
def hf_ring_fwd_bwd(q, k, v, do, *, group, layout="zigzag") -> dict:
    """One fwd+bwd of hf_ring.ring_attention; wall, main-thread CPU, wait and kernel seconds."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    PROBE.reset()
    c0, t0 = time.thread_time(), time.perf_counter()
    out = hf_ring.ring_attention(q, k, v, group=group, causal=True, layout=layout)
    t1 = time.perf_counter()
    w_f, k_f = PROBE.wait, PROBE.kernel
    grads = torch.autograd.grad(out, (q, k, v), do)
    t2, c2 = time.perf_counter(), time.thread_time()
    del grads, out
    return {
        "fwd": t1 - t0, "bwd": t2 - t1, "total": t2 - t0, "cpu": c2 - c0,
        "wait": PROBE.wait, "wait_fwd": w_f, "kernel": PROBE.kernel, "kernel_fwd": k_f,
    }  # fmt: skip


# --------------------------------------------------------------------------------------- nocomm
class _NoComm:
    """``RingComm``'s interface with no transfer: the ring runs its whole schedule (kernel calls,
    merges, accumulations, buffers) on the blocks it already holds."""

    def __init__(self, group, tag: int = 0) -> None:
        pass

    def send_recv(self, send: torch.Tensor, recv: torch.Tensor) -> None:
        pass

    def commit(self) -> None:
        pass

    def wait(self) -> None:
        pass


def nocomm_fwd_bwd(q, k, v, do, *, group, layout="zigzag") -> dict:
    """``hf_ring_fwd_bwd`` with ``hf_ring.ring.RingComm`` replaced by ``_NoComm`` for the call.

    The receive buffers keep whatever they held (the kernels' cost does not depend on values).
    """
    real = hring.RingComm
    hring.RingComm = _NoComm
    try:
        return hf_ring_fwd_bwd(q, k, v, do, group=group, layout=layout)
    finally:
        hring.RingComm = real


# --------------------------------------------------------------------------------------- comm alone
def comm_alone(k, v, *, group) -> dict:
    """The ring's hops with the same messages and no compute: fwd P-1 K/V hops; bwd P-1 K/V hops
    interleaved with P hops of the float32 dK/dV accumulator, in the ring's order."""
    size = dist.get_world_size(group)
    kv = torch.stack((k, v))
    bufs = (kv, torch.empty_like(kv))
    t0 = time.perf_counter()
    comm = hcomm.RingComm(group)
    for step in range(size - 1):
        comm.send_recv(bufs[step % 2], bufs[(step + 1) % 2])
        comm.commit()
        comm.wait()
    t1 = time.perf_counter()
    dkv_bufs = [torch.zeros(kv.shape, dtype=torch.float32) for _ in range(2)]
    kv_comm, dkv_comm = hcomm.RingComm(group, tag=0), hcomm.RingComm(group, tag=1)
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
