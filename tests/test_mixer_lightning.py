"""The context-parallel lightning attention of MiniMax (``ops.mixers.lightning``) against a float64
oracle that runs the recurrence ``S = lambda S + k^T v``, ``o = q S`` over each document of the
unsharded batch alone: outputs and the gradients of q, k and v, P = 1..4, Ulysses pieces, packed
documents of 1, 2 and more tokens crossing chunk and rank boundaries, rows not a multiple of 2P,
blocks shorter and longer than a run; bf16 within 2x of one process."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from hf_ring.ops.mixers.lightning import lightning_attention
from hf_ring.ops.mixers.ssd import ssd_plan
from testkit.mixers import (
    KINDS,
    assert_within_twice_one_process,
    each_document_alone,
    local_rows,
    make_layout,
    mixer_errors,
)
from testkit.spawn import run_ranks

H, DH = 3, 5
NAMES = ("dq", "dk", "dv")


def recurrence(q, k, v, slope):
    """``[1, L, H, Dh]`` each, token by token in the inputs' dtype (float32 or wider)."""
    dtype = torch.promote_types(q.dtype, torch.float32)
    q, k, v = (t.to(dtype) for t in (q, k, v))
    lam = torch.exp(-slope.to(dtype))[:, None, None]
    s = q.new_zeros(q.shape[0], H, DH, DH)
    outs = []
    for t in range(q.shape[1]):
        s = lam * s + k[:, t, :, :, None] * v[:, t, :, None, :]
        outs.append(torch.einsum("bhk,bhkv->bhv", q[:, t], s))
    return torch.stack(outs, 1)


def inputs(batch: int, n: int) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(13)
    qkv = [torch.randn(batch, n, H, DH, generator=g, dtype=torch.float64) for _ in range(3)]
    slope = torch.tensor([0.5, 0.1, 0.02], dtype=torch.float64)
    return qkv, slope, torch.randn(batch, n, H, DH, generator=g, dtype=torch.float64)


def oracle(xs, slope, w, layout, dtype) -> tuple:
    out, grads, _ = each_document_alone(lambda parts, _: recurrence(*parts, slope).to(dtype), xs, w, layout, dtype)
    return out, grads


def lightning_errors(kind: str, ulysses: int, block: int, dtype: str) -> dict:
    size, rank = dist.get_world_size(), dist.get_rank()
    layout, batch = make_layout(kind, size, ulysses)
    xs, slope, w = inputs(batch, layout.n)
    want, grads = oracle(xs, slope, w, layout, torch.float64)
    dt = getattr(torch, dtype)
    leaves = [local_rows(t, layout, rank).to(dt).requires_grad_() for t in xs]
    out = lightning_attention(*leaves, slope.to(dt), ssd_plan(layout, batch, rank), None, block_size=block)
    base = oracle(xs, slope, w, layout, dt) if dtype != "float64" else None
    return mixer_errors(out, want, w, layout, rank, batch, list(zip(NAMES, leaves, grads)), one_process=base)


CASES = [(1, 1), (2, 1), (3, 1), (4, 1), (4, 2)]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(("world", "ulysses"), CASES)
def test_lightning_matches_each_document_alone(world: int, ulysses: int, kind: str) -> None:
    for r in run_ranks(world, lightning_errors, kind, ulysses, 4, "float64"):
        assert max(r["err"].values()) < 1e-10, r


@pytest.mark.parametrize("world", [2, 4])
def test_bf16_within_twice_one_process(world: int) -> None:
    for r in run_ranks(world, lightning_errors, "long_and_short", 1, 16, "bfloat16"):
        assert_within_twice_one_process(r, ("out", *NAMES))
