"""Hybrid training steps at CP = 2 through the installed CUDA kernels of fla, causal-conv1d and
mamba-ssm, against transformers' torch route (a step of ``scripts/gpu_check.sh``).

    python scripts/gpu_mixers.py [--max-seconds 180]   # a CUDA machine: each family whose kernels import
    CHECK_DEVICE=cpu python scripts/gpu_mixers.py      # the CPU, testkit's stand-ins as the kernels

First the chunked loss's head-gradient accumulation (``head_gradient``: does torch's float32-output
GEMM take it, and is it as close to float64 as the blocked product). Families: Jamba (mamba-ssm's
``selective_scan_fn``), Qwen3.5 (fla's ``chunk_gated_delta_rule``),
Nemotron-H (mamba-ssm's ``mamba_chunk_scan_combined``), each with causal-conv1d's
``causal_conv1d_fn``; a family none of whose packages imports is skipped. Two gloo ranks share the
one GPU (NCCL refuses two ranks on one device): the collectives hf_ring makes on CUDA tensors go
through host copies. Each rank runs the tiny model in bf16 through the kernels at CP = 2; rank 0
also runs it in one process through transformers' torch fallbacks, in bf16 and in float32. The
CP = 2 loss and every parameter gradient must be within twice the bf16 torch route's error against
float32, plus 1e-2 (relative). Prints one line per family; exits 1 on any failure.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

FAMILIES = {  # model type -> the packages whose kernels it calls (the first one names the mixer)
    "jamba": ("mamba_ssm", "causal_conv1d"),
    "qwen3_5_text": ("fla", "causal_conv1d"),
    "nemotron_h": ("mamba_ssm", "causal_conv1d"),
}
PROBES = {  # what transformers imports from each package
    "mamba_ssm": ("mamba_ssm.ops.selective_scan_interface", "mamba_ssm.ops.triton.ssd_combined"),
    "causal_conv1d": ("causal_conv1d",),
    "fla": ("fla.ops.gated_delta_rule",),
}


def importable(package: str) -> bool:
    try:
        for module in PROBES[package]:
            importlib.import_module(module)
    except Exception:  # noqa: BLE001 -- a broken install counts as absent
        return False
    return True


@contextmanager
def host_collectives(copy_cpu: bool = False) -> Iterator[None]:
    """Within: hf_ring's collectives on device tensors (``all_reduce``, ``all_gather``,
    ``all_to_all_single``, ``batch_isend_irecv``) run on host copies over the gloo group, blocking.
    ``copy_cpu``: copy CPU tensors too (to try the copies out on the CPU)."""
    import torch
    import torch.distributed as dist

    real = {n: getattr(dist, n) for n in ("all_reduce", "all_gather", "all_to_all_single", "batch_isend_irecv")}

    def moved(t: torch.Tensor) -> bool:
        return t.device.type != "cpu" or copy_cpu

    def host(t: torch.Tensor) -> torch.Tensor:
        return t.detach().to("cpu", copy=True).contiguous()

    class Done:
        def wait(self) -> bool:
            return True

    def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        if not moved(tensor):
            return real["all_reduce"](tensor, op=op, group=group, async_op=async_op)
        h = host(tensor)
        real["all_reduce"](h, op=op, group=group)
        tensor.copy_(h)
        return Done() if async_op else None

    def all_gather(tensor_list, tensor, group=None, async_op=False):
        if not moved(tensor):
            return real["all_gather"](tensor_list, tensor, group=group, async_op=async_op)
        hs = [torch.empty(t.shape, dtype=t.dtype) for t in tensor_list]
        real["all_gather"](hs, host(tensor), group=group)
        for t, h in zip(tensor_list, hs):
            t.copy_(h)
        return Done() if async_op else None

    def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False):
        if not moved(output):
            return real["all_to_all_single"](output, input, output_split_sizes, input_split_sizes, group=group,
                                             async_op=async_op)  # fmt: skip
        h = torch.empty(output.shape, dtype=output.dtype)
        real["all_to_all_single"](h, host(input), output_split_sizes, input_split_sizes, group=group)
        output.copy_(h)
        return Done() if async_op else None

    def batch_isend_irecv(ops):
        if not any(moved(op.tensor) for op in ops):
            return real["batch_isend_irecv"](ops)
        hosts = [host(op.tensor) if op.op is dist.isend else torch.empty(op.tensor.shape, dtype=op.tensor.dtype)
                 for op in ops]  # fmt: skip
        works = real["batch_isend_irecv"](
            [dist.P2POp(op.op, h, op.peer, op.group, op.tag) for op, h in zip(ops, hosts)]
        )
        for w in works:
            w.wait()
        for op, h in zip(ops, hosts):
            if op.op is not dist.isend:
                op.tensor.copy_(h)
        return [Done() for _ in ops]

    patched = {"all_reduce": all_reduce, "all_gather": all_gather, "all_to_all_single": all_to_all_single,
               "batch_isend_irecv": batch_isend_irecv}  # fmt: skip
    for name, fn in patched.items():
        setattr(dist, name, fn)
    try:
        yield
    finally:
        for name, fn in real.items():
            setattr(dist, name, fn)


def rank_step(rank: int, world: int, model_type: str, device: str) -> dict:
    """One rank: the CP = 2 step through the kernels; on rank 0 also the torch route (bf16, float32)."""
    import torch
    import torch.distributed as dist

    import hf_ring
    from testkit.families import causal_lm_class, tiny_config
    from testkit.mixer_standins import routed_kernels
    from testkit.models import tiny_batch

    if device == "cuda":
        torch.cuda.set_device(0)
    cls = causal_lm_class(model_type)
    module = sys.modules[cls.__module__]
    config = tiny_config(model_type)

    def build(attn: str, dtype: torch.dtype) -> torch.nn.Module:
        torch.manual_seed(0)
        model = cls._from_config(config, attn_implementation=attn, experts_implementation="eager")
        return model.to(device=device, dtype=dtype).train()

    batch = {k: v.to(device) for k, v in tiny_batch(2, 45, vocab=config.get_text_config().vocab_size).items()}
    kernels = routed_kernels(module, "standins") if device == "cpu" else _as_installed()
    with host_collectives(copy_cpu=device == "cpu"), kernels:
        ring = build("ring", torch.bfloat16)
        out = ring(**hf_ring.shard_batch(batch))
        out.loss.backward()
        loss = float(out.loss)
        grads = {}
        for name, p in ring.named_parameters():
            if p.grad is not None:
                g = p.grad.float().clone()
                dist.all_reduce(g)
                grads[name] = g / world
    if rank != 0:
        return {}
    refs = {}
    with routed_kernels(module, "torch"):
        for dtype in (torch.bfloat16, torch.float32):
            ref = build("sdpa", dtype)
            ref.load_state_dict(ring.state_dict())
            ref_out = ref(**batch, use_cache=False)
            ref_out.loss.backward()
            refs[dtype] = (
                float(ref_out.loss),
                {n: p.grad.float() for n, p in ref.named_parameters() if p.grad is not None},
            )
    (l16, g16), (l32, g32) = refs[torch.bfloat16], refs[torch.float32]

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a - b).norm() / max(float(b.norm()), 1e-3))

    worst = {"loss": (abs(loss - l32) / abs(l32), abs(l16 - l32) / abs(l32))}
    for name, want in g32.items():
        if name in grads and name in g16:
            worst[name] = (rel(grads[name], want), rel(g16[name], want))
    bad = {k: v for k, v in worst.items() if not v[0] <= 2 * v[1] + 1e-2}
    top = max((k for k in worst if k != "loss"), key=lambda k: worst[k][0])
    return {"bad": bad, "loss": worst["loss"], "worst_grad": (top, *worst[top]), "params": len(worst) - 1}


def head_gradient(device: str) -> bool:
    """The chunked loss's head-gradient accumulation (``ops.cross_entropy._add_product``) on ``device``:
    whether torch's float32-output GEMM takes it, and its error against float64 next to the blocked
    product's (must be within 2x + 1e-6)."""
    import torch

    from hf_ring.ops.cross_entropy import _add_product

    g = torch.Generator().manual_seed(0)
    a = torch.randn(256, 4096, generator=g).to(device, torch.bfloat16).t()  # [V, T], as dlogits.t()
    b = torch.randn(256, 512, generator=g).to(device, torch.bfloat16)
    want = a.double() @ b.double()
    fused = torch.zeros(4096, 512, device=device)
    _add_product(fused, a, b)
    blocked = torch.zeros(4096, 512)  # the blocked 16-bit product, on the host
    _add_product(blocked, a.cpu(), b.cpu(), budget=2**20)
    try:
        torch.addmm(torch.zeros(2, 2, device=device), a[:2, :4], b[:4, :2], out_dtype=torch.float32)
        native = "yes"
    except Exception as e:  # noqa: BLE001
        native = f"no ({type(e).__name__})"
    err = [float((x.double().cpu() - want.cpu()).abs().max() / want.abs().max()) for x in (fused, blocked)]
    ok = err[0] <= 2 * err[1] + 1e-6
    print(
        f"{'ok  ' if ok else 'FAIL'} chunked-loss head gradient on {device}: float32-output GEMM {native}; "
        f"error {err[0]:.1e} (blocked bf16 product {err[1]:.1e})",
        flush=True,
    )
    return ok


@contextmanager
def _as_installed() -> Iterator[None]:
    yield  # transformers bound the installed kernels at import; hf_ring's dispatchers wrap them


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-seconds", type=float, default=180.0)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    from testkit.spawn import spawn_ranks

    device = os.environ.get("CHECK_DEVICE", "cuda")
    if device == "cuda" and not torch.cuda.is_available():
        print("skipped: no CUDA device")
        return 0
    t0, failed = time.monotonic(), not head_gradient(device)
    for model_type, packages in FAMILIES.items():
        have = [p for p in packages if device == "cpu" or importable(p)]
        if not have:
            print(f"skipped {model_type}: {' and '.join(packages)} not importable")
            continue
        left = args.max_seconds - (time.monotonic() - t0)
        if left < 20:
            print(f"skipped {model_type}: time budget spent")
            continue
        try:
            r = spawn_ranks(rank_step, 2, model_type, device, timeout=left)[0]
        except Exception as e:  # noqa: BLE001 -- report and go on
            print(f"FAIL {model_type} (kernels of {', '.join(have)}): {type(e).__name__}: {str(e)[-2000:]}")
            failed = True
            continue
        name, err, base = r["worst_grad"]
        line = (
            f"{model_type} CP=2 bf16 via {', '.join(have)}: loss rel err {r['loss'][0]:.1e} (torch route "
            f"{r['loss'][1]:.1e}); worst gradient {name} {err:.1e} (torch route {base:.1e}) over {r['params']}"
        )
        print(("FAIL " if r["bad"] else "ok   ") + line + (f"; failing: {r['bad']}" if r["bad"] else ""), flush=True)
        failed |= bool(r["bad"])
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
