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
    import sys

    from transformers.models.jamba.modeling_jamba import mamba_selective_scan as fn

    from hf_ring.transformers.mixers import original

    return original(sys.modules[fn.__module__], fn.__name__)


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
    pleaves = [t.detach().to(dtype).clone().requires_grad_() for t in params]
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
    pleaves = [t.to(dt).requires_grad_() for t in params]
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


@pytest.mark.parametrize("world", [2, 4])
def test_bf16_within_twice_one_process(world: int) -> None:
    for r in run_ranks(world, selective_errors, "long_and_short", 1, "transformers", "bfloat16"):
        assert_within_twice_one_process(r, ("out", *NAMES, *PARAMS))


def test_correction_in_blocks_equals_one_block() -> None:
    """The incoming state's effect, computed in blocks of rows recomputed in the backward (bounded
    memory on long runs), equals one block: value and every gradient."""
    from hf_ring.ops.mixers.selective import _block, _correction

    g = torch.Generator().manual_seed(0)
    cum = torch.rand(2, 5, 37, generator=g, dtype=torch.float64).cumsum(-1).requires_grad_()
    a = (-torch.rand(5, 4, generator=g, dtype=torch.float64)).requires_grad_()
    c = torch.randn(2, 4, 37, generator=g, dtype=torch.float64).requires_grad_()
    s = torch.randn(2, 5, 4, generator=g, dtype=torch.float64).requires_grad_()
    w = torch.randn(2, 5, 37, generator=g, dtype=torch.float64)
    whole = _block(cum, a, c, s)
    blocks = _correction(cum, a, c, s, budget=2 * 5 * 4 * 6)  # blocks of 6 rows
    for x, y in zip(torch.autograd.grad((whole * w).sum(), (cum, a, c, s)),
                    torch.autograd.grad((blocks * w).sum(), (cum, a, c, s))):  # fmt: skip
        assert (x - y).abs().max() < 1e-12
    assert (whole - blocks).abs().max() < 1e-12
