"""Block kernels against float64 on every backend (the CUDA ones through stand-ins of the ops they
call, ``testkit/cuda_standins.py``), and ``merge_`` on empty rows."""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor

from hf_ring.ops import kernels as kernels_mod
from hf_ring.ops.kernels import (
    FlashAttnKernel,
    ReferenceKernel,
    TorchCPUKernel,
    TorchCUDAKernel,
    TorchEfficientKernel,
    available_backends,
    get_kernel,
)
from hf_ring.ops.merge import merge_
from testkit.cuda_standins import (
    FAKES,
    KERNELS,
    TOL,
    inputs,
    make_kernel,
)
from testkit.oracle import reference, rel_err

# --------------------------------------------------------------------------- kernels vs float64

# (B, Sq, Sk, Hq, Hkv, D, causal); causal only on square blocks, the only ones the ring asks for
SHAPES = [
    (2, 13, 29, 8, 2, 80, False),
    (1, 29, 13, 8, 2, 80, False),
    (2, 19, 19, 8, 2, 80, True),
    (1, 17, 17, 4, 4, 64, True),
    (1, 11, 23, 6, 3, 36, False),  # head_dim not a multiple of 8: the CUDA kernels pad
    (1, 11, 11, 6, 3, 36, True),
    (1, 21, 21, 8, 2, 72, True),
    (2, 15, 9, 4, 1, 72, False),  # one K/V head
    (1, 9, 14, 4, 2, 100, False),  # padded to 104
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}_Sq{}_Sk{}_H{}/{}_D{}_{}".format(*s[:6], "c" * s[6]))
@pytest.mark.parametrize("name", KERNELS)
def test_kernel_forward_backward(name: str, shape: tuple, dtype: torch.dtype) -> None:
    kernel = make_kernel(name)
    causal, scale = shape[6], 0.9 / math.sqrt(shape[5])
    q64, k64, v64, dout64 = inputs(shape, dtype)
    q, k, v, dout = (x.to(dtype) for x in (q64, k64, v64, dout64))
    # the oracle sees the rounded inputs, so bf16 errors come from the kernel alone
    ref_out, ref_lse, *ref_grads = reference(q, k, v, dout, causal, scale)
    out, lse = kernel.forward(q, k, v, causal=causal, scale=scale)
    assert out.dtype == dtype and out.shape == q.shape
    assert lse.dtype == torch.float32 and lse.shape == q.shape[:3]
    assert rel_err(out, ref_out) <= TOL[dtype], f"out {rel_err(out, ref_out):.2e}"
    torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-5, atol=1e-5 if dtype == torch.float32 else 1e-3)
    grads = kernel.backward(dout, q, k, v, out, lse, causal=causal, scale=scale)
    for gname, g, x, r in zip(("dq", "dk", "dv"), grads, (q, k, v), ref_grads):
        assert g.shape == x.shape and g.dtype == dtype, gname
        assert rel_err(g, r) <= TOL[dtype], f"{gname} rel err {rel_err(g, r):.2e}"


@pytest.mark.parametrize("name", ["torch", "reference", "torch_efficient"])
@pytest.mark.parametrize("sq, sk", [(7, 19), (19, 7)])
def test_causal_non_square_is_top_left(name: str, sq: int, sk: int) -> None:
    """What the BlockKernel docstring promises for torch and reference (flash-attn aligns
    bottom-right; the ring never asks for a causal non-square block)."""
    shape = (1, sq, sk, 4, 2, 16, True)
    q, k, v, dout = (x.float() for x in inputs(shape, torch.float32, seed=3))
    kernel = make_kernel(name)
    ref_out, ref_lse, *ref_grads = reference(q, k, v, dout, True, 0.25)
    out, lse = kernel.forward(q, k, v, causal=True, scale=0.25)
    assert rel_err(out, ref_out) <= 1e-5
    torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-5, atol=1e-5)
    for g, r in zip(kernel.backward(dout, q, k, v, out, lse, causal=True, scale=0.25), ref_grads):
        assert rel_err(g, r) <= 1e-5


@pytest.mark.parametrize("name", KERNELS)
def test_block_gradients_with_merged_out_and_lse(name: str) -> None:
    """Keys split into two blocks: merging the block outputs gives full attention, and backward of
    each block with the *merged* out/lse gives exact contributions to the full gradients."""
    kernel = make_kernel(name)
    b, s, hq, hkv, d, cut = 2, 21, 8, 2, 80, 8
    q, k, v, dout = (x.float() for x in inputs((b, s, s, hq, hkv, d, False), torch.float32, seed=5))
    scale = d**-0.5
    ref_out, ref_lse, *ref_grads = reference(q, k, v, dout, False, scale)
    out = torch.zeros(q.shape)
    lse = torch.full(q.shape[:3], float("-inf"))
    parts = ((slice(0, cut), False), (slice(cut, s), False))
    for kr, causal in parts:
        o_b, l_b = kernel.forward(q, k[:, kr], v[:, kr], causal=causal, scale=scale)
        merge_(out, lse, o_b, l_b)
    assert rel_err(out, ref_out) <= 1e-5
    torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-5, atol=1e-5)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for kr, causal in parts:
        dq_b, dk_b, dv_b = kernel.backward(dout, q, k[:, kr], v[:, kr], out, lse, causal=causal, scale=scale)
        dq += dq_b
        dk[:, kr] += dk_b
        dv[:, kr] += dv_b
    for gname, g, r in zip(("dq", "dk", "dv"), (dq, dk, dv), ref_grads):
        assert rel_err(g, r) <= 1e-5, f"{gname} rel err {rel_err(g, r):.2e}"


def test_kernel_names_and_selection() -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert isinstance(get_kernel("auto", cpu, torch.float32), TorchCPUKernel)
    assert isinstance(get_kernel("auto", cpu, torch.bfloat16), TorchCPUKernel)
    assert isinstance(get_kernel("reference", cpu, torch.float32), ReferenceKernel)
    assert get_kernel("torch", cpu, torch.float32).name == "torch"
    assert FlashAttnKernel(module=FAKES["2.7-plain"]).name == "flash_attn"
    assert available_backends("cpu") == ["torch", "reference"]
    # CUDA selection needs no device: kernels touch CUDA only when called
    assert isinstance(get_kernel("auto", cuda, torch.float32), TorchEfficientKernel)  # not the O(S^2) reference
    assert isinstance(get_kernel("auto", cuda, torch.float64), ReferenceKernel)
    assert isinstance(get_kernel("torch_efficient", cuda, torch.bfloat16), TorchEfficientKernel)
    with pytest.raises(ValueError, match=r"backend='torch' has no kernel for torch.float32 on cuda.*torch_efficient"):
        get_kernel("torch", cuda, torch.float32)
    with pytest.raises(ValueError, match=r"backend='torch_efficient' needs CUDA tensors"):
        get_kernel("torch_efficient", cpu, torch.float32)
    if kernels_mod._flash_attn()[0] is None:
        assert isinstance(get_kernel("auto", cuda, torch.bfloat16), TorchCUDAKernel)
        assert available_backends("cuda") == ["torch", "torch_efficient", "reference"]


def test_get_kernel_caches_one_object_per_backend_device_type_dtype() -> None:
    cpu = torch.device("cpu")
    k = get_kernel("torch", cpu, torch.float32)
    assert get_kernel("torch", "cpu", torch.float32) is k
    assert get_kernel("auto", cpu, torch.float32) is k  # "auto" resolves to the same cached object
    assert get_kernel("torch", cpu, torch.float64) is not k
    assert get_kernel("reference", cpu, torch.float32) is not k
    cuda0, cuda1 = torch.device("cuda", 0), torch.device("cuda", 1)
    assert get_kernel("torch_efficient", cuda0, torch.float32) is get_kernel("auto", cuda1, torch.float32)
    assert get_kernel("torch", cuda0, torch.bfloat16) is get_kernel("torch", "cuda", torch.bfloat16)


# --------------------------------------------------------------------------- merge_


def _acc(b: int = 2, s: int = 5, h: int = 3, d: int = 4, seed: int = 0) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, s, h, d, generator=g), torch.randn(b, s, h, generator=g)


def test_merge_into_empty_accumulator_gives_the_block() -> None:
    blk_out, blk_lse = _acc(seed=1)
    out, lse = torch.zeros_like(blk_out), torch.full_like(blk_lse, float("-inf"))
    merge_(out, lse, blk_out, blk_lse)
    assert torch.equal(out, blk_out) and torch.equal(lse, blk_lse)


def test_merge_of_empty_block_leaves_accumulator_unchanged() -> None:
    out, lse = _acc(seed=2)
    out0, lse0 = out.clone(), lse.clone()
    blk_out = torch.randn_like(out)  # whatever a kernel leaves in rows without keys: weight 0
    merge_(out, lse, blk_out, torch.full_like(lse, float("-inf")))
    assert torch.equal(out, out0) and torch.equal(lse, lse0)


def test_merge_both_empty_stays_zero_without_nan() -> None:
    b_out, _ = _acc(seed=3)
    out, lse = torch.zeros_like(b_out), torch.full(b_out.shape[:3], float("-inf"))
    merge_(out, lse, b_out, torch.full_like(lse, float("-inf")))
    assert not out.isnan().any() and not lse.isnan().any()
    assert torch.equal(out, torch.zeros_like(out)) and bool(torch.isneginf(lse).all())


def test_merge_mixed_rows_in_place_through_views() -> None:
    """Per-row: empty/empty, empty/full, full/empty, full/full, merged through a slice of the
    accumulators the way the ring does (``out[:, rows]``)."""
    acc_out, acc_lse = _acc(b=1, s=6, seed=4)
    blk_out, blk_lse = _acc(b=1, s=4, seed=5)
    acc_lse[:, 1:3] = float("-inf")  # rows 1, 2 of the view (rows 2, 3 of the base) are empty
    acc_out[:, 1:3] = 0.0
    blk_lse[:, [0, 1]] = float("-inf")  # rows 0, 1 of the block are empty
    out, lse = acc_out.clone(), acc_lse.clone()
    merge_(out[:, 1:5], lse[:, 1:5], blk_out, blk_lse)
    a_o, a_l = acc_out[:, 1:5].double(), acc_lse[:, 1:5].double()
    b_o, b_l = blk_out.double(), blk_lse.double()
    want_l = torch.logaddexp(a_l, b_l)
    w_a = torch.exp(a_l - want_l).nan_to_num(0.0)
    w_b = torch.exp(b_l - want_l).nan_to_num(0.0)
    want_o = a_o * w_a[..., None] + b_o * w_b[..., None]
    assert not out.isnan().any() and not lse.isnan().any()
    assert torch.equal(out[:, [0, 5]], acc_out[:, [0, 5]]) and torch.equal(lse[:, [0, 5]], acc_lse[:, [0, 5]])
    torch.testing.assert_close(out[:, 1:5].double(), want_o, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(lse[:, 1:5].double(), want_l, rtol=1e-6, atol=1e-6)
    assert torch.equal(out[:, 2], torch.zeros_like(out[:, 2]))  # empty + empty
    assert bool(torch.isneginf(lse[:, 2]).all())
    assert torch.equal(out[:, 1], acc_out[:, 1])  # full + empty


