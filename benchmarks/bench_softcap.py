"""What logit soft-capping costs on CPU: torch's fused op has no cap, so a capped layer runs the reference
kernel (float32 einsum over query tiles, the cap's tanh and its derivative on every score).

    python -m benchmarks.bench_softcap                 # N in 1024 2048 4096, ~1 min on 2 cores
    python -m benchmarks.bench_softcap --N 512 --repeat 2   # smoke test
    python -m benchmarks.bench_softcap --N 1024 2048 --out benchmarks/results/softcap.jsonl   # docs/transformers.md

One process, causal attention forward + backward through ``ring_attention``: B=1, Hq=8, Hkv=2, D=64,
fp32. Rows: the fused CPU op without a cap, the reference kernel without a cap, and with ``softcap=50``;
the median of ``--repeat`` runs after one warm-up. ``--out``: one JSON row per N (seconds of each, the
capped / fused ratio, the command, the machine, the versions) for docs/transformers.md. flash-attn
applies the cap inside its kernel (CUDA).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from hf_ring.ops.ring import ring_attention


def step_seconds(n: int, backend: str, softcap: float | None, repeat: int) -> float:
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
    return statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--N", type=int, nargs="+", default=[1024, 2048, 4096])
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--out", help="write one JSON row per N here")
    args = p.parse_args(argv)
    rows = []
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; fwd+bwd seconds (median of {args.repeat})")
    print("| N | fused, no cap | reference, no cap | reference, softcap=50 | capped / fused |")
    print("|---|---|---|---|---|")
    for n in args.N:
        fused = step_seconds(n, "torch", None, args.repeat)
        ref = step_seconds(n, "reference", None, args.repeat)
        cap = step_seconds(n, "auto", 50.0, args.repeat)
        print(f"| {n} | {fused:.3f} | {ref:.3f} | {cap:.3f} | {cap / fused:.1f}x |", flush=True)
        rows.append({"N": n, "fused_s": fused, "reference_s": ref, "softcap_s": cap, "capped_over_fused": cap / fused,
                     "repeat": args.repeat, "threads": torch.get_num_threads()})  # fmt: skip
    if args.out:
        from benchmarks.harness import machine_info, versions

        command = "python -m benchmarks.bench_softcap " + " ".join(sys.argv[1:] if argv is None else argv)
        meta = {"command": command, "machine": machine_info(), "versions": versions()}
        with open(args.out, "w") as f:
            f.writelines(json.dumps({**r, **meta}) + "\n" for r in rows)


if __name__ == "__main__":
    main()
