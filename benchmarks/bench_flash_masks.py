"""Band blocks that flash-attn would mask differently from the band, counted from the plans alone.

    python -m benchmarks.bench_flash_masks            # ~3 min, no ranks

For packed 128K-token rows (``bench_packed``'s document mixes, 4 draws each), sliding windows of
128, 1024 and 4096 tokens and P = 2, 4, 8, it plans the layer for every ring position
(``mask_plan``, route "auto") and checks every kernel call against the mask flash-attn 2.6.3-2.8.3
applies to it (``testkit.flash_rules``: the window clamps of ``mha_fwd``/``mha_bwd``, ``set_params_fprop``,
``mask.h``). Prints, per (W, P): the share of batches with at least one such call, the calls and their
query rows that lose or gain keys. ``--small`` runs ``testkit.flash_blocks.survey`` instead (the
random small layouts of the test, Ulysses and both routes).

    python -m benchmarks.bench_flash_masks --calls    # ~2 min

counts the kernel calls per rank per layer of the same windowed layers (and of W = 32K, the ring
route): block by block (a kernel without varlen functions) and as the ring groups a step's blocks for
flash-attn's varlen functions.
"""

from __future__ import annotations

import argparse

import numpy as np

from benchmarks.bench_packed import MIXES, lengths
from hf_ring.ops.windows import mask_plan
from testkit.flash_blocks import block_mismatch, packed_layout, plan_blocks, survey

N = 128 * 1024


def calls_per_rank(plan, local: int, batch: int = 1) -> tuple[int, int]:
    """Kernel calls of one rank for one layer under ``plan``: block by block, and with a varlen kernel
    (``ring._step_calls``: a step's blocks, grouped as the ring groups them)."""
    import torch

    from hf_ring.ops.varlen import varlen_calls

    steps = [plan.blocks] if plan.route == "border" else list(plan.schedule or ())
    n = local * batch + (plan.halo.offsets[-1] if plan.halo is not None else 0) if plan.route == "border" else local
    dense = sum(len(b) for b in steps)
    rows = 1 if plan.route == "border" else batch
    varlen = sum(len(b) if len(b) < 2 else len(varlen_calls(tuple(b), n, rows, torch.device("cpu"))) for b in steps)
    return dense, varlen


def call_counts(draws: int) -> None:
    rng = np.random.default_rng(0)
    rows = [(mix, lengths(mix, N, rng)) for mix in MIXES for _ in range(draws)]
    print("| W | P | route | calls per rank per layer, block by block | with flash-attn's varlen functions |")
    print("|---|---|---|---|---|")
    for w in (128, 1024, 4096, 32768):
        for p in (4, 8):
            dense, varlen, routes = [], [], set()
            for _, ls in rows:
                layout = packed_layout([ls], p)
                for pos in range(p):
                    plan = mask_plan(layout, 1, pos, window=w)
                    routes.add(plan.route)
                    d, v = calls_per_rank(plan, layout.local)
                    dense.append(d)
                    varlen.append(v)
            print(
                f"| {w} | {p} | {'/'.join(sorted(routes))} | {np.median(dense):.0f} ({min(dense)}-{max(dense)}) | "
                f"{np.median(varlen):.0f} ({min(varlen)}-{max(varlen)}) |"
            )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--draws", type=int, default=4)
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--calls", action="store_true")
    args = ap.parse_args()
    if args.calls:
        call_counts(args.draws)
        return
    if args.small:
        s = survey(0, 60)
        print({k: v for k, v in vars(s).items() if k != "examples"})
        return
    rng = np.random.default_rng(0)
    rows = [(mix, lengths(mix, N, rng)) for mix in MIXES for _ in range(args.draws)]
    print("| W | P | batches with a wrong call | wrong calls | their rows | calls |")
    print("|---|---|---|---|---|---|")
    for w in (128, 1024, 4096):
        for p in (2, 4, 8):
            bad_batches = bad_calls = bad_rows = calls = 0
            for _, ls in rows:
                layout = packed_layout([ls], p)
                wrong = 0
                for pos in range(p):
                    plan = mask_plan(layout, 1, pos, window=w)
                    n_local = layout.local + (plan.halo.offsets[-1] if plan.halo is not None else 0)
                    for _, b in plan_blocks(plan):
                        calls += 1
                        rows_bad = max(block_mismatch(b, n_local, "fwd"), block_mismatch(b, n_local, "bwd"))
                        wrong += rows_bad > 0
                        bad_rows += rows_bad
                bad_calls += wrong
                bad_batches += wrong > 0
            print(f"| {w} | {p} | {bad_batches}/{len(rows)} | {bad_calls} | {bad_rows} | {calls} |")


if __name__ == "__main__":
    main()
