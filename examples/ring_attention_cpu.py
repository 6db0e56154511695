"""Ring attention on several CPU processes against single-process attention.

    python examples/ring_attention_cpu.py --procs 4 --seq 8192

Spawns ``--procs`` gloo processes; each holds a zigzag shard of one causal, grouped-query attention
problem. Prints the relative error of the output and of dQ/dK/dV against float64 attention over the
whole sequence, and the forward+backward time against single-process SDPA given the same total
number of CPU threads.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

import hf_ring


def sdpa(q, k, v):  # [B, N, H, D] layout, as the ring
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True
    )
    return out.transpose(1, 2)


def problem(args, dtype):
    g = torch.Generator().manual_seed(0)
    shapes = [
        (1, args.seq, args.heads, args.dim),
        (1, args.seq, args.kv_heads, args.dim),
        (1, args.seq, args.kv_heads, args.dim),
    ]
    q, k, v = (torch.randn(s, generator=g, dtype=torch.float64).to(dtype) for s in shapes)
    dout = torch.randn(shapes[0], generator=g, dtype=torch.float64).to(dtype)
    return q, k, v, dout


def rel_err(x, ref) -> float:
    x, ref = torch.as_tensor(x).double(), ref.double()
    return float((x - ref).norm() / ref.norm())


def fwd_bwd(fn, q, k, v, dout):
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    out = fn(q, k, v)
    return [out.detach(), *torch.autograd.grad(out, (q, k, v), dout)]


def timed(fn, iters):
    times = []
    for _ in range(iters + 1):  # the first is a warm-up
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times[1:])


def worker(rank, args, init_file, results):
    torch.set_num_threads(max(1, args.threads // args.procs))
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=args.procs)
    q, k, v, dout = problem(args, torch.float32)
    local = [hf_ring.shard(x) for x in (q, k, v, dout)]
    got = fwd_bwd(hf_ring.ring_attention, *local)
    dist.barrier()
    t = timed(lambda: fwd_bwd(hf_ring.ring_attention, *local), args.iters)
    times = [None] * args.procs
    dist.all_gather_object(times, t)
    full = [hf_ring.unshard(x) for x in got]
    if rank == 0:
        results.put((max(times), [x.numpy() for x in full]))
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--procs", type=int, default=4)
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument(
        "--threads", type=int, default=os.cpu_count() or 1, help="CPU threads in total, shared by the processes"
    )
    p.add_argument("--iters", type=int, default=3)
    args = p.parse_args()

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(
            worker, args=(args, os.path.join(tmp, "rdzv"), results), nprocs=args.procs, join=False, start_method="spawn"
        )
        t_ring, ring = results.get()
    torch.set_num_threads(args.threads)
    q, k, v, dout = problem(args, torch.float64)
    oracle = fwd_bwd(sdpa, q, k, v, dout)
    q32, k32, v32, d32 = (x.float() for x in (q, k, v, dout))
    single = fwd_bwd(sdpa, q32, k32, v32, d32)
    t_sdpa = timed(lambda: fwd_bwd(sdpa, q32, k32, v32, d32), args.iters)

    print(
        f"causal attention, N={args.seq}, Hq={args.heads}, Hkv={args.kv_heads}, D={args.dim}, fp32, "
        f"{args.procs} ring processes vs 1 process, {args.threads} CPU threads in total"
    )
    print(f"{'':6} {'ring rel. error':>16} {'single-process SDPA':>20}")
    for name, r, s, o in zip(("out", "dq", "dk", "dv"), ring, single, oracle):
        print(f"{name:6} {rel_err(r, o):16.2e} {rel_err(s, o):20.2e}")
    print(
        f"fwd+bwd: ring {t_ring * 1e3:.0f} ms (slowest rank), single-process SDPA {t_sdpa * 1e3:.0f} ms, "
        f"ratio t_sdpa / t_ring = {t_sdpa / t_ring:.2f}"
    )


if __name__ == "__main__":
    main()
