"""The context-parallel SSD scan of Mamba2 (``ops.mixers.ssd``) against a float64 oracle that runs each
document of the unsharded batch alone: outputs and the gradients of x, dt, B, C and of the parameters
A, D and dt_bias, P = 1..4, Ulysses pieces, grouped B/C (H = 2 G), packed documents of 1, 2 and more
tokens crossing chunk and rank boundaries, rows not a multiple of 2P, step sizes clamped by the
limit; with the float64 reference scan (1e-10), transformers' own chunk scan (float32 inside: 1e-5)
and bf16 (within 2x of one process)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from hf_ring.ops.mixers.ssd import ssd_plan, ssd_scan
from testkit.mixers import (
    KINDS,
    assert_within_twice_one_process,
    documents,
    local_rows,
    make_layout,
    mixer_errors,
    ssd_reference,
)
from testkit.spawn import run_ranks

H, P, G, N = 4, 3, 2, 5
OPTIONS = {"chunk_size": 4, "dt_softplus": True, "dt_limit": (0.3, 4.0)}
NAMES = ("dx", "ddt", "dB", "dC")
PARAMS = ("dA", "dD", "ddt_bias")


def _scan(name: str):
    if name == "reference":
        return ssd_reference
    import importlib

    from hf_ring.transformers.install import original

    return original(importlib.import_module("transformers.models.nemotron_h.modeling_nemotron_h"), "mamba2_chunk_scan")


def inputs(batch: int, n: int) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(batch, n, H, P, generator=g, dtype=torch.float64)
    dt = torch.randn(batch, n, H, generator=g, dtype=torch.float64)
    b = torch.randn(batch, n, G, N, generator=g, dtype=torch.float64)
    c = torch.randn(batch, n, G, N, generator=g, dtype=torch.float64)
    a = -0.2 - torch.rand(H, generator=g, dtype=torch.float64)
    d = torch.randn(H, generator=g, dtype=torch.float64)
    bias = torch.randn(H, generator=g, dtype=torch.float64)
    w = torch.randn(batch, n, H, P, generator=g, dtype=torch.float64)
    return [x, dt, b, c], [a, d, bias], w


def _call(scan, xs, params, **options):
    x, dt, b, c = xs
    a, d, bias = params
    return scan(x, dt, a, b, c, D=d, dt_bias=bias, **options)


def oracle(xs, params, w, layout, dtype: torch.dtype, scan) -> tuple:
    """Each document alone through ``scan`` in ``dtype``; the output and the gradients of ``sum(out * w)``."""
    leaves = [t.detach().to(dtype).clone().requires_grad_() for t in xs]
    pleaves = [t.detach().to(dtype).clone().requires_grad_() for t in params]
    out = torch.zeros_like(w)
    for row in range(w.shape[0]):
        for lo, hi in documents(layout, row):
            part = [t[row : row + 1, lo:hi] for t in leaves]
            out[row, lo:hi] = _call(scan, part, pleaves, **OPTIONS)[0].double()
    (out * w).sum().backward()
    return out.detach(), [t.grad.double() for t in leaves], [t.grad.double() for t in pleaves]


def ssd_errors(kind: str, ulysses: int, scan_name: str, dtype: str) -> dict:
    size, rank = dist.get_world_size(), dist.get_rank()
    layout, batch = make_layout(kind, size, ulysses)
    xs, params, w = inputs(batch, layout.n)
    scan = _scan(scan_name)
    want, grads, pgrads = oracle(xs, params, w, layout, torch.float64, ssd_reference)
    dt = getattr(torch, dtype)
    leaves = [local_rows(t, layout, rank).to(dt).requires_grad_() for t in xs]
    pleaves = [t.to(dt).requires_grad_() for t in params]
    plan = ssd_plan(layout, batch, rank)
    x, dts, b, c = leaves
    a, d, bias = pleaves
    out = ssd_scan(scan, x, dts, a, b, c, plan, None, D=d, dt_bias=bias, **OPTIONS)
    base = None
    if dtype != "float64":  # one process in the same dtype, each document alone: the error to be within 2x of
        base_out, base_grads, base_pgrads = oracle(xs, params, w, layout, dt, scan)
        base = (base_out, base_grads + base_pgrads)
    return mixer_errors(out, want, w, layout, rank, batch, list(zip(NAMES, leaves, grads)),
                        list(zip(PARAMS, pleaves, pgrads)), base)  # fmt: skip


CASES = [(1, 1), (2, 1), (3, 1), (4, 1), (4, 2)]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(("world", "ulysses"), CASES)
def test_ssd_scan_matches_each_document_alone(world: int, ulysses: int, kind: str) -> None:
    for r in run_ranks(world, ssd_errors, kind, ulysses, "reference", "float64"):
        assert max(r["err"].values()) < 1e-10, r


@pytest.mark.parametrize(("world", "kind"), [(3, "sequence"), (4, "short_ones"), (2, "odd")])
def test_transformers_scan_under_state_passing(world: int, kind: str) -> None:
    """transformers' chunk scan computes in float32 inside: relative 1e-5 of each tensor's scale."""
    for r in run_ranks(world, ssd_errors, kind, 1, "transformers", "float64"):
        for name, e in r["err"].items():
            assert e <= 1e-5 * max(r["scale"][name], 1.0), (name, r)


@pytest.mark.parametrize("world", [2, 4])
def test_bf16_within_twice_one_process(world: int) -> None:
    for r in run_ranks(world, ssd_errors, "long_and_short", 1, "transformers", "bfloat16"):
        assert_within_twice_one_process(r, ("out", *NAMES, *PARAMS))
