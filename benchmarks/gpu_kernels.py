"""``benchmarks.bench_gpu``'s kernel table and model step: every block kernel this GPU has, and a Llama-shaped
training step, with TFLOP/s and MFU against the GPU's peak (``hf_ring.planner.gpu_kind``).

* **kernels**: for each kernel ``available_backends`` lists (the reference kernel only at the shortest T), at ``T``
  tokens per rank: one causal ``T x T`` block, forward and backward through the kernel's own calls (``block``), and
  an emulated zigzag rank of a ring of ``P`` (``gpu_timing.emulated_rank``: its whole schedule, ``P`` steps of
  ``T^2 / 2`` pairs; ``rank``). FLOPs: ``4 Hq D pairs`` forward, 2.5x that backward. Rows ``gpu_kernel`` (s),
  ``gpu_kernel_tflops``, ``gpu_kernel_mfu``.
* **rates for the planner**: bf16 GEMMs of the model's linear shapes on ``T`` tokens (forward, dX, dW:
  ``gpu_gemm_tflops``) and an elementwise pass (``gpu_memory_GBps``); ``python -m benchmarks.gpu_rates`` turns these
  rows and the kernel rows into ``hf_ring/planner/gpu_rates.json``.
* **model step**: a causal LM of the model's layer shapes (Llama-3.1-8B on GPU: hidden 4096, 32/8 heads of 128,
  MLP 14336, vocab 128256; ``layers`` of them), bf16, full fine-tuning, activation checkpointing and the chunked loss,
  ``attn_implementation="ring"`` in one process, at ``N`` tokens: forward + backward time, tokens/s, MFU (the
  planner's model FLOPs of the step over time x peak), and the planner's estimate with the rates measured here
  (``gpu_model_estimate``: estimate / measured).

Every measurement checks a deadline first and skips (a ``gpu_skipped`` row) what would not fit.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from benchmarks import harness as H

LLAMA_8B = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                head_dim=128, vocab_size=128256, max_position_embeddings=262144, tie_word_embeddings=False)  # fmt: skip
TINY = dict(hidden_size=256, intermediate_size=512, num_attention_heads=8, num_key_value_heads=2, head_dim=32,
            vocab_size=1024, max_position_embeddings=16384, tie_word_embeddings=False)  # fmt: skip
GPU = {"Ts": [8192, 16384, 32768, 65536, 131072], "P": 4, "rank_Ts": [8192, 32768], "model": LLAMA_8B, "layers": 2,
       "model_Ns": [32768, 65536, 131072], "iters": 2}  # fmt: skip
CPU = {"Ts": [256, 512], "P": 2, "rank_Ts": [256], "model": TINY, "layers": 2, "model_Ns": [1024], "iters": 1}


def _peak(device: torch.device) -> tuple[float, str]:
    """The GPU's bf16 peak (FLOP/s) and kind; ``(0, "")`` on CPU or for a GPU the planner does not know."""
    if device.type != "cuda":
        return 0.0, ""
    from hf_ring.planner import gpu_kind

    try:
        kind = gpu_kind(torch.cuda.get_device_name(device))
    except ValueError:
        return 0.0, ""
    return kind.peak_tflops * 1e12, kind.name


def _time(fn: Callable[[], Any], sync: Callable[[], None], iters: int) -> float:
    """Median wall seconds of ``fn()`` after one warm-up call."""
    fn()
    sync()
    out = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        sync()
        out.append(time.perf_counter() - t0)
    return sorted(out)[len(out) // 2]


def _fits(deadline: float, last: tuple[int, float] | None, x: int, power: float) -> bool:
    """Whether a measurement at ``x`` fits before ``deadline``, scaling the previous one (``x^power``)."""
    if last is None:
        return time.monotonic() < deadline
    return time.monotonic() + 3 * last[1] * (x / last[0]) ** power < deadline


def kernel_rows(tab: H.Table, kernels: dict[str, Any], cfg: dict, dev: torch.device, dtype: torch.dtype,
                deadline: float) -> None:  # fmt: skip
    """Block and emulated-rank rows of every kernel in ``kernels`` (name -> BlockKernel)."""
    from benchmarks.gpu_timing import Clock, emulated_rank, fwd_bwd

    hq, hkv, d = cfg["Hq"], cfg["Hkv"], cfg["D"]
    peak, _ = _peak(dev)
    clock = Clock(dev.type == "cuda")
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    g = torch.Generator(device=dev).manual_seed(0)
    for name, kernel in kernels.items():
        last = None
        for t in cfg["kernels"]["Ts"][: 1 if name == "reference" else None]:
            if not _fits(deadline, last, t, 2):
                tab.add("gpu_skipped", name, "block", 1, t, (0.0,) * 3, "", note="past the time budget")
                continue
            q, dout = (torch.randn(1, t, hq, d, generator=g, device=dev, dtype=dtype) for _ in range(2))
            k, v = (torch.randn(1, t, hkv, d, generator=g, device=dev, dtype=dtype) for _ in range(2))

            def block(kernel=kernel, q=q, k=k, v=v, dout=dout) -> None:  # noqa: ANN001
                out, lse = kernel.forward(q, k, v, causal=True, scale=d**-0.5)
                kernel.backward(dout, q, k, v, out, lse, causal=True, scale=d**-0.5)

            t0 = time.monotonic()
            try:
                sec = _time(block, sync, cfg["kernels"]["iters"])
            except Exception as e:  # noqa: BLE001 - a kernel that fails here is reported, the others still run
                tab.add("gpu_skipped", name, "block", 1, t, (0.0,) * 3, "", note=f"FAILED: {type(e).__name__}: {e}")
                break
            last = (t, time.monotonic() - t0)
            flops = 4 * hq * d * t * t / 2 * 3.5
            _rate_rows(tab, name, "block", 1, t, sec, flops, peak)
            if t in cfg["kernels"]["rank_Ts"] and _fits(deadline, last, t * cfg["kernels"]["P"], 1):
                p = cfg["kernels"]["P"]
                rank = emulated_rank(0, p, kernel)
                samples = [fwd_bwd(rank, (q, k, v), dout, clock)["total"] for _ in range(1 + cfg["kernels"]["iters"])]
                _rate_rows(tab, name, "rank", p, t, sorted(samples[1:])[len(samples[1:]) // 2], p * flops, peak)
            del q, k, v, dout


def _rate_rows(tab: H.Table, name: str, metric: str, p: int, t: int, sec: float, flops: float, peak: float) -> None:
    tab.add("gpu_kernel", name, metric, p, t, (sec,) * 3, "s", x=t, note="fwd+bwd, causal; x = tokens per rank")
    tab.add("gpu_kernel_tflops", name, metric, p, t, (flops / sec / 1e12,) * 3, "TFLOP/s", x=t)
    if peak:
        tab.add("gpu_kernel_mfu", name, metric, p, t, (flops / sec / peak,) * 3, "fraction", x=t)


def rate_rows(tab: H.Table, cfg: dict, dev: torch.device, dtype: torch.dtype) -> None:
    """``gpu_gemm_tflops`` (the model's linear shapes, forward + dX + dW) and ``gpu_memory_GBps`` (an add)."""
    m, t = cfg["kernels"]["model"], cfg["kernels"]["Ts"][0]
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    h, i, q, kv = m["hidden_size"], m["intermediate_size"], m["num_attention_heads"] * m["head_dim"], \
        m["num_key_value_heads"] * m["head_dim"]  # fmt: skip
    shapes = [(h, q), (h, kv), (h, kv), (q, h), (h, i), (h, i), (i, h)]
    mats = [(torch.randn(t, a, device=dev, dtype=dtype), torch.randn(a, b, device=dev, dtype=dtype),
             torch.randn(t, b, device=dev, dtype=dtype)) for a, b in shapes]  # fmt: skip

    def gemms() -> None:
        for x, w, dy in mats:
            x @ w, dy @ w.T, x.T @ dy

    sec = _time(gemms, sync, 3)
    tab.add("gpu_gemm_tflops", "cublas" if dev.type == "cuda" else "cpu", "fwd+dX+dW", 1, t,
            (sum(6 * t * a * b for a, b in shapes) / sec / 1e12,) * 3, "TFLOP/s")  # fmt: skip
    a = torch.randn(t * h, 8, device=dev, dtype=dtype)
    b = torch.randn_like(a)
    sec = _time(lambda: torch.add(a, b, out=a), sync, 5)
    moved = 3 * a.numel() * a.element_size()
    tab.add("gpu_memory_GBps", "elementwise add", "read 2 + write 1", 1, t, (moved / sec / 1e9,) * 3, "GB/s")


def model_rows(tab: H.Table, cfg: dict, dev: torch.device, dtype: torch.dtype, deadline: float) -> None:
    """The model step at each N: time, tokens/s, MFU, the planner's estimate with this run's rates."""
    import hf_ring
    from hf_ring.planner import ModelShape, PlanSettings, Rates, step_flops, step_time
    from testkit.models import tiny_batch, tiny_model

    kc = cfg["kernels"]
    conf = dict(kc["model"], num_hidden_layers=kc["layers"])
    peak, kind = _peak(dev)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    shape = ModelShape.from_config({"model_type": "llama", **conf}, name="llama-8b-layers")
    rates = {r["name"]: r["median"] for r in tab.rows if r["name"] in ("gpu_gemm_tflops", "gpu_memory_GBps")}
    attn = {r["provider"]: r["median"] for r in tab.rows if r["name"] == "gpu_kernel_tflops" and r["metric"] == "block"}
    model = tiny_model("llama", "ring", seed=0, **conf).to(dev, dtype)
    hf_ring.enable_activation_checkpointing(model)
    hf_ring.enable_chunked_loss(model)
    model.train()
    last = None
    for n in kc["model_Ns"]:
        if not _fits(deadline, last, n, 2):
            tab.add("gpu_skipped", "model_step", "time", 1, n, (0.0,) * 3, "", note="past the time budget")
            continue
        t0 = time.monotonic()
        batch = {k: v.to(dev) for k, v in tiny_batch(1, n, vocab=conf["vocab_size"], seed=1).items()}
        kwargs = hf_ring.shard_batch(batch)

        def step(model=model, kwargs=kwargs) -> None:  # noqa: ANN001
            model(**kwargs).loss.backward()
            model.zero_grad(set_to_none=True)

        try:
            sec = _time(step, sync, kc["iters"])
        except torch.cuda.OutOfMemoryError as e:
            tab.add("gpu_skipped", "model_step", "time", 1, n, (0.0,) * 3, "", note=f"out of memory: {e}"[:200])
            break
        finally:
            kwargs = batch = None
            if dev.type == "cuda":
                torch.cuda.empty_cache()
        last = (n, time.monotonic() - t0)
        s = PlanSettings(seq_len=n, gpus=1, cp=1, mode="full", dtype="bf16" if dtype != torch.float32 else "fp32",
                         checkpointing=True, chunked_loss=True)  # fmt: skip
        flops = step_flops(shape, s, 1)
        note = f"{kc['layers']} layers, hidden {conf['hidden_size']}, full fine-tuning, checkpointing, chunked loss"
        tab.add("gpu_model_step", "hf_ring", "time", 1, n, (sec,) * 3, "s", note=note)
        tab.add("gpu_model_step", "hf_ring", "tokens_per_s", 1, n, (n / sec,) * 3, "tokens/s", note=note)
        if peak:
            tab.add("gpu_model_step", "hf_ring", "mfu", 1, n, (flops["model"] / sec / peak,) * 3, "fraction",
                    note=f"{note}; against {kind}'s bf16 peak")  # fmt: skip
        kernel = next(iter(attn), None)
        if kernel is not None and "gpu_gemm_tflops" in rates:
            r = Rates(attention=attn[kernel] * 1e12, gemm=rates["gpu_gemm_tflops"] * 1e12,
                      memory=rates.get("gpu_memory_GBps", 1.0) * 1e9, peak=peak, kernel=kernel)  # fmt: skip
            est = step_time(shape, s, 1, 1, r).total_s
            tab.add("gpu_model_estimate", kernel, "estimate/measured", 1, n, (est / sec,) * 3, "ratio",
                    note="planner step_time with this run's kernel, GEMM and memory rates")  # fmt: skip


def run(tab: H.Table, cfg: dict, dev: torch.device, dtype: torch.dtype, deadline: float) -> None:
    """Every block kernel of ``dev`` (the reference kernel only on CPU), the GEMM and memory rates, then the model
    step: about 45% of the time left before ``deadline``. A failure is a ``gpu_skipped`` row marked FAILED."""
    from hf_ring.ops.kernels import available_backends, get_kernel

    names = [n for n in available_backends(dev) if n != "reference" or dev.type != "cuda"]
    span = deadline - time.monotonic()
    try:
        kernel_rows(tab, {n: get_kernel(n, dev, dtype) for n in names}, cfg, dev, dtype, time.monotonic() + 0.25 * span)
        rate_rows(tab, cfg, dev, dtype)
        model_rows(tab, cfg, dev, dtype, time.monotonic() + 0.2 * span)
    except Exception as e:  # noqa: BLE001 - reported, and the grid still runs
        tab.add("gpu_skipped", "kernels", "FAILED", 1, 0, (0.0,) * 3, "", note=f"{type(e).__name__}: {e}")
        print(f"[bench_gpu] kernel table FAILED: {type(e).__name__}: {e}", flush=True)
    finally:
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    for r in tab.rows:
        if r["name"] in ("gpu_kernel_tflops", "gpu_model_step", "gpu_model_estimate"):
            what = f"{r['name']} {r['provider']} {r['metric']} x={r['x']}"
            print(f"[bench_gpu] {what}: {r['median']:.4g} {r['unit']}", flush=True)
