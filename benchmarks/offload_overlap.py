"""Activation offload on one GPU: step time against checkpointing alone, copies on a side stream or in line.

A stack of ``L`` residual MLP blocks (``x + W2 gelu(W1 x)``, hidden ``H``, inner ``4H``) over ``T`` tokens,
each block checkpointed (non-reentrant), the stack under ``hf_ring.ops.offload.OffloadActivations``:
each block's input (``T x H``) goes to pinned host memory in forward and comes back in backward, the
traffic of a checkpointed decoder with offload. Modes, interleaved within every iteration:

  * ``checkpointing``: no offload (the baseline);
  * ``offload_compute_stream``: ``OffloadActivations(side_stream=False)``, copies in line with the kernels;
  * ``offload_side_stream``: the default, copies on a side stream overlapping the compute.

Rows (``benchmarks.harness.FIELDS``, x = N = T): ``gpu_offload_step`` (time, s, per mode; and
``ratio_to_checkpointing``, paired per iteration), ``gpu_offload_bytes`` (bytes offloaded per step, each
way), ``gpu_offload_check`` (largest relative difference of the side-stream step's loss and gradients
from checkpointing's; 0 expected: the same kernels run, the copies are exact). On CPU nothing is copied
(the tensors are in host memory already): the rows only show that the code path runs.
Used by ``benchmarks.bench_gpu`` (``--offload-tokens``, ``--offload-layers``; ``--no-offload`` skips it).
"""

from __future__ import annotations

import time

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from benchmarks.harness import Table, stats
from hf_ring.ops.offload import OffloadActivations

MODES = ("checkpointing", "offload_compute_stream", "offload_side_stream")
GPU = {"tokens": 32768, "layers": 8, "hidden": 4096, "iters": 5, "warmup": 1}
CPU = {"tokens": 256, "layers": 3, "hidden": 64, "iters": 2, "warmup": 1}


class Blocks(nn.Module):
    """``L`` checkpointed residual MLP blocks over ``[T, H]``."""

    def __init__(self, layers: int, hidden: int) -> None:
        super().__init__()
        inner = 4 * hidden
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(hidden, inner), nn.GELU(), nn.Linear(inner, hidden)) for _ in range(layers)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + checkpoint(block, x, use_reentrant=False)
        return x


def _step(model: Blocks, x: torch.Tensor, cuda: bool) -> tuple[float, list[torch.Tensor]]:
    """Seconds of one forward + backward, and ``[loss, *gradients]``."""
    model.zero_grad(set_to_none=True)
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    loss = model(x).float().square().mean()
    loss.backward()
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    return seconds, [loss.detach(), *(p.grad for p in model.parameters())]


def measure(cfg: dict, device: torch.device, dtype: torch.dtype, deadline: float) -> dict:
    """Per mode the step times of every iteration, the exactness check, the bytes offloaded."""
    cuda = device.type == "cuda"
    torch.manual_seed(0)
    model = Blocks(cfg["layers"], cfg["hidden"]).to(device, dtype)
    x = torch.randn(cfg["tokens"], cfg["hidden"], device=device, dtype=dtype)
    hooks = {
        "offload_compute_stream": lambda: OffloadActivations(model, side_stream=False),
        "offload_side_stream": lambda: OffloadActivations(model),
    }

    def run(mode: str) -> tuple[float, list[torch.Tensor]]:
        off = hooks[mode]() if mode in hooks else None
        try:
            return _step(model, x, cuda)
        finally:
            if off is not None:
                off.remove()

    times: dict[str, list[float]] = {m: [] for m in MODES}
    for _ in range(cfg["warmup"]):
        for mode in MODES:
            run(mode)
    _, ref = run("checkpointing")
    ref = [t.clone() for t in ref]
    _, got = run("offload_side_stream")
    diff = max(float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)) for a, b in zip(got, ref))
    for i in range(cfg["iters"]):
        if i > 0 and time.monotonic() > deadline:
            break
        for mode in MODES:
            times[mode].append(run(mode)[0])
    block_input = cfg["tokens"] * cfg["hidden"] * x.element_size()
    return {"times": times, "check": diff, "bytes": cfg["layers"] * block_input, "cuda": cuda}


def rows(res: dict, cfg: dict, meta: dict, dtype_name: str) -> list[dict]:
    """The long-table rows of ``measure``'s result."""
    tab = Table(meta, lambda p: torch.get_num_threads())
    n, times = cfg["tokens"], res["times"]
    shape = f"L={cfg['layers']} checkpointed MLP blocks, H={cfg['hidden']}, T={n}, {dtype_name}"
    note = shape + ("" if res["cuda"] else "; CPU: nothing is copied, the rows only show the code path runs")
    base = times["checkpointing"]
    for mode in MODES:
        tab.add("gpu_offload_step", mode, "time", 1, n, stats(times[mode]), "s", note=f"iters={len(base)}; {note}")
        ratios = [t / b for t, b in zip(times[mode], base)]
        tab.add("gpu_offload_step", mode, "ratio_to_checkpointing", 1, n, stats(ratios), "ratio", note=note)
    one = (float(res["bytes"]),) * 3
    tab.add("gpu_offload_bytes", "offload", "bytes_per_direction", 1, n, one, "bytes", note=note)
    check = (res["check"],) * 3
    tab.add("gpu_offload_check", "offload_side_stream", "max_rel_diff_vs_checkpointing", 1, n, check, "rel_err",
            note="loss and every gradient; 0 expected (identical kernels, exact copies); " + note)  # fmt: skip
    return tab.rows


def summary(res: dict) -> str:
    """One console line: median step-time ratios to checkpointing and the check."""
    base = res["times"]["checkpointing"]
    parts = []
    for mode in MODES[1:]:
        med = stats([t / b for t, b in zip(res["times"][mode], base)])[0]
        parts.append(f"{mode} {med:.2f}x")
    return f"offload step time vs checkpointing: {', '.join(parts)}; side-stream step vs it: {res['check']:.1e}"
