"""The context-parallel selective scan of Mamba (``ops.mixers.selective``) against a float64 oracle that
runs each document of the unsharded batch alone: outputs and the gradients of u, dt, B, C, the gate
z and of the parameters A, D and delta_bias, P = 1..4, Ulysses pieces, packed documents of 1, 2 and
more tokens crossing chunk and rank boundaries, rows not a multiple of 2P; with the float64
reference scan (1e-10), transformers' own scan (1e-5) and bf16 (within 2x of one process)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from hf_ring.ops.mixers.selective import selective_plan, selective_scan
from testkit.mixers import (
    KINDS,
    assert_within_twice_one_process,
    documents,
    local_rows,
    make_layout,
    mixer_errors,
    selective_scan_reference,
)
from testkit.spawn import run_ranks

CH, N = 6, 4
NAMES = ("du", "ddt", "dB", "dC", "dz")
PARAMS = ("dA", "dD", "ddelta_bias")


def _scan(name: str):
    if name == "reference":
        return selective_scan_reference
    if name == "mamba_ssm":  # the stand-in: float32 inside, the last state's gradient dropped as mamba-ssm drops it
        from testkit.mamba_standins import selective_scan_fn

        return selective_scan_fn
    import importlib

    from hf_ring.transformers.install import original

    return original(importlib.import_module("transformers.models.jamba.modeling_jamba"), "mamba_selective_scan")


def inputs(batch: int, n: int) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor]:
    """Sequence-major ``[B, n, F]`` (cut into rank rows along dim 1; the kernel takes ``[B, F, n]``)."""
    g = torch.Generator().manual_seed(9)
    u = torch.randn(batch, n, CH, generator=g, dtype=torch.float64)
    dt = torch.randn(batch, n, CH, generator=g, dtype=torch.float64)
    b = torch.randn(batch, n, N, generator=g, dtype=torch.float64)
    c = torch.randn(batch, n, N, generator=g, dtype=torch.float64)
    z = torch.randn(batch, n, CH, generator=g, dtype=torch.float64)
    a = -0.2 - torch.rand(CH, N, generator=g, dtype=torch.float64)
    d = torch.randn(CH, generator=g, dtype=torch.float64)
    bias = torch.randn(CH, generator=g, dtype=torch.float64)
    w = torch.randn(batch, n, CH, generator=g, dtype=torch.float64)
    return [u, dt, b, c, z], [a, d, bias], w


def _call(scan, xs, params):
    u, dt, b, c, z = (t.transpose(1, 2) for t in xs)
    a, d, bias = params
    return scan(u, dt, a, b, c, D=d, z=z, delta_bias=bias, delta_softplus=True).transpose(1, 2)


def oracle(xs, params, w, layout, dtype: torch.dtype, scan) -> tuple:
    """Each document alone through ``scan`` in ``dtype``; the output and the gradients of ``sum(out * w)``."""
    leaves = [t.detach().to(dtype).clone().requires_grad_() for t in xs]
    wide = torch.float32 if scan is _scan("mamba_ssm") else dtype  # the kernel takes float32 A, D, delta_bias
    pleaves = [t.detach().to(wide).clone().requires_grad_() for t in params]
    out = torch.zeros_like(w)
    for row in range(w.shape[0]):
        for lo, hi in documents(layout, row):
            out[row, lo:hi] = _call(scan, [t[row : row + 1, lo:hi] for t in leaves], pleaves)[0].double()
    (out * w).sum().backward()
    return out.detach(), [t.grad.double() for t in leaves], [t.grad.double() for t in pleaves]


def selective_errors(kind: str, ulysses: int, scan_name: str, dtype: str) -> dict:
    size, rank = dist.get_world_size(), dist.get_rank()
    layout, batch = make_layout(kind, size, ulysses)
    xs, params, w = inputs(batch, layout.n)
    scan = _scan(scan_name)
    want, grads, pgrads = oracle(xs, params, w, layout, torch.float64, selective_scan_reference)
    dt = getattr(torch, dtype)
    leaves = [local_rows(t, layout, rank).to(dt).requires_grad_() for t in xs]
    pleaves = [t.to(torch.float32 if scan_name == "mamba_ssm" else dt).requires_grad_() for t in params]
    plan = selective_plan(layout, batch, rank)
    u, dts, b, c, z = (t.transpose(1, 2) for t in leaves)
    a, d, bias = pleaves
    out = selective_scan(scan, u, dts, a, b, c, plan, None, D=d, z=z, delta_bias=bias, delta_softplus=True)
    out = out.transpose(1, 2)
    base = None
    if dtype != "float64":  # one process in the same dtype, each document alone: the error to be within 2x of
        base_out, base_grads, base_pgrads = oracle(xs, params, w, layout, dt, scan)
        base = (base_out, base_grads + base_pgrads)
    return mixer_errors(out, want, w, layout, rank, batch, list(zip(NAMES, leaves, grads)),
                        list(zip(PARAMS, pleaves, pgrads)), base)  # fmt: skip


CASES = [(1, 1), (2, 1), (3, 1), (4, 1), (4, 2)]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(("world", "ulysses"), CASES)
def test_selective_scan_matches_each_document_alone(world: int, ulysses: int, kind: str) -> None:
    for r in run_ranks(world, selective_errors, kind, ulysses, "reference", "float64"):
        assert max(r["err"].values()) < 1e-10, r


@pytest.mark.parametrize(("world", "kind"), [(3, "sequence"), (4, "short_ones"), (2, "odd")])
def test_transformers_scan_under_state_passing(world: int, kind: str) -> None:
    """transformers' scan rounds the inputs to float32 inside: relative 1e-5 of each tensor's scale."""
    for r in run_ranks(world, selective_errors, kind, 1, "transformers", "float64"):
        for name, e in r["err"].items():
            assert e <= 1e-5 * max(r["scale"][name], 1.0), (name, r)


@pytest.mark.parametrize("kind", ["sequence", "short_ones", "long_and_short", "odd"])
@pytest.mark.parametrize("world", [2, 3, 4])
def test_kernel_that_drops_its_last_state_gradient(world: int, kind: str) -> None:
    """mamba-ssm's ``selective_scan_fn`` drops the gradient of the last state it returns (its stand-in
    too): every state passed to a later run comes from torch, so every gradient is exact (float32
    inside the kernel: relative 1e-5 of each tensor's scale)."""
    for r in run_ranks(world, selective_errors, kind, 1, "mamba_ssm", "float32"):
        for name in ("out", *NAMES, *PARAMS):
            assert r["err"][name] <= 1e-5 * max(r["scale"][name], 1.0), (name, r)


@pytest.mark.parametrize("world", [2, 4])
def test_bf16_within_twice_one_process(world: int) -> None:
    for r in run_ranks(world, selective_errors, "long_and_short", 1, "transformers", "bfloat16"):
        assert_within_twice_one_process(r, ("out", *NAMES, *PARAMS))


def test_correction_and_state_in_blocks_equal_one_block() -> None:
    """The incoming state's effect on the outputs and the state leaving a run, computed in blocks of
    rows recomputed in the backward (bounded memory on long runs), equal one block: value and every
    gradient."""
    from hf_ring.ops.mixers.selective import _block, _correction, _outgoing, _state_block

    g = torch.Generator().manual_seed(0)

    def leaf(*shape: int, negative: bool = False) -> torch.Tensor:
        t = torch.rand(*shape, generator=g, dtype=torch.float64)
        return (-t if negative else t).requires_grad_()

    cum, c, a, s = leaf(2, 5, 37), leaf(2, 4, 37), leaf(5, 4, negative=True), leaf(2, 5, 4)
    du, b = leaf(2, 5, 37), leaf(2, 4, 37)
    budget = 2 * 5 * 4 * 6  # blocks of 6 rows
    cases = [(_block(cum, c, a, s), _correction(cum, c, a, s, budget=budget), (cum, c, a, s)),
             (_state_block(cum, du, b, a), _outgoing(cum, du, b, a, budget=budget), (cum, du, b, a))]  # fmt: skip
    for whole, blocks, leaves in cases:
        w = torch.randn(whole.shape, generator=g, dtype=torch.float64)
        assert (whole - blocks).abs().max() < 1e-12
        grads = torch.autograd.grad((whole * w).sum(), leaves), torch.autograd.grad((blocks * w).sum(), leaves)
        for x, y in zip(*grads):
            assert (x - y).abs().max() < 1e-12
