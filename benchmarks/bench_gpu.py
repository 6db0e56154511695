"""Single-GPU benchmark of hf_ring's block kernels against the theoretical speed of a context-parallel ring.

    python -m benchmarks.bench_gpu --out benchmarks/results/gpu.jsonl        # one GPU, ~1-2 min on an H200
    python -m benchmarks.bench_gpu --quick --out /tmp/gpu.jsonl              # CPU smoke test, < 20 s
    python -m benchmarks.bench_gpu --Ns 8192 32768 --Ps 4 --link-GBps nvlink=450 ib=50 roce=25

No P GPUs are needed: the ring is **emulated in one process**. For rank ``r`` of ``P`` (zigzag layout)
the real ``hf_ring.ops.ring.ring_attention`` runs on the rank's shard of ``T = N/P`` tokens with
``ring=testkit.comm.NoCommRing(P, r)`` (``gpu_timing.emulated_rank``): channels that send nothing, receive
buffers that keep whatever they hold (kernel cost does not depend on values). So every kernel call,
merge and accumulation of the rank's forward and backward schedule runs, and nothing else.
``emulation_error`` gives the ring a ``fill`` (``oracle_fill``) that copies into each receive buffer
the K/V block the real ring would deliver, so that the emulated rank's output and dQ are exact (its
dK/dV are not: their accumulators come from other ranks) -- a check that what is timed is the real
computation. No NCCL kernels compete for the GPU's SMs and memory bandwidth here,
so the fraction of theoretical is an upper bound for a real ring on the same GPU.

Default configuration (GPU): bf16, Llama-3.1-8B attention (B=1, Hq=32, Hkv=8, D=128, causal),
N in {8K, 16K, 32K, 64K} (``--Ns``), P in {2, 4, 8} (``--Ps``), block kernel ``--backend auto``
(flash-attn when importable, else torch's CUDA flash op). ``--quick`` (or no CUDA): CPU, float32,
Hq=8, Hkv=2, D=64, N in {1024, 2048}, P in {2, 4}, 2 iterations.

Measured, per N (full call) and per (N, P) (emulated ranks); every iteration times the full call(s)
once and then every rank of every P, in that order; warm-up iterations first; median/p20/p80 over
iterations. CUDA: CUDA events around forward and backward; CPU: perf_counter.

  * full call, fwd+bwd of causal attention over all N tokens: ``sdpa_full`` =
    ``F.scaled_dot_product_attention(is_causal=True, enable_gqa=True)`` on [B, H, N, D] under
    ``sdpa_kernel(SDPBackend.FLASH_ATTENTION)`` on CUDA (K/V expanded inside the timed call if this
    torch's flash backend refuses ``enable_gqa``; the note says so); ``flash_attn_full`` =
    ``flash_attn_func(causal=True)`` when flash-attn is importable (``workloads.full_providers``).
  * ``hf_ring_emulated``: per iteration, the slowest rank's time (``time``) and the mean over ranks.
  * derived rows (fraction of theoretical, TFLOP/s, peak memory ratio, overlap threshold against
    the links, the emulation check): ``benchmarks.gpu_table``, whose docstring gives the formulas.

Links (``--link-GBps NAME=GB/s ...``, GB = 1e9 bytes, per direction): nvlink=450 (H100/H200 NVLink4,
900 GB/s bidirectional) and ib=50 (one 400 Gb/s InfiniBand NIC per GPU).

Budget: ``--max-seconds`` (default 420 on GPU): before each N the time the next one will take is
estimated (4.3 x the previous N: quadratic cost) and the remaining N are skipped, with a
``gpu_skipped`` row each, when it would not fit; an iteration loop also stops early at the deadline.
A CUDA out-of-memory error skips that N the same way.

Output: one JSON object per line (the long format, ``benchmarks.harness.FIELDS``: name,
provider, metric, x, P, N, median, p20, p80, unit, machine, versions, threads, note; x = N; full-call
rows have P = 1). Rows: gpu_fwd_bwd / gpu_fwd / gpu_bwd (time, s), gpu_tflops, gpu_fraction_of_theoretical,
gpu_load_balance, gpu_peak_memory, gpu_overlap_threshold (tokens per rank, provider = link),
gpu_overlap_hidden (1/0), gpu_emulation_check, gpu_skipped. Plots: ``benchmarks.plot.plot_gpu``.

Every block kernel and a model step (``benchmarks.gpu_kernels``, after the offload, about 45% of what is left of the
budget): each kernel of ``available_backends`` as a causal block and as an emulated rank at 8K-128K tokens per rank,
TFLOP/s and MFU against the GPU's bf16 peak (``hf_ring.planner.gpu_kind``); GEMM and memory rates; a step of
Llama-3.1-8B-shaped layers at 32K-128K tokens with tokens/s, MFU and the planner's estimate against it. Rows
``gpu_kernel``, ``gpu_kernel_tflops``, ``gpu_kernel_mfu``, ``gpu_gemm_tflops``, ``gpu_memory_GBps``,
``gpu_model_step``, ``gpu_model_estimate``; ``python -m benchmarks.gpu_rates`` turns them into the planner's
measured rates. ``--no-kernels`` skips them.

Activation offload (``benchmarks.offload_overlap``, first, within the same budget): step time of
checkpointed MLP blocks with the offload's copies on a side stream and on the compute stream, against
checkpointing alone (GPU: T=32768 tokens, 8 blocks, H=4096, bf16: 2 GiB offloaded per step each way;
``--offload-tokens``, ``--offload-layers``), and a check that the side-stream step equals checkpointing's.
Rows gpu_offload_step (time; ratio_to_checkpointing), gpu_offload_bytes, gpu_offload_check.
``--offload-only`` runs just that; ``--no-offload`` skips it.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path

import torch

from benchmarks import gpu_kernels as GK
from benchmarks import harness as H
from benchmarks import offload_overlap as O
from benchmarks import workloads as W
from benchmarks.gpu_table import build_rows, print_table
from benchmarks.gpu_timing import Clock, emulated_rank, emulation_error, fwd_bwd, peak_growth
from hf_ring.ops.kernels import get_kernel
from hf_ring.ops.zigzag import zigzag

GPU_CFG = {
    "Ns": [8192, 16384, 32768, 65536],
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
    "kernels": GK.GPU,
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
    "max_seconds": 240.0,  # generous: a loaded machine must not skip the quick grid
    "kernels": GK.CPU,
}
DEFAULT_LINKS = ["nvlink=450", "ib=50"]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


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
    shards = {p: [tuple(zigzag(t, 1, p, r) for t in (q, k, v, do)) for r in range(p)] for p in cfg["Ps"]}
    del q, k, v, do
    ranks = {p: [emulated_rank(r, p, env["kernel"]) for r in range(p)] for p in cfg["Ps"]}

    def one_iteration() -> dict:
        rec: dict = {"full": {}, "ring": {}}
        for name, (fn, inp, dout) in full.items():
            rec["full"][name] = fwd_bwd(fn, inp, dout, clock)
        for p in cfg["Ps"]:
            rec["ring"][p] = []
            for r in range(p):
                rec["ring"][p].append(fwd_bwd(ranks[p][r], shards[p][r][:3], shards[p][r][3], clock))
        return rec

    for _ in range(cfg["warmup"].get(n, 1)):
        one_iteration()
    peaks: dict = {}
    if env["cuda"]:
        for name, (fn, inp, dout) in full.items():
            peaks[name] = peak_growth(fn, inp, dout)
        for p in cfg["Ps"]:
            peaks[p] = [peak_growth(ranks[p][r], shards[p][r][:3], shards[p][r][3]) for r in range(p)]
    iters, samples, cut = cfg["iters"].get(n, 2), [], False
    for i in range(iters):
        if i > 0 and time.monotonic() > deadline:
            cut = True
            break
        samples.append(one_iteration())
    return {"samples": samples, "peaks": peaks, "cut": cut}


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
    ap.add_argument("--max-seconds", type=float, default=None, help="time budget (default 420 GPU, 240 CPU)")
    ap.add_argument("--no-check", action="store_true", help="skip the emulation exactness check")
    ap.add_argument("--no-offload", action="store_true", help="skip the activation offload measurement")
    ap.add_argument("--offload-only", action="store_true", help="only the activation offload measurement")
    ap.add_argument("--offload-tokens", type=int, default=None, help="tokens of the offload workload")
    ap.add_argument("--offload-layers", type=int, default=None, help="checkpointed blocks of the offload workload")
    ap.add_argument("--no-kernels", action="store_true", help="skip the kernel table and the model step")
    args = ap.parse_args(argv)

    t_start = time.monotonic()
    cuda = torch.cuda.is_available() and not args.quick and args.device != "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device")
    cfg = dict(GPU_CFG if cuda else QUICK_CFG)
    over = dict(Ns=sorted(args.Ns or []) or None, Ps=sorted(set(args.Ps or [])) or None, dtype=args.dtype,
                D=args.head_dim or None, B=args.batch or None, max_seconds=args.max_seconds)  # fmt: skip
    cfg.update({k: v for k, v in over.items() if v is not None})
    if any(n % (2 * p) for n in cfg["Ns"] for p in cfg["Ps"]):
        raise SystemExit("every N must be a multiple of 2P (zigzag)")
    if args.iters:
        cfg["iters"] = {n: args.iters for n in cfg["Ns"]}
    if args.warmup is not None:
        cfg["warmup"] = {n: args.warmup for n in cfg["Ns"]}
    if args.heads:
        cfg["Hq"], cfg["Hkv"] = args.heads
    links = _parse_links(args.link_GBps)
    device = torch.device("cuda" if cuda else "cpu")
    dtype = DTYPES[cfg["dtype"]]
    if not cuda:
        torch.set_flush_denormal(True)  # NoCommRing's receive buffers hold stale values: keep them cheap
    kernel = get_kernel(args.backend, device, dtype)
    kernel_name = kernel.name
    env = {"device": device, "dtype": dtype, "cuda": cuda, "clock": Clock(cuda), "backend": args.backend,
           "kernel": kernel, "kernel_name": kernel_name,
           "full": W.full_providers(cfg, cuda, dtype, device)}  # fmt: skip
    machine = H.machine_info()
    vers = H.versions()
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
    offload_rows, offload_state = [], "skipped"
    if not args.no_offload:
        ocfg = dict(O.GPU if cuda else O.CPU)
        ocfg.update({k: v for k, v in (("tokens", args.offload_tokens), ("layers", args.offload_layers)) if v})
        try:
            res = O.measure(ocfg, device, dtype, deadline)
            offload_rows = O.rows(res, ocfg, meta, cfg["dtype"])
            offload_state = "pass" if res["check"] <= 1e-6 else "FAIL"
            print(f"[bench_gpu] {O.summary(res)}", flush=True)
        except Exception as e:  # noqa: BLE001 - reported, and the attention timings still run
            offload_state = "FAIL"
            print(f"[bench_gpu] offload measurement FAILED: {type(e).__name__}: {e}", flush=True)
        finally:
            if cuda:
                torch.cuda.empty_cache()
    if args.offload_only:
        cfg["Ns"] = []
    kernel_tab = H.Table(meta, lambda p: torch.get_num_threads())
    if not args.no_kernels and not args.offload_only:  # ~45% of what is left; the N x P grid the rest
        GK.run(kernel_tab, cfg, device, dtype, deadline)
    if not args.no_check and not args.offload_only:
        n, p = cfg["check"]
        g = torch.Generator(device=device).manual_seed(99)
        heads = (cfg["Hq"], cfg["Hkv"], cfg["Hkv"], cfg["Hq"])  # q, k, v, dout
        qkvd = [torch.randn(cfg["B"], n, h, cfg["D"], generator=g, device=device, dtype=dtype) for h in heads]
        try:
            results["check"] = (n, p, emulation_error(*qkvd, p, kernel))
        except Exception as e:  # noqa: BLE001 - reported, and the timings still run
            results["check_failed"] = f"{type(e).__name__}: {e}"
            print(f"[bench_gpu] emulation check FAILED: {results['check_failed']}", flush=True)
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
        except Exception as e:  # noqa: BLE001 - one N failing must not hide the others
            results["per_n"][n] = {"skipped": f"FAILED: {type(e).__name__}: {str(e).splitlines()[0]}"}
            print(f"[bench_gpu] N={n} FAILED: {results['per_n'][n]['skipped']}", flush=True)
        finally:
            if cuda:
                torch.cuda.empty_cache()
        last = (n, time.monotonic() - now)
        print(f"[bench_gpu] N={n} done in {last[1]:.1f} s", flush=True)

    rows = build_rows(results, cfg, env, links, meta) + offload_rows + kernel_tab.rows
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    H.write_rows(out, rows)
    if cfg["Ns"]:
        print_table([r for r in rows if r not in offload_rows and r not in kernel_tab.rows], cfg, links)
    print(f"[bench_gpu] {len(rows)} rows -> {out}; total {time.monotonic() - t_start:.1f} s")
    checks = {"emulation check": "skipped" if args.no_check or args.offload_only else
              ("FAIL" if "check_failed" in results else "pass"), "offload": offload_state}  # fmt: skip
    failed = [r for r in kernel_tab.rows if r["name"] == "gpu_skipped" and "FAILED" in r["note"] + r["metric"]]
    checks["kernels"] = "FAIL" if failed else ("skipped" if args.no_kernels or args.offload_only else "pass")
    for n, res in results["per_n"].items():
        note = res.get("skipped", "")
        checks[f"N={n}"] = "FAIL" if note.startswith("FAILED") else ("skipped" if note else "pass")
    print("[bench_gpu] " + "; ".join(f"{k}: {v}" for k, v in checks.items()), flush=True)
    return 1 if "FAIL" in checks.values() else 0


if __name__ == "__main__":
    sys.exit(main())
