"""Packed sliding windows with sinks and soft-capping through the real flash-attn (2, 3 or 4), against float64.

    CHECK_DEVICE=cuda python scripts/check_flash_windows.py   # scripts/gpu_check.sh; skips without flash-attn
    CHECK_DEVICE=cpu python scripts/check_flash_windows.py    # the same glue through the flash-attn stand-in
    CHECK_BACKEND=flash_attn_3 python scripts/check_flash_windows.py   # flash-attn 3 (flash_attn_4: 4)

Every rank of P = 2-4 is emulated in this process: on the border route it gets its halo rows from the
whole sequence (what the exchange would fetch) and runs its plan's calls -- each run after its halo,
one band (W - 1, 0), flash-attn's varlen functions -- so out, dq, dk and dv (gathered through the
rows each rank holds) and the sinks' gradient are compared; on the ring route a ring that sends
nothing is filled with the K/V blocks the real ring would deliver, so out, dq and the sinks' gradient
are; each with flash-attn's varlen functions and with one dense call per block. Layouts: packed rows
whose plans held blocks flash-attn masks differently (before ``schedule.flash_exact`` and the border
route's halo layout), and on CUDA a 4K-token row of random documents. Pass: relative error within
2e-2 in bf16 (1e-5 in float32 on CPU), no NaN; exit status 1 otherwise.
"""

from __future__ import annotations

import functools
import math
import os
import sys

import torch

from hf_ring.ops.ring import _kv_message, block_attention, ring_attention
from hf_ring.ops.windows import mask_plan
from testkit.comm import NoCommRing
from testkit.flash_blocks import packed_layout
from testkit.oracle import attention

CASES = [  # (docs, window, P): tests/test_flash_windows.py's RING_CASES and BORDER_CASES
    ([6, 11, 227], 6, 2), ([19, 12, 10, 1, 9, 207], 8, 3), ([87, 4, 9, 18, 6, 10, 218], 6, 4),
    ([5, 41, 3, 23], 16, 2), ([125, 51, 5, 1, 11, 3, 1, 21, 6, 8, 64], 6, 4),
]  # fmt: skip
HQ, HKV, D = 8, 2, 64


def rel(x, ref) -> float:
    return float((x.detach().double().cpu() - ref).norm() / ref.norm().clamp_min(1e-30))


def halo_positions(plan) -> list[int]:
    """The global positions the exchange fetches for this rank's runs, in order (one batch row)."""
    return [g for run in plan.halo.runs for g in range(max(run.doc_start, run.start - plan.halo.width), run.start)]


@functools.lru_cache(maxsize=2)
def expected(docs: tuple[int, ...], window: int, softcap: float, dt: torch.dtype) -> dict[str, torch.Tensor]:
    """The oracle's out and gradients for ``check``'s inputs (once per case, for both kernel forms)."""
    q, k, v, dout, sinks = inputs(sum(docs), window, dt)
    leaves = [t.double().requires_grad_() for t in (q, k, v, sinks)]
    starts = [[sum(docs[:i]) for i in range(len(docs))]]
    ref = attention(*leaves[:3], True, starts=starts, window=window, softcap=softcap, sinks=leaves[3])
    ref.backward(dout.double())
    return {"out": ref.detach(), **dict(zip(("dq", "dk", "dv", "dsinks"), (t.grad for t in leaves)))}


def inputs(n: int, window: int, dt: torch.dtype) -> list[torch.Tensor]:
    """q, k, v, dout ``[1, N, H, D]`` and per-head sinks, rounded to ``dt``."""
    g = torch.Generator().manual_seed(window)
    q, dout = (torch.randn(1, n, HQ, D, generator=g) for _ in range(2))
    k, v = (torch.randn(1, n, HKV, D, generator=g) for _ in range(2))
    return [t.to(dt) for t in (q, k, v, dout, torch.randn(HQ, generator=g))]


def check(docs, window, size, kernel, dev, dt, softcap) -> dict[str, float]:
    layout = packed_layout([docs], size)
    n = layout.n
    q, k, v, dout, sinks = inputs(n, window, dt)
    want = expected(tuple(docs), window, softcap, dt)
    errs: dict[str, float] = {}
    index = layout.index(1)[:, 0]  # [P, local]: global position of each local row (n: padding)

    def rows(t, idx):  # rows of [1, N, ...] at global positions idx (n: a zero row), on the device
        full = torch.cat((t, t.new_zeros(1, 1, *t.shape[2:])), 1)
        return full[:, idx].to(dev)

    # border route: halos from the whole sequence, every gradient through the gathers
    g_in = [t.to(dev).requires_grad_() for t in (q, k, v, sinks)]
    total = 0
    outs = torch.zeros(1, n + 1, HQ, D, dtype=torch.float64)
    for r in range(size):
        plan = mask_plan(layout, 1, r, window=window, route="border")
        kv = torch.cat((g_in[1], g_in[2]), -1)
        local, fetched = rows(kv, index[r])[0], rows(kv, torch.tensor(halo_positions(plan), dtype=torch.long))[0]
        kvr = plan.kv_rows(local, fetched)[None]
        out = block_attention(rows(g_in[0], index[r]), kvr[..., :D], kvr[..., D:], plan.blocks, softmax_scale=D**-0.5,
                              backend=kernel, softcap=softcap, sinks=g_in[3])  # fmt: skip
        total = total + (out.double() * rows(dout, index[r]).double()).sum()
        outs[0, index[r]] = out[0].detach().double().cpu()
    total.backward()
    errs["border out"] = rel(outs[:, :n], want["out"])
    for name, t in zip(("dq", "dk", "dv", "dsinks"), g_in):
        errs[f"border {name}"] = rel(t.grad, want[name])
    # ring route: the K/V blocks the ring would deliver; out, dq and the sinks' gradient
    outs.zero_()
    dq = torch.zeros_like(outs)
    dsinks = torch.zeros(HQ, dtype=torch.float64)
    messages = [_kv_message(rows(k, index[r]), rows(v, index[r]), kernel.heads_major) for r in range(size)]
    for r in range(size):
        plan = mask_plan(layout, 1, r, window=window, route="ring")
        steps, hops = plan.schedule, [0]

        def fill(tag, send, recv, r=r, steps=steps, hops=hops):
            if tag == 0:  # forward, then backward: len(steps) - 1 K/V hops each
                hop = hops[0] % max(1, len(steps) - 1) + 1
                hops[0] += 1
                recv.copy_(messages[(r - hop) % size])

        ql, sk = rows(q, index[r]).requires_grad_(), sinks.to(dev).requires_grad_()
        out = ring_attention(ql, rows(k, index[r]), rows(v, index[r]), ring=NoCommRing(size, r, fill), schedule=steps,
                             softmax_scale=D**-0.5, backend=kernel, softcap=softcap, sinks=sk)  # fmt: skip
        got_dq, got_ds = torch.autograd.grad(out, (ql, sk), rows(dout, index[r]))
        outs[0, index[r]], dq[0, index[r]] = out[0].detach().double().cpu(), got_dq[0].double().cpu()
        dsinks += got_ds.double().cpu()
    errs["ring out"], errs["ring dq"] = rel(outs[:, :n], want["out"]), rel(dq[:, :n], want["dq"])
    errs["ring dsinks"] = rel(dsinks, want["dsinks"])
    return errs


def main() -> int:
    dev = torch.device(os.environ.get("CHECK_DEVICE", "cuda"))
    backend = os.environ.get("CHECK_BACKEND", "flash_attn")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            print("no CUDA device")
            return 1
        from hf_ring.ops.kernels import available_backends, get_kernel

        if backend not in available_backends(dev):
            print(f"skipped: {backend} is not installed or does not run on this GPU ({available_backends(dev)})")
            return 0
        kernel, dt, tol = get_kernel(backend, dev, torch.bfloat16), torch.bfloat16, 2e-2
        print(backend, getattr(kernel, "version", ""), "| varlen:", kernel.varlen)
        g = torch.Generator().manual_seed(0)
        ls = []
        while sum(ls) < 4096:
            ls.append(max(1, int(torch.empty(1).log_normal_(math.log(300), 1.0, generator=g))))
        ls[-1] -= sum(ls) - 4096
        cases = CASES + [(ls, 256, 2), (ls, 512, 4)]
    else:
        from testkit.cuda_standins import make_kernel

        fakes = {"flash_attn": "flash_attn:2.8-custom-op", "flash_attn_3": "flash_attn_3:custom-op"}
        fake = fakes.get(backend, backend)
        kernel, dt, tol, cases = make_kernel(fake), torch.float32, 1e-5, CASES
    bad = 0
    for docs, window, size in cases:
        for softcap, varlen in ((0.0, True), (2.0, True), (2.0, False)):
            kernel.varlen = varlen  # False: one dense call per block, as for a step with one block
            errs = check(docs, window, size, kernel, dev, dt, softcap)
            fail = {k: e for k, e in errs.items() if not e <= tol}  # NaN fails
            bad += bool(fail)
            what = f"P={size} W={window} N={sum(docs)} softcap={softcap} sinks {'varlen' if varlen else 'dense'}"
            print(f"{'FAIL' if fail else 'ok  '} {what}: " + ", ".join(f"{k} {e:.1e}" for k, e in errs.items()))
    print(f"{bad} failed" if bad else "all passed")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
