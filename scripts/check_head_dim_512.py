"""A head_dim 512 attention layer (Gemma 4's full-attention layers) in bf16 with backend "auto", against float64.

    CHECK_DEVICE=cuda python scripts/check_head_dim_512.py   # scripts/gpu_check.sh
    CHECK_DEVICE=cpu python scripts/check_head_dim_512.py    # float32 on torch's CPU op

"auto" must pick a kernel that takes head_dim 512 on this GPU (flash kernels stop at 256: torch's
memory-efficient op); ``hf_ring.ring_attention`` in one process (causal, GQA 8 over 2, N = 1024) gives
out, dq, dk, dv within 2e-2 of float64 (1e-5 in float32 on CPU), and emulated zigzag ranks (P = 2, 4,
the right K/V blocks delivered) give out and dq within the same bound. Exit status 1 otherwise.
"""

from __future__ import annotations

import os
import sys

import torch

import hf_ring
from benchmarks.gpu_timing import emulation_error
from hf_ring.ops.kernels import get_kernel
from testkit.oracle import attention, rel_err


def main() -> int:
    dev = torch.device(os.environ.get("CHECK_DEVICE", "cuda"))
    if dev.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device")
        return 1
    dt, tol = (torch.bfloat16, 2e-2) if dev.type == "cuda" else (torch.float32, 1e-5)
    kernel = get_kernel("auto", dev, dt, head_dim=512)
    print(f"auto picks {kernel.name!r} for head_dim 512 in {dt} on {dev}")
    ok = dev.type != "cuda" or kernel.name == "torch_efficient"
    g = torch.Generator().manual_seed(0)
    q, do = (torch.randn(1, 1024, 8, 512, generator=g).to(dt) for _ in range(2))
    k, v = (torch.randn(1, 1024, 2, 512, generator=g).to(dt) for _ in range(2))
    xs = [t.to(dev).requires_grad_() for t in (q, k, v)]
    out = hf_ring.ring_attention(*xs)  # one process: one kernel call, "auto"
    grads = torch.autograd.grad(out, xs, do.to(dev))
    ref_in = [t.double().requires_grad_() for t in (q, k, v)]
    ref = attention(*ref_in, True)
    ref_grads = torch.autograd.grad(ref, ref_in, do.double())
    errs = {"out": rel_err(out.cpu(), ref)}
    errs.update({name: rel_err(g.cpu(), r) for name, g, r in zip(("dq", "dk", "dv"), grads, ref_grads)})
    for p in (2, 4):
        for name, e in emulation_error(q.to(dev), k.to(dev), v.to(dev), do.to(dev), p, backend=kernel).items():
            errs[f"P={p} {name}"] = e
    bad = {name: e for name, e in errs.items() if not e <= tol}  # NaN fails
    print(("FAIL " if bad or not ok else "ok   ") + ", ".join(f"{name} {e:.1e}" for name, e in errs.items()))
    return 1 if bad or not ok else 0


if __name__ == "__main__":
    sys.exit(main())
