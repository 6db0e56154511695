"""The tiled MLP: the untiled MLP's output and gradients (float32 against float64), and under autocast
a backward that recomputes each tile in the forward's autocast state: its GEMMs in the autocast
dtype, gradients as close to float64 as the untiled path's under the same autocast."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import hf_ring
from hf_ring.ops.tiled_mlp import tiled_forward
from testkit.mixed_precision import GemmDtypes, confident_model, grad_errors
from testkit.oracle import rel_err


class GatedMLP(torch.nn.Module):
    def __init__(self, hidden: int = 40, inner: int = 72) -> None:
        super().__init__()
        self.gate_proj = torch.nn.Linear(hidden, inner, bias=False)
        self.up_proj = torch.nn.Linear(hidden, inner, bias=False)
        self.down_proj = torch.nn.Linear(inner, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def _step(mlp: GatedMLP, x: torch.Tensor, dout: torch.Tensor, tile: int | None, dtype: torch.dtype | None):
    """Output and gradients (x, then every parameter) of ``mlp`` over ``x [B, S, H]``, tiled or not,
    under CPU autocast to ``dtype`` when given."""
    x = x.detach().clone().requires_grad_()
    with torch.autocast("cpu", dtype or torch.bfloat16, enabled=dtype is not None):
        out = tiled_forward(mlp, mlp.forward, x, tile) if tile else mlp(x)
    return out, torch.autograd.grad(out, [x, *mlp.parameters()], dout)


def _inputs(seed: int = 0):
    torch.manual_seed(seed)
    mlp = GatedMLP()
    g = torch.Generator().manual_seed(seed)
    return mlp, torch.randn(2, 37, 40, generator=g), torch.randn(2, 37, 40, generator=g)


@pytest.mark.parametrize("tile", [1, 7, 64])
def test_tiled_equals_untiled_float32(tile):
    mlp, x, dout = _inputs()
    ref_out, ref_grads = _step(copy.deepcopy(mlp).double(), x.double(), dout.double(), None, None)
    out, grads = _step(mlp, x, dout, tile, None)
    assert rel_err(out, ref_out) < 1e-6
    for g, r in zip(grads, ref_grads):
        assert g.dtype == torch.float32 and rel_err(g, r) < 1e-6


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_autocast_backward_recomputes_in_the_forward_dtype(dtype):
    """Backward re-runs each tile under the forward's autocast: every GEMM of the backward in the
    autocast dtype (fp32 GEMMs outside autocast would be several times slower on a GPU and take
    gradients at other activations than the forward's), gradients within 2x of the untiled path's
    error against float64 under the same autocast."""
    mlp, x, dout = _inputs(1)
    ref_out, ref_grads = _step(copy.deepcopy(mlp).double(), x.double(), dout.double(), None, None)
    plain_out, plain_grads = _step(mlp, x, dout, None, dtype)
    xt = x.detach().clone().requires_grad_()
    with torch.autocast("cpu", dtype):
        out = tiled_forward(mlp, mlp.forward, xt, 16)
    assert out.dtype == plain_out.dtype == dtype
    with GemmDtypes() as rec:
        grads = torch.autograd.grad(out, [xt, *mlp.parameters()], dout)
    assert len(rec.gemms) == 5 * (3 + 6)  # 5 tiles x (3 projections recomputed + 2 gradient GEMMs each)
    assert all(set(dtypes) == {dtype} for _, dtypes in rec.gemms), rec.gemms
    assert rel_err(out, ref_out) <= 2 * rel_err(plain_out, ref_out)
    for name, g, p, r in zip(["x", "gate", "up", "down"], grads, plain_grads, ref_grads):
        assert g.dtype == torch.float32
        assert rel_err(g, r) <= 2 * rel_err(p, r), f"{name}: tiled {rel_err(g, r):.2e} vs {rel_err(p, r):.2e}"


def test_autocast_model_with_confident_targets_within_twice_the_untiled_path():
    """A tiny float32 Llama trained until it predicts its batch with median p > 0.95, one step under
    CPU bf16 autocast: every parameter gradient with the tiled MLP within 2x of the untiled path's
    error against float64 (``python -m benchmarks.bench_autocast`` gives the figures)."""
    model, batch, _ = confident_model(vocab=256, confidence=0.95)
    plain = grad_errors(model, batch)
    tiled = grad_errors(model, batch, lambda m: hf_ring.enable_tiled_mlp(m, tile_tokens=16))
    for name, ref in plain.items():
        assert tiled[name] <= 2 * ref + 1e-6, f"{name}: tiled {tiled[name]:.3f} vs untiled {ref:.3f}"
