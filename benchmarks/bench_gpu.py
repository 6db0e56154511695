"""Single-GPU benchmark of hf_ring's block kernels against the theoretical speed of a context-parallel ring.

    python -m benchmarks.bench_gpu --out benchmarks/results/gpu.jsonl        # one GPU, ~1-2 min on an H200
    python -m benchmarks.bench_gpu --quick --out /tmp/gpu.jsonl              # CPU smoke test, < 20 s
    python -m benchmarks.bench_gpu --Ns 8192 32768 --Ps 4 --link-GBps nvlink=450 ib=50 roce=25

No P GPUs are needed: the ring is **emulated in one process**. For rank ``r`` of ``P`` (zigzag layout)
the real ``hf_ring.ring.ring_attention`` runs on the rank's shard of ``T = N/P`` tokens while, for the
duration of the call, ``hf_ring.ring.group_size_rank`` answers ``(P, r)`` and ``hf_ring.ring.RingComm``
is ``benchmarks.workloads._NoComm`` (sends nothing; receive buffers keep whatever they hold: kernel
cost does not depend on values). So every kernel call, merge and accumulation of the rank's forward
and backward schedule runs, and nothing else; hf_ring's code is not edited (the patch lives only in
this process, inside ``emulated_rank``). ``emulation_error`` swaps in ``_OracleComm`` instead, which
copies into each receive buffer the K/V block the real ring would deliver, so that the emulated rank's
output and dQ are exact (its dK/dV are not: their accumulators come from other ranks) -- a check that
what is timed is the real computation. No NCCL kernels compete for the GPU's SMs and memory bandwidth here,
so the fraction of theoretical is an upper bound for a real ring on the same GPU.

Default configuration (GPU): bf16, Llama-3.1-8B attention (B=1, Hq=32, Hkv=8, D=128, causal),
N in {8K, 16K, 32K, 64K, 128K} (``--Ns``), P in {2, 4, 8} (``--Ps``), block kernel ``--backend auto``
(flash-attn when importable, else torch's CUDA flash op). ``--quick`` (or no CUDA): CPU, float32,
Hq=8, Hkv=2, D=64, N in {1024, 2048}, P in {2, 4}, 2 iterations.

Measured, per N (full call) and per (N, P) (emulated ranks); every iteration times the full call(s)
once and then every rank of every P, in that order; warm-up iterations first; median/p20/p80 over
iterations. CUDA: CUDA events around forward and backward; CPU: perf_counter.

  * full call, fwd+bwd of causal attention over all N tokens: ``sdpa_full`` =
    ``F.scaled_dot_product_attention(is_causal=True, enable_gqa=True)`` on [B, H, N, D] under
    ``sdpa_kernel(SDPBackend.FLASH_ATTENTION)`` on CUDA (K/V expanded inside the timed call if this
    torch's flash backend refuses ``enable_gqa``; the note says so); ``flash_attn_full`` =
    ``flash_attn_func(causal=True)`` when flash-attn is importable.
  * ``hf_ring_emulated``: per iteration, the slowest rank's time (``time``) and the mean over ranks.
  * fraction of theoretical = (t_full / P) / t_rank, paired per iteration, for t_rank = the slowest
    rank (``max_rank``) and the mean over ranks (``mean_rank``), against every full-call provider;
    the note names the one using the same kernel as the ring.
  * FLOPs (the flash-attention convention; causal counts N^2/2 score entries):
        forward  F_fwd(N) = 4 * B * Hq * D * N^2 / 2      (QK^T and PV, 2 FLOPs per multiply-add)
        backward F_bwd = 2.5 * F_fwd,  fwd+bwd = 3.5 * F_fwd
    A zigzag rank computes exactly 1/P of it (P steps of T^2/2 score entries each), so achieved
    TFLOP/s of a rank = (F / P) / t_rank.
  * peak memory (CUDA only): growth of ``torch.cuda.max_memory_allocated`` over one fwd+bwd (inputs
    excluded, gradients included), max over the P emulated ranks; ratio P * peak_rank / peak_full.
  * overlap threshold. Per ring hop (derived from ``hf_ring.schedule.make_schedule``: every zigzag step
    is one kernel call over T^2/2 score entries -- step 0 a causal T x T block, the others a
    non-causal T/2 x T or T x T/2 block):
        forward : compute C_f = 4 * B * Hq * D * T^2 / 2 = 2 B Hq D T^2 FLOPs,
                  message K/V = 2 * B * T * Hkv * D * b bytes                     (b = element bytes)
        backward: compute 2.5 * C_f; messages K/V plus the float32 dK/dV accumulator,
                  2 * B * T * Hkv * D * (b + 4) bytes, on the same link direction.
    With achieved FLOP/s F and link bandwidth BW (bytes/s, per direction) a hop is hidden when
    compute >= transfer, i.e.  T >= F * b * Hkv / (BW * Hq)            (forward)
                               T >= F * (b + 4) * Hkv / (2.5 * BW * Hq) (backward),
    which is ``hf_ring.planner.plan``'s "ring overlap" condition. Measured version: the per-step compute
    time is t_step = t_rank / P (forward and backward separately; fastest rank, the one with least
    compute to hide behind) and, compute being quadratic and transfer linear in T,
        T*_fwd = T * t_xfer_fwd(T) / t_step_fwd(T),   T*_bwd = T * t_xfer_bwd(T) / t_step_bwd(T),
    threshold = max of the two (= the formula above with F the throughput measured at T = N/P).
    Also reported: ``plan()``'s threshold with its default 400 TFLOP/s (``planner_default_flops``)
    and with the rank's measured fwd+bwd throughput (``planner_measured_flops``), and whether
    T = N/P >= the measured threshold (``gpu_overlap_hidden``).
  * ``gpu_emulation_check``: relative error (Frobenius) of the emulated ranks' out and dQ, fed the right
    K/V blocks by ``_OracleComm``, against a float32 full-sequence reference (max over ranks).

Links (``--link-GBps NAME=GB/s ...``, GB = 1e9 bytes, per direction): nvlink=450 (H100/H200 NVLink4,
900 GB/s bidirectional) and ib=50 (one 400 Gb/s InfiniBand NIC per GPU).

Budget: ``--max-seconds`` (default 420 on GPU): before each N the time the next one will take is
estimated (4.3 x the previous N: quadratic cost) and the remaining N are skipped, with a
``gpu_skipped`` row each, when it would not fit; an iteration loop also stops early at the deadline.
A CUDA out-of-memory error skips that N the same way.

Output: one JSON object per line (the long format of ``benchmarks/bench_attention.py``: name,
provider, metric, x, P, N, median, p20, p80, unit, machine, versions, threads, note; x = N; full-call
rows have P = 1). Rows: gpu_fwd_bwd / gpu_fwd / gpu_bwd (time, s), gpu_tflops, gpu_fraction_of_theoretical,
gpu_load_balance, gpu_peak_memory, gpu_overlap_threshold (tokens per rank, provider = link),
gpu_overlap_hidden (1/0), gpu_emulation_check, gpu_skipped. Plots: ``benchmarks.plot.plot_gpu``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

import hf_ring.ops.ring as hring
from benchmarks.bench_attention import FIELDS, _stats, machine_info, versions
from benchmarks.workloads import _NoComm, zigzag

GPU_CFG = {
    "Ns": [8192, 16384, 32768, 65536, 131072],
    "Ps": [2, 4, 8],
    "iters": {8192: 10, 16384: 10, 32768: 8, 65536: 5, 131072: 3},
    "warmup": {8192: 2, 16384: 2, 32768: 1, 65536: 1, 131072: 1},
    "dtype": "bf16",
    "B": 1,
    "Hq": 32,
    "Hkv": 8,
    "D": 128,
    "check": (4096, 4),  # emulation exactness check: N, P
    "max_seconds": 420.0,
}
QUICK_CFG = {
    "Ns": [1024, 2048],
    "Ps": [2, 4],
    "iters": {1024: 2, 2048: 2},
    "warmup": {1024: 1, 2048: 1},
    "dtype": "fp32",
    "B": 1,
    "Hq": 8,
    "Hkv": 2,
    "D": 64,
    "check": (256, 4),
    "max_seconds": 60.0,
}
DEFAULT_LINKS = ["nvlink=450", "ib=50"]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
PLANNER_DEFAULT_FLOPS = 400e12  # hf_ring.planner.PlanSettings's default ``flops``

_EMULATED = object()  # the ``group`` passed to ring_attention while emulating (never used as a group)


# ============================================================================ emulation
@contextlib.contextmanager
def emulated_rank(rank: int, size: int, comm: type = _NoComm):
    """Within the block, ``hf_ring.ring`` believes it is rank ``rank`` of ``size`` and its ring
    communication is ``comm`` (default: sends and receives nothing). Pass ``group=_EMULATED``."""
    real = hring.group_size_rank, hring.RingComm
    hring.group_size_rank = lambda group: (size, rank)
    hring.RingComm = comm
    try:
        yield _EMULATED
    finally:
        hring.group_size_rank, hring.RingComm = real


def oracle_comm(messages: list[Tensor], rank: int, size: int) -> type:
    """A ``RingComm`` stand-in that receives what the real ring would: at hop ``s`` (1-based) of the
    K/V ring (tag 0), the K/V message of rank ``(rank - s) mod size``. ``messages[i]`` is rank i's
    message in the ring's own format (``hf_ring.ring._kv_message``). The dK/dV ring (tag 1) receives
    nothing, so only the output and dQ of the emulated rank are exact."""

    class _OracleComm(_NoComm):
        def __init__(self, group, tag: int = 0) -> None:
            self.tag, self.hop = tag, 0

        def send_recv(self, send: Tensor, recv: Tensor) -> None:
            if self.tag == 0:
                self.hop += 1
                recv.copy_(messages[(rank - self.hop) % size])

    return _OracleComm


def ring_call(backend: str) -> Callable:
    def call(q, k, v):
        return hring.ring_attention(q, k, v, group=_EMULATED, causal=True, backend=backend)

    return call


def emulation_error(q, k, v, do, size: int, backend: str = "auto") -> dict:
    """Max over ranks of the relative error of the emulated ranks' out and dQ (exact K/V delivered by
    ``oracle_comm``) against a float32 full-sequence reference. Inputs [B, N, H, D], whole sequence."""
    rep = q.shape[2] // k.shape[2]
    x32 = [t.detach().float().transpose(1, 2).requires_grad_() for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(
        x32[0], x32[1].repeat_interleave(rep, 1), x32[2].repeat_interleave(rep, 1), is_causal=True
    )
    (ref_dq,) = torch.autograd.grad(ref, x32[0], do.float().transpose(1, 2))
    ref, ref_dq = ref.transpose(1, 2).detach(), ref_dq.transpose(1, 2)
    hm = hring.get_kernel(backend, q.device, q.dtype).heads_major
    messages = [hring._kv_message(zigzag(k, r, size), zigzag(v, r, size), hm) for r in range(size)]
    err = {"out": 0.0, "dq": 0.0}
    for r in range(size):
        ql, kl, vl = (zigzag(t, r, size).detach().requires_grad_() for t in (q, k, v))
        with emulated_rank(r, size, oracle_comm(messages, r, size)):
            out = ring_call(backend)(ql, kl, vl)
            (dq,) = torch.autograd.grad(out, ql, zigzag(do, r, size))
        for name, got, want in (("out", out, ref), ("dq", dq, ref_dq)):
            w = zigzag(want, r, size)
            e = float((got.detach().float() - w).norm() / w.norm().clamp_min(1e-30))
            err[name] = max(err[name], e)
    return err


# ============================================================================ timing
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


def fwd_flops(n: int, b: int, hq: int, d: int) -> float:
    """Causal forward FLOPs over n tokens: 4 * B * Hq * D * n^2 / 2."""
    return 4.0 * b * hq * d * n * n / 2


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


# ============================================================================ measurement
def run_n(n: int, cfg: dict, env: dict, deadline: float) -> dict:
    """Every provider at total length n: per-iteration samples, peaks, the exactness check."""
    dev, dtype, clock = env["device"], env["dtype"], env["clock"]
    b, hq, hkv, d = cfg["B"], cfg["Hq"], cfg["Hkv"], cfg["D"]
    g = torch.Generator(device=dev).manual_seed(1234 + n)
    shapes = ((b, n, hq, d), (b, n, hkv, d), (b, n, hkv, d), (b, n, hq, d))
    q, k, v, do = (torch.randn(s, generator=g, device=dev, dtype=dtype) for s in shapes)
    full = {}
    for name, (fn, layout, _) in env["full"].items():
        if layout == "bhsd":
            full[name] = (fn, tuple(t.transpose(1, 2).contiguous() for t in (q, k, v)), do.transpose(1, 2).contiguous())
        else:
            full[name] = (fn, (q, k, v), do)
    shards = {p: [tuple(zigzag(t, r, p) for t in (q, k, v, do)) for r in range(p)] for p in cfg["Ps"]}
    del q, k, v, do
    ring = ring_call(env["backend"])

    def one_iteration() -> dict:
        rec: dict = {"full": {}, "ring": {}}
        for name, (fn, inp, dout) in full.items():
            rec["full"][name] = fwd_bwd(fn, inp, dout, clock)
        for p in cfg["Ps"]:
            rec["ring"][p] = []
            for r in range(p):
                with emulated_rank(r, p):
                    rec["ring"][p].append(fwd_bwd(ring, shards[p][r][:3], shards[p][r][3], clock))
        return rec

    for _ in range(cfg["warmup"].get(n, 1)):
        one_iteration()
    peaks: dict = {}
    if env["cuda"]:
        for name, (fn, inp, dout) in full.items():
            peaks[name] = peak_growth(fn, inp, dout)
        for p in cfg["Ps"]:
            per = []
            for r in range(p):
                with emulated_rank(r, p):
                    per.append(peak_growth(ring, shards[p][r][:3], shards[p][r][3]))
            peaks[p] = per
    iters, samples, cut = cfg["iters"].get(n, 2), [], False
    for i in range(iters):
        if i > 0 and time.monotonic() > deadline:
            cut = True
            break
        samples.append(one_iteration())
    return {"samples": samples, "peaks": peaks, "cut": cut}


def planner_threshold(cfg: dict, n: int, p: int, bw_gbps: float, flops: float | None) -> int:
    """``hf_ring.planner.plan``'s ring-overlap threshold (tokens per rank) for this attention shape."""
    from hf_ring.planner import KNOWN_MODELS, ModelShape, PlanSettings, plan

    shape = dict(KNOWN_MODELS["Llama-3.1-8B"], num_attention_heads=cfg["Hq"], num_key_value_heads=cfg["Hkv"],
                 head_dim=cfg["D"])  # fmt: skip
    kw = {} if flops is None else {"flops": flops}
    settings = PlanSettings(seq_len=n, gpus=p, cp=p, dtype=cfg["dtype"], intra_GBps=bw_gbps, inter_GBps=bw_gbps,
                            gpus_per_node=p, **kw)  # fmt: skip
    pl = plan(ModelShape.from_config(shape, name="bench_gpu"), settings)
    return int(pl.overlap["threshold_tokens"])


def build_rows(results: dict, cfg: dict, env: dict, links: dict, meta: dict) -> list[dict]:
    rows: list[dict] = []
    b, hq, hkv, d = cfg["B"], cfg["Hq"], cfg["Hkv"], cfg["D"]
    nbytes = torch.empty(0, dtype=env["dtype"]).element_size()
    threads = torch.get_num_threads()
    kernel = env["kernel_name"]
    same = "flash_attn_full" if kernel == "flash_attn" else "sdpa_full"

    def add(name, provider, metric, p, n, vals, unit, note=""):
        med, p20, p80 = vals
        rows.append({"name": name, "provider": provider, "metric": metric, "x": n, "P": p, "N": n,
                     "median": med, "p20": p20, "p80": p80, "unit": unit, "machine": meta["machine"],
                     "versions": meta["versions"], "threads": threads, "note": note})  # fmt: skip

    def one(x):
        return (x, x, x)

    shape = f"B={b}, Hq={hq}, Hkv={hkv}, D={d}, {cfg['dtype']}, causal"
    if "check" in results:
        n, p, err = results["check"]
        for key in ("out", "dq"):
            add("gpu_emulation_check", "hf_ring_emulated", f"rel_err.{key}", p, n, one(err[key]), "rel_err",
                note=f"max over the {p} emulated ranks, exact K/V delivered (_OracleComm), vs float32 full "
                     f"attention; kernel {kernel}; {shape}")  # fmt: skip
    for n, res in results["per_n"].items():
        if "skipped" in res:
            for p in cfg["Ps"]:
                add("gpu_skipped", "budget", "skipped", p, n, one(1.0), "bool", note=res["skipped"])
            continue
        smp, peaks = res["samples"], res["peaks"]
        its = len(smp)
        nt = f"iters={its}" + ("; cut short by --max-seconds" if res["cut"] else "") + f"; {shape}"
        f_fwd = fwd_flops(n, b, hq, d)
        flops = {"fwd": f_fwd, "bwd": 2.5 * f_fwd, "total": 3.5 * f_fwd}
        t_full = {}
        for prov, (_, _, pnote) in env["full"].items():
            for phase, name in (("total", "gpu_fwd_bwd"), ("fwd", "gpu_fwd"), ("bwd", "gpu_bwd")):
                ts = [s["full"][prov][phase] for s in smp]
                add(name, prov, "time", 1, n, _stats(ts), "s", note=f"whole sequence; {pnote}; {nt}")
                tf = [flops[phase] / t / 1e12 for t in ts]
                add("gpu_tflops", prov, "fwd_bwd" if phase == "total" else phase, 1, n, _stats(tf), "TFLOP/s",
                    note=f"F_fwd = 4*B*Hq*D*N^2/2, bwd 2.5x; {pnote}; {nt}")  # fmt: skip
            t_full[prov] = [s["full"][prov]["total"] for s in smp]
            if prov in peaks:
                mib = peaks[prov] / 2**20
                add(
                    "gpu_peak_memory",
                    prov,
                    "max_allocated_growth",
                    1,
                    n,
                    one(mib),
                    "MiB",
                    note=f"torch.cuda.max_memory_allocated growth over one fwd+bwd, inputs excluded; {pnote}",
                )
        for p in cfg["Ps"]:
            t = n // p
            per = [[s["ring"][p][r] for s in smp] for r in range(p)]  # [rank][iter]
            rnote = f"zigzag rank emulated in one process (no communication), kernel {kernel}, T=N/P={t}; {nt}"
            for phase, name in (("total", "gpu_fwd_bwd"), ("fwd", "gpu_fwd"), ("bwd", "gpu_bwd")):
                mx = [max(r[i][phase] for r in per) for i in range(its)]
                mean = [sum(r[i][phase] for r in per) / p for i in range(its)]
                add(name, "hf_ring_emulated", "time", p, n, _stats(mx), "s", note="slowest rank; " + rnote)
                add(name, "hf_ring_emulated", "time.mean_rank", p, n, _stats(mean), "s",
                    note="mean over ranks; " + rnote)  # fmt: skip
                tf = [flops[phase] / p / x / 1e12 for x in mx]
                add("gpu_tflops", "hf_ring_emulated", "fwd_bwd" if phase == "total" else phase, p, n, _stats(tf),
                    "TFLOP/s", note="(F/P) / slowest rank's time; " + rnote)  # fmt: skip
            mx = [max(r[i]["total"] for r in per) for i in range(its)]
            mean = [sum(r[i]["total"] for r in per) / p for i in range(its)]
            add("gpu_load_balance", "hf_ring_emulated", "max/mean rank time", p, n,
                _stats([a / c for a, c in zip(mx, mean)]), "ratio", note=rnote)  # fmt: skip
            for base, tf in t_full.items():
                tag = " (same kernel as the ring)" if base == same else ""
                for metric, tr in (("max_rank", mx), ("mean_rank", mean)):
                    add("gpu_fraction_of_theoretical", "hf_ring_emulated", f"{metric}.vs_{base}", p, n,
                        _stats([a / p / c for a, c in zip(tf, tr)]), "ratio",
                        note=f"(t_{base}/P) / t_rank ({metric}), paired per iteration{tag}; {rnote}")  # fmt: skip
            if p in peaks:
                pk = max(peaks[p]) / 2**20
                add("gpu_peak_memory", "hf_ring_emulated", "max_allocated_growth", p, n, one(pk), "MiB",
                    note="max over the emulated ranks of torch.cuda.max_memory_allocated growth over one "
                         "fwd+bwd, inputs excluded; " + rnote)  # fmt: skip
                for base in t_full:
                    if base in peaks and peaks[base] > 0:
                        r = p * max(peaks[p]) / peaks[base]
                        add(
                            "gpu_peak_memory",
                            "hf_ring_emulated",
                            f"P*peak_rank/peak_{base}",
                            p,
                            n,
                            one(r),
                            "ratio",
                            note=rnote,
                        )
            # overlap: per-step compute of the fastest rank vs the transfer of one hop
            step_f = [min(r[i]["fwd"] for r in per) / p for i in range(its)]
            step_b = [min(r[i]["bwd"] for r in per) / p for i in range(its)]
            tot = [min(r[i]["total"] for r in per) for i in range(its)]
            f_meas = flops["total"] / p / float(np.median(tot))
            msg_f = 2 * b * t * hkv * d * nbytes
            msg_b = 2 * b * t * hkv * d * (nbytes + 4)
            for lname, bw in links.items():
                prov = f"{lname}_{bw:g}GBps"
                thr_f = [t * (msg_f / (bw * 1e9)) / s for s in step_f]
                thr_b = [t * (msg_b / (bw * 1e9)) / s for s in step_b]
                thr = [max(a, c) for a, c in zip(thr_f, thr_b)]
                lnote = (f"T=N/P={t}; BW={bw:g} GB/s per direction; T* = T * t_transfer(T) / t_step(T), "
                         f"t_step = fastest rank's t/P; {nt}")  # fmt: skip
                add(
                    "gpu_overlap_threshold",
                    prov,
                    "tokens_per_rank",
                    p,
                    n,
                    _stats(thr),
                    "tokens",
                    note="max(forward, backward); " + lnote,
                )
                add(
                    "gpu_overlap_threshold",
                    prov,
                    "tokens_per_rank.fwd",
                    p,
                    n,
                    _stats(thr_f),
                    "tokens",
                    note="forward: K/V message vs 2*B*Hq*D*T^2 FLOPs per hop; " + lnote,
                )
                add(
                    "gpu_overlap_threshold",
                    prov,
                    "tokens_per_rank.bwd",
                    p,
                    n,
                    _stats(thr_b),
                    "tokens",
                    note="backward: K/V + fp32 dK/dV messages vs 2.5x forward compute per hop; " + lnote,
                )
                pm = planner_threshold(cfg, n, p, bw, f_meas)
                pdef = planner_threshold(cfg, n, p, bw, None)
                add("gpu_overlap_threshold", prov, "tokens_per_rank.planner_measured_flops", p, n, one(pm), "tokens",
                    note=f"hf_ring.planner.plan(flops={f_meas:.4g} = fastest rank's fwd+bwd "
                         f"throughput, link {bw:g} GB/s)")  # fmt: skip
                add(
                    "gpu_overlap_threshold",
                    prov,
                    "tokens_per_rank.planner_default_flops",
                    p,
                    n,
                    one(pdef),
                    "tokens",
                    note=f"hf_ring.planner.plan(flops={PLANNER_DEFAULT_FLOPS / 1e12:g}e12 default, link {bw:g} GB/s)",
                )
                add(
                    "gpu_overlap_hidden",
                    prov,
                    "T>=threshold",
                    p,
                    n,
                    one(float(t >= float(np.median(thr)))),
                    "bool",
                    note=f"T={t} vs measured threshold {float(np.median(thr)):.4g}; " + lnote,
                )
                add(
                    "gpu_overlap_hidden",
                    prov,
                    "T>=planner_default_threshold",
                    p,
                    n,
                    one(float(t >= pdef)),
                    "bool",
                    note=f"T={t} vs plan() threshold {pdef} at {PLANNER_DEFAULT_FLOPS / 1e12:g} TFLOP/s",
                )
    return rows


def print_table(rows: list[dict], cfg: dict, links: dict) -> None:
    def get(name, prov, metric, p, n):
        for r in rows:
            if (r["name"], r["provider"], r["metric"], r["P"], r["N"]) == (name, prov, metric, p, n):
                return r["median"]
        return None

    ns = sorted({r["N"] for r in rows if r["name"] == "gpu_fwd_bwd"})
    full = sorted({r["provider"] for r in rows if r["name"] == "gpu_fwd_bwd" and r["provider"] != "hf_ring_emulated"})
    lk = [f"{k}_{v:g}GBps" for k, v in links.items()]
    head = (f"{'N':>7} {'P':>2} {'T':>6} | {'full ms':>9} {'TF/s':>6} | {'rank ms':>9} {'mean ms':>9} {'TF/s':>6} "
            f"{'frac max':>8} {'mean':>6} {'bal':>5} | {'mem P*r/f':>9} | "
            + " ".join(f"{'T*/plan ' + k.split('_')[0]:>17}" for k in lk))  # fmt: skip
    print(head)
    print("-" * len(head))
    same = [r["metric"].split(".vs_")[1] for r in rows if "same kernel" in r["note"]]
    base = same[0] if same else (full[0] if full else "sdpa_full")  # the full call using the ring's kernel
    for n in ns:
        tf = get("gpu_fwd_bwd", base, "time", 1, n)
        fl = get("gpu_tflops", base, "fwd_bwd", 1, n)
        for p in cfg["Ps"]:
            tr = get("gpu_fwd_bwd", "hf_ring_emulated", "time", p, n)
            if tr is None:
                continue
            mem = get("gpu_peak_memory", "hf_ring_emulated", f"P*peak_rank/peak_{base}", p, n)
            thr = []
            for k in lk:
                x = get("gpu_overlap_threshold", k, "tokens_per_rank", p, n)
                pl = get("gpu_overlap_threshold", k, "tokens_per_rank.planner_default_flops", p, n)
                h = get("gpu_overlap_hidden", k, "T>=threshold", p, n)
                thr.append(f"{x:7.3g}/{pl:<6.0f} {'ok' if h else 'NO'}")
            print(f"{n:>7} {p:>2} {n // p:>6} | {1e3 * tf:>9.2f} {fl:>6.3g} | {1e3 * tr:>9.2f} "
                  f"{1e3 * get('gpu_fwd_bwd', 'hf_ring_emulated', 'time.mean_rank', p, n):>9.2f} "
                  f"{get('gpu_tflops', 'hf_ring_emulated', 'fwd_bwd', p, n):>6.3g} "
                  f"{get('gpu_fraction_of_theoretical', 'hf_ring_emulated', 'max_rank.vs_' + base, p, n):>8.3f} "
                  f"{get('gpu_fraction_of_theoretical', 'hf_ring_emulated', 'mean_rank.vs_' + base, p, n):>6.3f} "
                  f"{get('gpu_load_balance', 'hf_ring_emulated', 'max/mean rank time', p, n):>5.3f} | "
                  f"{'-' if mem is None else f'{mem:.2f}':>9} | " + " ".join(f"{s:>17}" for s in thr))  # fmt: skip
    print(f"(full = {base}; frac = (t_full/P)/t_rank, slowest rank / mean rank; bal = max/mean rank time; "
          "mem = P*peak_rank/peak_full; T* = measured overlap threshold, plan = hf_ring.planner.plan's at "
          f"{PLANNER_DEFAULT_FLOPS / 1e12:g} TFLOP/s, tokens per rank; ok: T >= T*)")  # fmt: skip
    for r in rows:
        if r["name"] == "gpu_emulation_check":
            print(f"emulation check N={r['N']} P={r['P']}: {r['metric']} = {r['median']:.2e}")
        if r["name"] == "gpu_skipped" and r["P"] == cfg["Ps"][0]:
            print(f"skipped N={r['N']}: {r['note']}")


def _parse_links(specs: list[str]) -> dict:
    links = {}
    for s in specs:
        name, _, val = s.rpartition("=")
        bw = float(val)
        if bw <= 0:
            raise SystemExit(f"--link-GBps: bandwidth must be positive in {s!r}")
        links[name or f"link{bw:g}"] = bw
    return links


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/results/gpu.jsonl")
    ap.add_argument("--quick", action="store_true", help="CPU smoke configuration (also used when there is no CUDA)")
    ap.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available, unless --quick)")
    ap.add_argument("--Ns", type=int, nargs="*", default=None, help="total sequence lengths")
    ap.add_argument("--Ps", type=int, nargs="*", default=None, help="emulated ring sizes")
    ap.add_argument("--iters", type=int, default=None, help="timed iterations for every N (default: by N)")
    ap.add_argument("--warmup", type=int, default=None, help="warm-up iterations for every N (default: by N)")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="default bf16 on GPU, fp32 on CPU")
    ap.add_argument("--heads", type=int, nargs=2, default=None, metavar=("HQ", "HKV"))
    ap.add_argument("--head-dim", type=int, default=None)
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--backend", default="auto", help="hf_ring block kernel: auto, torch, flash_attn, reference")
    ap.add_argument("--link-GBps", nargs="*", default=DEFAULT_LINKS, metavar="NAME=GBPS",
                    help="link bandwidths per direction, GB/s (default: nvlink=450 ib=50)")  # fmt: skip
    ap.add_argument("--max-seconds", type=float, default=None, help="time budget (default 420 GPU, 60 CPU)")
    ap.add_argument("--no-check", action="store_true", help="skip the emulation exactness check")
    args = ap.parse_args(argv)

    t_start = time.monotonic()
    cuda = torch.cuda.is_available() and not args.quick and args.device != "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device")
    cfg = dict(GPU_CFG if cuda else QUICK_CFG)
    if args.Ns:
        cfg["Ns"] = sorted(args.Ns)
    if args.Ps:
        cfg["Ps"] = sorted(set(args.Ps))
    if any(n % (2 * p) for n in cfg["Ns"] for p in cfg["Ps"]):
        raise SystemExit("every N must be a multiple of 2P (zigzag)")
    if args.iters:
        cfg["iters"] = {n: args.iters for n in cfg["Ns"]}
    if args.warmup is not None:
        cfg["warmup"] = {n: args.warmup for n in cfg["Ns"]}
    if args.dtype:
        cfg["dtype"] = args.dtype
    if args.heads:
        cfg["Hq"], cfg["Hkv"] = args.heads
    if args.head_dim:
        cfg["D"] = args.head_dim
    if args.batch:
        cfg["B"] = args.batch
    if args.max_seconds is not None:
        cfg["max_seconds"] = args.max_seconds
    links = _parse_links(args.link_GBps)
    device = torch.device("cuda" if cuda else "cpu")
    dtype = DTYPES[cfg["dtype"]]
    if not cuda:
        torch.set_flush_denormal(True)  # _NoComm's receive buffers hold stale values: keep them cheap
    kernel_name = hring.get_kernel(args.backend, device, dtype).name
    env = {"device": device, "dtype": dtype, "cuda": cuda, "clock": Clock(cuda), "backend": args.backend,
           "kernel_name": kernel_name, "full": full_providers(cfg, cuda, dtype, device)}  # fmt: skip
    machine = machine_info()
    vers = versions()
    if cuda:
        props = torch.cuda.get_device_properties(device)
        machine.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / 2**30, 1),
                       cuda=torch.version.cuda, capability=f"{props.major}.{props.minor}")  # fmt: skip
        with contextlib.suppress(ImportError):
            import flash_attn

            vers["flash_attn"] = flash_attn.__version__
    else:
        machine["gpu"] = "none (CPU mode)"
    meta = {"machine": machine, "versions": vers}
    print(f"[bench_gpu] {'GPU ' + machine['gpu'] if cuda else 'CPU'}; {cfg['dtype']} B={cfg['B']} Hq={cfg['Hq']} "
          f"Hkv={cfg['Hkv']} D={cfg['D']}; N={cfg['Ns']} P={cfg['Ps']}; ring kernel {kernel_name}; "
          f"full: {', '.join(env['full'])}; budget {cfg['max_seconds']:g} s", flush=True)  # fmt: skip

    deadline = t_start + cfg["max_seconds"]
    results: dict = {"per_n": {}}
    if not args.no_check:
        n, p = cfg["check"]
        g = torch.Generator(device=device).manual_seed(99)
        heads = (cfg["Hq"], cfg["Hkv"], cfg["Hkv"], cfg["Hq"])  # q, k, v, dout
        qkvd = [torch.randn(cfg["B"], n, h, cfg["D"], generator=g, device=device, dtype=dtype) for h in heads]
        results["check"] = (n, p, emulation_error(*qkvd, p, args.backend))
        del qkvd
    last = None  # (N, seconds) of the previous N
    for n in cfg["Ns"]:
        now = time.monotonic()
        if last is not None:
            est = last[1] * 1.075 * (n / last[0]) ** 2  # quadratic cost: 4.3x when N doubles
            if now + est > deadline:
                msg = (f"skipped by --max-seconds {cfg['max_seconds']:g}: estimated {est:.0f} s, "
                       f"{deadline - now:.0f} s left")  # fmt: skip
                results["per_n"][n] = {"skipped": msg}
                print(f"[bench_gpu] N={n}: {msg}", flush=True)
                continue
        try:
            results["per_n"][n] = run_n(n, cfg, env, deadline)
        except torch.cuda.OutOfMemoryError as e:
            results["per_n"][n] = {"skipped": f"CUDA out of memory: {str(e).splitlines()[0]}"}
        finally:
            if cuda:
                torch.cuda.empty_cache()
        last = (n, time.monotonic() - now)
        print(f"[bench_gpu] N={n} done in {last[1]:.1f} s", flush=True)

    rows = build_rows(results, cfg, env, links, meta)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w") as f:
        for r in rows:
            f.write(json.dumps({k: r[k] for k in FIELDS}) + "\n")
    print_table(rows, cfg, links)
    print(f"[bench_gpu] {len(rows)} rows -> {out}; total {time.monotonic() - t_start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
