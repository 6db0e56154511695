"""The context-parallel causal convolution (``ops.mixers.conv``) against a float64 oracle that
convolves each document of the unsharded batch alone: output and the gradients of the input, the
weight and the bias, P = 1..4, Ulysses pieces, kernels longer than a chunk (the halo reaches over
several runs and ranks), packed documents of 1, 2 and more tokens, rows not a multiple of 2P."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from hf_ring.ops.mixers.conv import causal_conv1d, conv_plan, torch_causal_conv1d
from testkit.mixers import KINDS, each_document_alone, local_rows, make_layout, real_rows
from testkit.spawn import run_ranks

C = 5


def oracle(x: Tensor, weight, bias, activation, layout, w_out):
    """Each document convolved alone; the loss ``sum(out * w_out)`` and its gradients."""

    def conv(parts: list[Tensor], ps: list[Tensor]) -> Tensor:
        return torch_causal_conv1d(parts[0], *ps, activation)

    out, (gx,), (gw, gb) = each_document_alone(conv, [x], w_out, layout, x.dtype, [weight, bias], dim=2)
    return out, gx, gw, gb


Tensor = torch.Tensor


def conv_errors(kind: str, ulysses: int, kernel: int, activation: str | None, dtype: str) -> dict[str, float]:
    size, rank = dist.get_world_size(), dist.get_rank()
    layout, batch = make_layout(kind, size, ulysses)
    g = torch.Generator().manual_seed(11)
    full = torch.randn(batch, C, layout.n, generator=g, dtype=torch.float64)
    weight = torch.randn(C, kernel, generator=g, dtype=torch.float64)
    bias = torch.randn(C, generator=g, dtype=torch.float64)
    w_out = torch.randn(batch, C, layout.n, generator=g, dtype=torch.float64)
    want, gx, gw, gb = oracle(full, weight, bias, activation, layout, w_out)
    real = real_rows(layout, rank, batch)[:, None, :]  # [B, 1, S]
    dt = getattr(torch, dtype)
    x = local_rows(full, layout, rank, dim=2).to(dt).requires_grad_()
    wt, bt = weight.to(dt).requires_grad_(), bias.to(dt).requires_grad_()
    plan = conv_plan(layout, batch, rank, kernel - 1)
    out = causal_conv1d(x, wt, bt, activation, plan, None)
    (out * local_rows(w_out, layout, rank, dim=2).to(dt) * real).sum().backward()
    dw, db = wt.grad.double().clone(), bt.grad.double().clone()
    if size > 1:
        dist.all_reduce(dw)
        dist.all_reduce(db)

    def err(a: Tensor, b: Tensor) -> float:
        return float(((a.double() - b) * real).abs().max()) if a.dim() == 3 else float((a.double() - b).abs().max())

    return {
        "out": err(out.detach(), local_rows(want, layout, rank, dim=2)),
        "dx": err(x.grad, local_rows(gx, layout, rank, dim=2)),
        "dw": float((dw - gw).abs().max()),
        "db": float((db - gb).abs().max()),
    }


@pytest.mark.parametrize("kernel", [2, 4, 7])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(("world", "ulysses"), [(1, 1), (2, 1), (3, 1), (4, 1), (4, 2)])
def test_causal_conv1d_matches_each_document_alone(world: int, ulysses: int, kind: str, kernel: int) -> None:
    """Kernel 7 at P = 4 reaches over two chunks of 3 tokens (and over several short documents)."""
    for r in run_ranks(world, conv_errors, kind, ulysses, kernel, "silu", "float64"):
        assert max(r.values()) < 1e-12, r


@pytest.mark.parametrize("activation", [None, "silu"])
def test_causal_conv1d_float32_and_no_activation(activation: str | None) -> None:
    for r in run_ranks(3, conv_errors, "long_and_short", 1, 4, activation, "float32"):
        assert max(r.values()) < 1e-5, r


def test_plan_sends_only_the_border() -> None:
    """One sequence of 64 tokens over P = 4, kernel 3: each rank sends 2 rows per boundary it precedes
    and keeps no copy of the rest; rank 0's first run starts the document at local row 0 (no recompute)."""
    from hf_ring.ops.layout import sequence_layout

    layout = sequence_layout(64, 4)
    plans = [conv_plan(layout, 1, r, 2) for r in range(4)]
    assert [len(p.keep) for p in plans] == [2, 4, 4, 2]
    assert [len(p.piece) for p in plans] == [1, 2, 2, 1]
