"""What logit soft-capping costs on CPU: torch's fused op has no cap, so a capped layer runs the reference
kernel (float32 einsum over query tiles, the cap's tanh and its derivative on every score).

    python -m benchmarks.bench_softcap                 # N in 1024 2048 4096, ~1 min on 2 cores
    python -m benchmarks.bench_softcap --N 512 --repeat 2   # smoke test
    python -m benchmarks.bench_softcap --N 1024 2048 --out benchmarks/results/softcap.jsonl   # docs/transformers.md

One process, causal attention forward + backward through ``ring_attention``: B=1, Hq=8, Hkv=2, D=64,
fp32. Rows (the long table of ``benchmarks.harness``, name ``softcap``): the fused CPU op without a cap
(``fused``), the reference kernel without a cap (``reference``) and with ``softcap=50``
(``reference_softcap50``), seconds over ``--repeat`` runs after one warm-up, and the capped / fused
ratio; docs/transformers.md shows the ratio. flash-attn applies the cap inside its kernel (CUDA).
"""

from __future__ import annotations

import argparse
import time

import torch

from benchmarks import harness as H
from hf_ring.ops.ring import ring_attention

SHAPE = "one process, causal fwd+bwd, B=1, Hq=8, Hkv=2, D=64, fp32"


def step_seconds(n: int, backend: str, softcap: float | None, repeat: int) -> list[float]:
    """Seconds of ``repeat`` forward + backward runs after one warm-up."""
    g = torch.Generator().manual_seed(0)
    q, dout = (torch.randn(1, n, 8, 64, generator=g) for _ in range(2))
    k, v = (torch.randn(1, n, 2, 64, generator=g) for _ in range(2))
    times = []
    for i in range(repeat + 1):
        xs = [t.clone().requires_grad_() for t in (q, k, v)]
        t0 = time.perf_counter()
        ring_attention(*xs, softcap=softcap, backend=backend).backward(dout)
        if i:  # the first run warms up
            times.append(time.perf_counter() - t0)
    return times


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--N", type=int, nargs="+", default=[1024, 2048, 4096])
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--out", help="write the long table here")
    args = p.parse_args(argv)
    table = H.Table({"machine": H.machine_info(), "versions": H.versions()}, lambda _: torch.get_num_threads())
    note = f"{SHAPE}; {args.repeat} runs after one warm-up"
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; fwd+bwd seconds (median of {args.repeat})")
    for n in args.N:
        times = {name: step_seconds(n, backend, cap, args.repeat) for name, backend, cap in (
            ("fused", "torch", None), ("reference", "reference", None), ("reference_softcap50", "auto", 50.0))}
        for name, ts in times.items():
            table.add("softcap", name, "time", 1, n, H.stats(ts), "s", note=note)
        ratio = [c / f for c, f in zip(times["reference_softcap50"], times["fused"])]
        table.add("softcap", "reference_softcap50", "ratio_to_fused", 1, n, H.stats(ratio), "x", note=note)
        print(f"N={n}: " + ", ".join(f"{k} {H.stats(v)[0]:.3f} s" for k, v in times.items())
              + f"; capped / fused {H.stats(ratio)[0]:.1f}x", flush=True)  # fmt: skip
    if args.out:
        H.write_rows(args.out, table.rows)


if __name__ == "__main__":
    main()
