"""The planner's step-time estimate (``hf_ring.planner.timing.step_time``) against measured CPU training steps.

    python -m benchmarks.bench_step_time --out benchmarks/results/step_time.jsonl   # ~3-6 min on 2 idle cores
    python -m benchmarks.bench_step_time --quick --out /tmp/step_time.jsonl          # smoke test
    python -m benchmarks.bench_step_time --check 1.3                                 # exit 1 past 1.3x

A tiny Llama (``MODEL``: 2 layers, hidden 256, 4 query / 2 K/V heads of 64, float32, full fine-tuning, activation
checkpointing, plain loss) trains through ``attn_implementation="ring"`` on gloo CPU ranks (one thread each) at
several layouts: P = 1, 2, 4 (ring) and 4 as Ulysses 2 x ring 2, and lengths ``--Ns``. In the same processes,
right before the steps and at the same time on every rank (so the ranks share the cores as in the step), each
rank calibrates the planner's rates with microbenchmarks of the work the step gives it, each timed alone: GEMM
FLOP/s from the model's own linear layers on its shard's tokens (forward, dX, dW), attention FLOP/s from torch's
CPU flash op on the blocks of its ring steps (one causal block, a half block per other ring position), memory
bytes/s from one layer's elementwise work (RMSNorms, RoPE, gated activation, residual adds; forward and
backward) over the planner's count of its bytes, and the link's bytes/s from ring hops of a K/V message.

Two clocks, each on both sides: wall seconds, and the rank's CPU seconds (``time.process_time``: every thread of
the process, user and system). A rank has one thread, so its CPU time is the time the step would take on a core
of its own: it does not grow when other ranks (P = 4 on 2 cores) or other processes take the cores, which wall
time does, by whatever share they took (waiting for a peer's message is no CPU time: on this clock the link is
the CPU cost of gloo's copies, calibrated and spent alike). The CPU clock is the one checked (``--check``, and
``tests/test_timing.py`` on the committed results); the wall clock is recorded beside it. The estimate is
``step_time`` with the calibrated rates (the slowest rank's) and the link bandwidth; the measured time is the
median over iterations of the busiest rank's forward + backward (no optimizer step). Rows (the long format of
``benchmarks.harness``): ``step_time_cpu`` / ``step_time`` (provider measured / estimate, seconds),
``step_time_cpu_ratio`` / ``step_time_ratio`` (estimate / measured, per iteration), ``calibrated_rate_cpu`` /
``calibrated_rate`` (GFLOP/s, GB/s); the notes give the layout and the foreign load. An iteration during which
other processes used > 10% of the machine is run again once.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks import harness as H

MODEL: dict[str, Any] = dict(
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    vocab_size=512,
    max_position_embeddings=16384,
    tie_word_embeddings=False,
)
LAYOUTS = [(1, 1), (2, 1), (4, 1), (4, 2)]  # (P, Ulysses degree)
SMALL = 128  # tokens of the step that measures the fixed cost per step (FLOPs next to nothing)
FULL = {"Ns": [2048, 4096], "iters": 3, "warmup": 1}
QUICK = {"Ns": [512], "iters": 1, "warmup": 1}


# ============================================================================ worker side
def _clocks() -> tuple[float, float]:
    """(wall seconds, this process's CPU seconds: every thread, user and system)."""
    return time.perf_counter(), time.process_time()


def _timed(fn, reps: int = 3) -> tuple[float, float]:
    """Median wall and CPU seconds of ``fn()`` (after one call to warm it up)."""
    fn()
    wall, cpu = [], []
    for _ in range(reps):
        w0, c0 = _clocks()
        fn()
        w1, c1 = _clocks()
        wall.append(w1 - w0)
        cpu.append(c1 - c0)
    return sorted(wall)[reps // 2], sorted(cpu)[reps // 2]


def _calibrate(n: int, size: int, ulysses: int, group) -> dict[str, dict[str, float]]:
    """This rank's GEMM and attention FLOP/s, memory and link bytes/s for ``n`` tokens over ``size`` ranks: each
    from the work the step gives the rank, timed alone (``torch.autograd`` forward + backward where the step
    has one); ``{"wall": rates, "cpu": rates}``, per wall second and per second of the rank's CPU time."""
    import math

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from hf_ring.ops.kernels_cpu import TorchCPUKernel
    from hf_ring.planner import ModelShape
    from hf_ring.planner.timing import elementwise_bytes

    g = torch.Generator().manual_seed(0)
    h, i, hq, hkv, d = (MODEL[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads",
                                           "num_key_value_heads", "head_dim"))  # fmt: skip
    t = n // size
    # GEMMs: the layer's linear layers on the rank's tokens, forward + dX + dW
    linears = [torch.nn.Linear(a, b, bias=False) for a, b in
               ((h, hq * d), (h, hkv * d), (h, hkv * d), (hq * d, h), (h, i), (h, i), (i, h))]  # fmt: skip
    x_in = {lin.in_features: torch.randn(t, lin.in_features, generator=g, requires_grad=True) for lin in linears}

    def gemms() -> None:
        for lin in linears:
            lin(x_in[lin.in_features]).sum().backward()

    gemm_flops = sum(6 * t * lin.in_features * lin.out_features for lin in linears)
    times = {"gemm": _timed(gemms)}
    # attention: the ring position's blocks (one causal, R - 1 halves) on its heads
    ring, heads, kv = size // ulysses, hq // ulysses, hkv // math.gcd(hkv, ulysses)
    tr = n // ring
    kernel = TorchCPUKernel()
    q, k, v = (torch.randn(1, tr, m, d, generator=g) for m in (heads, kv, kv))

    def attention() -> None:
        for qq, causal in [(q, True)] + [(q[:, : tr // 2], False)] * (ring - 1):
            out, lse = kernel.forward(qq, k, v, causal=causal, scale=d**-0.5)
            kernel.backward(out, qq, k, v, out, lse, causal=causal, scale=d**-0.5)

    times["attention"] = _timed(attention)
    # memory-bound: one layer's elementwise work (RMSNorms, RoPE, gated activation, residual adds), fwd + bwd
    xs = [torch.randn(t, w, generator=g, requires_grad=True) for w in (h, hq * d, hkv * d, i, i)]
    cos, sin = torch.randn(t, 1, d, generator=g), torch.randn(t, 1, d, generator=g)

    def rms(x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)

    def rope(x: torch.Tensor, heads_: int) -> torch.Tensor:
        x = x.view(t, heads_, d)
        return x * cos + torch.cat((-x[..., d // 2 :], x[..., : d // 2]), -1) * sin

    def elementwise() -> None:
        x, qx, kx, gate, up = xs
        y = rms(x) + rms(x + x)
        out = y.sum() + rope(qx, hq).sum() + rope(kx, hkv).sum() + (F.silu(gate) * up).sum()
        out.backward()

    shape = ModelShape.from_config({"model_type": "llama", **MODEL})
    times["memory"] = _timed(elementwise)
    work = {"gemm": gemm_flops, "attention": 4 * heads * d * ring * tr * tr / 2 * 3.5,
            "memory": elementwise_bytes(shape, 4) * t * 3, "link": 0.0}  # fmt: skip
    if size > 1:
        rank = dist.get_rank(group)
        msg = torch.randn(2, tr, kv, d, generator=g)
        recv = torch.empty_like(msg)

        def hop() -> None:
            ops = [dist.P2POp(dist.isend, msg, (rank + ulysses) % size, group),
                   dist.P2POp(dist.irecv, recv, (rank - ulysses) % size, group)]  # fmt: skip
            for r in dist.batch_isend_irecv(ops):
                r.wait()

        times["link"], work["link"] = _timed(hop), msg.numel() * 4
    return {clock: {k: work[k] / times[k][i] if k in times else 0.0 for k in work}
            for i, clock in enumerate(("wall", "cpu"))}


def _worker(rank: int, size: int, cfg: dict) -> dict:
    import torch
    import torch.distributed as dist

    import hf_ring
    from testkit.models import tiny_batch, tiny_model

    torch.manual_seed(0)
    hf_ring.setup_context_parallel(size, ulysses_size=cfg["ulysses"])
    group = dist.group.WORLD
    out: dict[str, Any] = {}
    for n in [SMALL, *cfg["Ns"]]:
        model = tiny_model("llama", "ring", seed=0, **MODEL)
        hf_ring.enable_activation_checkpointing(model)
        model.train()
        kwargs = hf_ring.shard_batch(tiny_batch(1, n, vocab=MODEL["vocab_size"], seed=1), group=group)
        dist.barrier(group)
        rates = _calibrate(n, size, cfg["ulysses"], group) if n != SMALL else {}

        def step(model=model, kwargs=kwargs) -> dict[str, float]:  # noqa: ANN001
            dist.barrier(group)
            w0, c0 = _clocks()
            model(**kwargs).loss.backward()
            w1, c1 = _clocks()
            model.zero_grad(set_to_none=True)
            return {"wall": w1 - w0, "cpu": c1 - c0}

        meter = H.GroupLoad(group, rank, cores=cfg["cores"])
        iters = max(cfg["iters"], 3) if n == SMALL else cfg["iters"]
        samples, loads, _ = H.measure(step, meter, warmup=cfg["warmup"], iters=iters, max_foreign=0.10,
                                      max_redo=1)  # fmt: skip
        out[str(n)] = {"rates": rates, "samples": samples, "loads": loads}
    return out


# ============================================================================ driver side
def estimate(n: int, p: int, u: int, rates: dict[str, float]) -> float:
    """The planner's step time of the benchmark's model and settings with calibrated ``rates``."""
    from hf_ring.planner import ModelShape, PlanSettings, Rates, step_time

    m = ModelShape.from_config({"model_type": "llama", **MODEL}, name="bench_step_time")
    link = rates["link"] / 1e9 if rates["link"] else 1.0
    s = PlanSettings(seq_len=n, gpus=p, cp=p, mode="full", dtype="fp32", checkpointing=True, chunked_loss=False,
                     micro_batch=1, intra_GBps=link, inter_GBps=link, gpus_per_node=p, ulysses_size=u)  # fmt: skip
    r = Rates(attention=rates["attention"], gemm=rates["gemm"], memory=rates["memory"], peak=0.0, kernel="torch")
    return step_time(m, s, p, u, r).total_s


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/results/step_time.jsonl")
    ap.add_argument("--quick", action="store_true", help="N=512, one iteration (smoke test)")
    ap.add_argument("--Ns", type=int, nargs="*", default=None)
    ap.add_argument("--check", type=float, default=None, help="exit 1 when an estimate is off by more than this factor")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per layout")
    args = ap.parse_args(argv)
    cfg = dict(QUICK if args.quick else FULL)
    if args.Ns:
        cfg["Ns"] = sorted(args.Ns)
    meta = {"machine": H.machine_info(), "versions": H.versions(transformers=True)}
    tab = H.Table(meta, lambda p: 1)
    worst = 1.0
    print(f"[step_time] {'layout':<14}{'N':>6}{'clock':>6}{'measured s':>12}{'estimate s':>12}{'ratio':>8}"
          f"{'planner s':>10}{'ratio':>8}", flush=True)
    cfg["cores"] = meta["machine"]["cores"]
    for p, u in LAYOUTS:
        per_rank, load = H.launch(_worker, p, {**cfg, "ulysses": u}, threads=1, timeout=args.timeout)
        layout = f"P={p}" + (f" U={u}" if u > 1 else "")
        for n in cfg["Ns"]:
            res = [r[str(n)] for r in per_rank]
            note = f"{layout}; foreign CPU load {100 * load:.0f}%"
            for clock, suffix in (("cpu", "_cpu"), ("wall", "")):
                measured = H.per_iter_max([r["samples"] for r in res], clock)  # the busiest / slowest rank
                rates = {k: min(r["rates"][clock][k] for r in res) for k in res[0]["rates"][clock]}
                small = H.per_iter_max([r[str(SMALL)]["samples"] for r in per_rank], clock)
                fixed = max(0.0, sorted(small)[len(small) // 2] - estimate(SMALL, p, u, rates))
                planner = estimate(n, p, u, rates)
                est = planner + fixed
                tab.add(f"step_time{suffix}", "measured", "seconds", p, n, H.stats(measured), "s", note=note)
                tab.add(f"step_time{suffix}", "estimate", "seconds", p, n, (est, est, est), "s", note=note)
                tab.add(f"step_time{suffix}", "planner", "seconds", p, n, (planner,) * 3, "s", note=note)
                tab.add(f"step_fixed_cost{suffix}", f"N={SMALL} step - its estimate", "seconds", p, n, (fixed,) * 3,
                        "s", note=note)  # fmt: skip
                tab.add(f"step_time{suffix}_ratio", "estimate/measured", "ratio", p, n,
                        H.stats([est / t for t in measured]), "x", note=note)  # fmt: skip
                tab.add(f"step_time{suffix}_ratio", "planner/measured", "ratio", p, n,
                        H.stats([planner / t for t in measured]), "x", note=note)  # fmt: skip
                for k, v in rates.items():
                    unit = "GB/s" if k in ("memory", "link") else "GFLOP/s"
                    tab.add(f"calibrated_rate{suffix}", k, unit, p, n, (v / 1e9,) * 3, unit, note=note)
                med = sorted(measured)[len(measured) // 2]
                if clock == "cpu":
                    worst = max(worst, est / med, med / est)
                print(f"[step_time] {layout:<14}{n:>6}{clock:>6}{med:>12.3f}{est:>12.3f}{est / med:>8.2f}"
                      f"{planner:>10.3f}{planner / med:>8.2f}", flush=True)  # fmt: skip
    H.write_rows(Path(args.out), tab.rows)
    print(f"[step_time] {len(tab.rows)} rows -> {args.out}; CPU clock: worst estimate/measured off by {worst:.2f}x")
    return 1 if args.check is not None and worst > args.check else 0


if __name__ == "__main__":
    sys.exit(main())
