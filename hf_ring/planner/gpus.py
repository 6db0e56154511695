"""GPU kinds the planner prices a step on: peak fp16/bf16 tensor-core FLOP/s, HBM and NVLink bandwidth, memory
and compute capability (the vendors' data-sheet figures; SXM modules unless named otherwise). The benchmarks take
their MFU against the same peaks. Imports neither torch nor transformers.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["GPU_KINDS", "GPUKind", "gpu_kind"]


@dataclass(frozen=True)
class GPUKind:
    """A GPU model: dense fp16/bf16 tensor-core peak (TFLOP/s, no sparsity), HBM bandwidth (GB/s), NVLink
    bandwidth per direction (GB/s), memory (GiB) and compute capability."""

    name: str
    peak_tflops: float
    hbm_GBps: float
    nvlink_GBps: float
    memory_gib: float
    capability: tuple[int, int]


GPU_KINDS = {
    "A100": GPUKind("A100 SXM 80GB", 312.0, 2039.0, 300.0, 80.0, (8, 0)),
    "A100-PCIe": GPUKind("A100 PCIe 80GB", 312.0, 1935.0, 0.0, 80.0, (8, 0)),
    "A10": GPUKind("A10", 125.0, 600.0, 0.0, 24.0, (8, 6)),
    "L40S": GPUKind("L40S", 362.0, 864.0, 0.0, 48.0, (8, 9)),
    "H100": GPUKind("H100 SXM", 989.0, 3350.0, 450.0, 80.0, (9, 0)),
    "H100-PCIe": GPUKind("H100 PCIe", 756.0, 2000.0, 300.0, 80.0, (9, 0)),
    "H200": GPUKind("H200 SXM", 989.0, 4800.0, 450.0, 141.0, (9, 0)),
    "GH200": GPUKind("GH200", 989.0, 4000.0, 450.0, 96.0, (9, 0)),
    "B200": GPUKind("B200", 2250.0, 8000.0, 900.0, 180.0, (10, 0)),
    "GB200": GPUKind("GB200", 2500.0, 8000.0, 900.0, 186.0, (10, 0)),
}


def gpu_kind(name: str) -> GPUKind:
    """The ``GPU_KINDS`` entry for ``name`` (case and spaces ignored; a benchmark's device name such as
    ``"NVIDIA H100 80GB HBM3"`` finds ``"H100"``); ``ValueError`` naming the kinds otherwise."""
    key = name.strip().upper().replace(" ", "-")
    for k in GPU_KINDS:
        if key == k.upper():
            return GPU_KINDS[k]
    found = [k for k in GPU_KINDS if k.upper() in key.split("-") or k.upper() in key]
    if found:
        return GPU_KINDS[max(found, key=len)]
    raise ValueError(f"unknown GPU kind {name!r}; known: {', '.join(GPU_KINDS)}")
