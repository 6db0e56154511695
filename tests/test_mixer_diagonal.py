"""The context-parallel diagonal linear recurrence of RG-LRU (``ops.mixers.diagonal``) against a float64
oracle that runs ``h = a * h + x`` over each document of the unsharded batch alone: outputs and the
gradients of a and x (with decays of exactly 0 inside runs, where the state resets), P = 1..4,
Ulysses pieces, packed documents of 1, 2 and more tokens crossing chunk and rank boundaries, rows not
a multiple of 2P; bf16 within 2x of one process."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from hf_ring.ops.mixers.diagonal import diagonal_plan, diagonal_recurrence
from testkit.mixers import (
    KINDS,
    assert_within_twice_one_process,
    each_document_alone,
    local_rows,
    make_layout,
    mixer_errors,
)
from testkit.spawn import run_ranks

D = 7
NAMES = ("da", "dx")


def recurrence(a: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``[1, L, D]`` each, token by token in float32 or wider."""
    dtype = torch.promote_types(x.dtype, torch.float32)
    h = x.new_zeros(x.shape[0], x.shape[2], dtype=dtype)
    outs = []
    for t in range(x.shape[1]):
        h = a[:, t].to(dtype) * h + x[:, t].to(dtype)
        outs.append(h)
    return torch.stack(outs, 1)


def inputs(batch: int, n: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    g = torch.Generator().manual_seed(17)
    a = torch.rand(batch, n, D, generator=g, dtype=torch.float64) * 0.3 + 0.7
    a = a * (torch.rand(batch, n, D, generator=g, dtype=torch.float64) > 0.05)  # some resets inside runs
    x = torch.randn(batch, n, D, generator=g, dtype=torch.float64)
    return [a, x], torch.randn(batch, n, D, generator=g, dtype=torch.float64)


def oracle(xs, w, layout, dtype) -> tuple:
    out, grads, _ = each_document_alone(lambda parts, _: recurrence(*parts).to(dtype), xs, w, layout, dtype)
    return out, grads


def diagonal_errors(kind: str, ulysses: int, dtype: str) -> dict:
    size, rank = dist.get_world_size(), dist.get_rank()
    layout, batch = make_layout(kind, size, ulysses)
    xs, w = inputs(batch, layout.n)
    want, grads = oracle(xs, w, layout, torch.float64)
    dt = getattr(torch, dtype)
    leaves = [local_rows(t, layout, rank).to(dt).requires_grad_() for t in xs]
    out = diagonal_recurrence(*leaves, diagonal_plan(layout, batch, rank), None).to(dt)
    base = oracle(xs, w, layout, dt) if dtype != "float64" else None
    return mixer_errors(out, want, w, layout, rank, batch, list(zip(NAMES, leaves, grads)), one_process=base)


CASES = [(1, 1), (2, 1), (3, 1), (4, 1), (4, 2)]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(("world", "ulysses"), CASES)
def test_diagonal_recurrence_matches_each_document_alone(world: int, ulysses: int, kind: str) -> None:
    for r in run_ranks(world, diagonal_errors, kind, ulysses, "float64"):
        assert max(r["err"].values()) < 1e-10, r


@pytest.mark.parametrize("world", [2, 4])
def test_bf16_within_twice_one_process(world: int) -> None:
    for r in run_ranks(world, diagonal_errors, "long_and_short", 1, "bfloat16"):
        assert_within_twice_one_process(r, ("out", *NAMES))
