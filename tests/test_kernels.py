"""Block kernels against float64, merge_ on empty rows, and the flash-attn call contract.

flash-attn needs CUDA, so its contract is checked against a plain-torch stand-in with the real
signatures of ``flash_attn.flash_attn_interface._flash_attn_forward`` / ``_flash_attn_backward``:

* 2.7.0 .. 2.8.x (checked up to 2.8.4): separate ``window_size_left/right``; forward returns
  ``(out, softmax_lse, S_dmask, rng_state)``; backward fills ``dq, dk, dv`` in place and returns
  ``softmax_d``. With torch >= 2.4 both are ``torch.library`` custom ops, so their Python
  signature is ``(*args, **kwargs)``; the stand-in is registered the same way (and also used as
  plain functions, as on older torch).
* 2.6.x: one ``window_size`` tuple; forward returns ``(out, q, k, v, out_padded, softmax_lse,
  S_dmask, rng_state)``, backward ``(dq, dk, dv, softmax_d)``.

The stand-in keeps the CUDA op's checks that matter to a caller (dtypes, contiguous last dim,
head_dim a multiple of 8, shapes of dq/dk/dv, lse ``[B, H, Sq]`` float32 contiguous) and its
semantics (bottom-right causal alignment, ``lse = +inf`` for rows that see no key), and also takes
float32 on CPU so the comparison with float64 is tight.
"""

from __future__ import annotations

import importlib
import itertools
import math
from types import SimpleNamespace

import pytest
import torch
from torch import Tensor

import hf_ring
from hf_ring.ops.comm import Ring
from hf_ring.ops.kernels import FlashAttnKernel, ReferenceKernel, TorchCPUKernel, get_kernel
from hf_ring.ops.ring import _RingAttention, merge_
from hf_ring.ops.schedule import make_schedule
from testkit.oracle import attention, rel_err
from testkit.spawn import run_ranks

# --------------------------------------------------------------------------- float64 oracle


def scores64(q: Tensor, k: Tensor, causal: bool, scale: float) -> Tensor:
    """``[B, H, Sq, Sk]`` float64 scores; causal is top-left aligned (key j hidden from query i > j)."""
    rep = q.shape[2] // k.shape[2]
    s = torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double().repeat_interleave(rep, 2)) * scale
    if causal:
        sq, sk = s.shape[-2:]
        s = s.masked_fill(torch.ones(sq, sk, dtype=torch.bool).triu(1), float("-inf"))
    return s


def attention64(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
    """``(out [B, Sq, Hq, D], lse [B, Sq, Hq])`` in float64, differentiable."""
    s = scores64(q, k, causal, scale)
    rep = q.shape[2] // k.shape[2]
    out = torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), v.double().repeat_interleave(rep, 2))
    return out, torch.logsumexp(s, -1).transpose(1, 2)


# --------------------------------------------------------------------------- flash-attn stand-in


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise RuntimeError(msg)  # what TORCH_CHECK raises


def _fa_scores(q: Tensor, k: Tensor, scale: float, causal: bool) -> Tensor:
    rep = q.shape[2] // k.shape[2]
    s = torch.einsum("bqhd,bkhd->bhqk", q.float(), k.float().repeat_interleave(rep, 2)) * scale
    if causal:  # flash-attn >= 2.1: aligned to the bottom-right corner
        sq, sk = s.shape[-2:]
        s = s.masked_fill(torch.ones(sq, sk, dtype=torch.bool).triu(sk - sq + 1), float("-inf"))
    return s


def _fa_check_inputs(q: Tensor, k: Tensor, v: Tensor) -> None:
    _check(
        q.dtype in (torch.float16, torch.bfloat16, torch.float32), "FlashAttention only supports fp16/bf16"
    )
    _check(k.dtype == q.dtype and v.dtype == q.dtype, "query and key/value must have the same dtype")
    for t in (q, k, v):
        _check(t.dim() == 4 and t.stride(-1) == 1, "Input tensor must have contiguous last dimension")
    b, _, h, d = q.shape
    _check(d % 8 == 0, "query, key, value, and out_ must have a head_size that is a multiple of 8")
    _check(d <= 256, "FlashAttention forward only supports head dimension at most 256")
    _check(k.shape == v.shape and k.shape[0] == b and k.shape[3] == d, "k/v shapes")
    _check(h % k.shape[2] == 0, "Number of heads in key/value must divide number of heads in query")


def _fa_check_defaults(
    dropout_p: float, wl: int, wr: int, softcap: float, alibi_slopes: Tensor | None
) -> None:
    # everything the ring must leave at its default
    _check(dropout_p == 0.0 and wl == -1 and wr == -1 and softcap == 0.0 and alibi_slopes is None, "options")


def flash_attn_forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    dropout_p: float,
    softmax_scale: float,
    causal: bool,
    window_size_left: int,
    window_size_right: int,
    softcap: float,
    alibi_slopes: Tensor | None,
    return_softmax: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``flash_attn_interface._flash_attn_forward`` of 2.7+, in plain torch."""
    _fa_check_inputs(q, k, v)
    _fa_check_defaults(dropout_p, window_size_left, window_size_right, softcap, alibi_slopes)
    _check(not return_softmax, "return_softmax")
    s = _fa_scores(q, k, softmax_scale, causal)
    lse = torch.logsumexp(s, -1)  # [B, H, Sq] float32
    lse = lse.masked_fill(torch.isneginf(lse), float("inf"))  # flash-attn: +inf for empty rows
    rep = q.shape[2] // k.shape[2]
    p = torch.exp(s - lse[..., None])
    out = torch.einsum("bhqk,bkhd->bqhd", p, v.float().repeat_interleave(rep, 2)).to(q.dtype)
    s_dmask = torch.empty((0,), dtype=q.dtype, device=q.device)
    rng_state = torch.empty((2,), dtype=torch.int64, device=q.device)
    return out.contiguous(), lse.contiguous(), s_dmask, rng_state


def flash_attn_backward(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    softmax_lse: Tensor,
    dq: Tensor | None,
    dk: Tensor | None,
    dv: Tensor | None,
    dropout_p: float,
    softmax_scale: float,
    causal: bool,
    window_size_left: int,
    window_size_right: int,
    softcap: float,
    alibi_slopes: Tensor | None,
    deterministic: bool,
    rng_state: Tensor | None = None,
) -> Tensor:
    """``flash_attn_interface._flash_attn_backward`` of 2.7+, in plain torch: fills dq, dk, dv."""
    _fa_check_inputs(q, k, v)
    _fa_check_defaults(dropout_p, window_size_left, window_size_right, softcap, alibi_slopes)
    b, sq, h, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    for name, t in (("out", out), ("dout", dout)):
        _check(t.dtype == q.dtype, f"query and {name} must have the same dtype")
        _check(t.stride(-1) == 1, f"{name} tensor must have contiguous last dimension")
        _check(t.shape == q.shape, f"{name} shape")
    # the kernel reads softmax_lse by raw pointer as a contiguous float32 [B, H, Sq]
    _check(softmax_lse.dtype == torch.float32, "softmax_lse must be float32")
    _check(tuple(softmax_lse.shape) == (b, h, sq) and softmax_lse.is_contiguous(), "softmax_lse [B, H, Sq]")
    grads = []
    for name, g, ref in (("dq", dq, q), ("dk", dk, k), ("dv", dv, v)):
        if g is None:
            g = torch.empty_like(ref)
        _check(g.dtype == q.dtype, f"{name} must have the same dtype as q")
        _check(g.stride(-1) == 1, f"{name} must have contiguous last dimension")
        _check(g.shape == ref.shape, f"{name} shape")
        grads.append(g)
    rep = h // hkv
    s = _fa_scores(q, k, softmax_scale, causal)
    p = torch.exp(s - softmax_lse[..., None])
    do, vx = dout.float(), v.float().repeat_interleave(rep, 2)
    delta = (do * out.float()).sum(-1).transpose(1, 2)  # [B, H, Sq]
    ds = p * (torch.einsum("bqhd,bkhd->bhqk", do, vx) - delta[..., None])
    g_q = torch.einsum("bhqk,bkhd->bqhd", ds, k.float().repeat_interleave(rep, 2)) * softmax_scale
    g_k = torch.einsum("bhqk,bqhd->bkhd", ds, q.float()) * softmax_scale
    g_v = torch.einsum("bhqk,bqhd->bkhd", p, do)
    grads[0].copy_(g_q)
    grads[1].copy_(g_k.view(b, sk, hkv, rep, d).sum(3))
    grads[2].copy_(g_v.view(b, sk, hkv, rep, d).sum(3))
    softmax_d = torch.zeros(b, h, (sq + 127) // 128 * 128, dtype=torch.float32, device=q.device)
    softmax_d[..., :sq] = delta
    return softmax_d


def flash_attn_forward_26(
    q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, return_softmax
):
    """2.6.x: ``window_size`` is a tuple; returns ``(out, q, k, v, out_padded, lse, S_dmask, rng)``."""
    out, lse, s_dmask, rng = flash_attn_forward(
        q, k, v, dropout_p, softmax_scale, causal, window_size[0], window_size[1], softcap, alibi_slopes,
        return_softmax,
    )  # fmt: skip
    return out, q, k, v, out, lse, s_dmask, rng


def flash_attn_backward_26(
    dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal, window_size, softcap,
    alibi_slopes, deterministic, rng_state=None,
):  # fmt: skip
    """2.6.x: ``window_size`` is a tuple; returns ``(dq, dk, dv, softmax_d)``."""
    softmax_d = flash_attn_backward(
        dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal, window_size[0],
        window_size[1], softcap, alibi_slopes, deterministic, rng_state,
    )  # fmt: skip
    return dq, dk, dv, softmax_d


def flash_attn_forward_25(
    q, k, v, dropout_p, softmax_scale, causal, window_size, alibi_slopes, return_softmax
):
    raise AssertionError("not called: FlashAttnKernel refuses flash-attn without softcap")


# As in flash-attn >= 2.7 on torch >= 2.4: torch.library custom ops (the forward declares q, k, v
# mutated, like the real one). Registered once per process, at import (workers import this module).
_fwd_op = torch.library.custom_op(
    "hf_ring_tests::flash_attn_forward", flash_attn_forward, mutates_args=("q", "k", "v"), device_types="cpu"
)
_bwd_op = torch.library.custom_op(
    "hf_ring_tests::flash_attn_backward",
    flash_attn_backward,
    mutates_args=("dq", "dk", "dv"),
    device_types="cpu",
)

FAKES = {
    "2.8-custom-op": SimpleNamespace(_flash_attn_forward=_fwd_op, _flash_attn_backward=_bwd_op),
    "2.7-plain": SimpleNamespace(
        _flash_attn_forward=flash_attn_forward, _flash_attn_backward=flash_attn_backward
    ),
    "2.6": SimpleNamespace(
        _flash_attn_forward=flash_attn_forward_26, _flash_attn_backward=flash_attn_backward_26
    ),
}


def make_kernel(name: str):
    if name.startswith("flash_attn:"):
        return FlashAttnKernel(module=FAKES[name.split(":", 1)[1]])
    return get_kernel(name, torch.device("cpu"), torch.float32)


KERNELS = ["torch", "reference", *(f"flash_attn:{v}" for v in FAKES)]

# --------------------------------------------------------------------------- kernels vs float64

# (B, Sq, Sk, Hq, Hkv, D, causal); causal only on square blocks, the only ones the ring asks for
SHAPES = [
    (2, 13, 29, 8, 2, 80, False),
    (1, 29, 13, 8, 2, 80, False),
    (2, 19, 19, 8, 2, 80, True),
    (1, 17, 17, 4, 4, 64, True),
    (1, 11, 23, 6, 3, 36, False),  # head_dim not a multiple of 8: FlashAttnKernel pads
    (1, 11, 11, 6, 3, 36, True),
]
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def inputs(shape: tuple, dtype: torch.dtype, seed: int = 0) -> tuple[Tensor, ...]:
    b, sq, sk, hq, hkv, d, _ = shape
    g = torch.Generator().manual_seed(seed)
    q, k, v, dout = (
        torch.randn(b, s, h, d, generator=g, dtype=torch.float64)
        for s, h in ((sq, hq), (sk, hkv), (sk, hkv), (sq, hq))
    )
    return q, k, v, dout


def reference(q: Tensor, k: Tensor, v: Tensor, dout: Tensor, causal: bool, scale: float) -> list[Tensor]:
    """``[out, lse, dq, dk, dv]`` in float64."""
    xs = [x.detach().double().requires_grad_() for x in (q, k, v)]
    out, lse = attention64(*xs, causal, scale)
    return [out.detach(), lse.detach(), *torch.autograd.grad(out, xs, dout.double())]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    "shape", SHAPES, ids=lambda s: "B{}_Sq{}_Sk{}_H{}/{}_D{}_{}".format(*s[:6], "c" * s[6])
)
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
    torch.testing.assert_close(
        lse.double(), ref_lse, rtol=1e-5, atol=1e-5 if dtype == torch.float32 else 1e-3
    )
    grads = kernel.backward(dout, q, k, v, out, lse, causal=causal, scale=scale)
    for gname, g, x, r in zip(("dq", "dk", "dv"), grads, (q, k, v), ref_grads):
        assert g.shape == x.shape and g.dtype == dtype, gname
        assert rel_err(g, r) <= TOL[dtype], f"{gname} rel err {rel_err(g, r):.2e}"


@pytest.mark.parametrize("name", ["torch", "reference"])
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
    cpu = torch.device("cpu")
    assert isinstance(get_kernel("auto", cpu, torch.float32), TorchCPUKernel)
    assert isinstance(get_kernel("auto", cpu, torch.bfloat16), TorchCPUKernel)
    assert isinstance(get_kernel("reference", cpu, torch.float32), ReferenceKernel)
    assert get_kernel("torch", cpu, torch.float32).name == "torch"
    assert FlashAttnKernel(module=FAKES["2.7-plain"]).name == "flash_attn"
    assert hf_ring.ops.kernels.available_backends("cpu") == ["torch", "reference"]


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


# --------------------------------------------------------------------------- FlashAttnKernel


def test_flash_attn_kernel_refuses_too_old_flash_attn() -> None:
    fa25 = SimpleNamespace(
        _flash_attn_forward=flash_attn_forward_25, _flash_attn_backward=flash_attn_backward_26
    )
    with pytest.raises(ImportError, match=r"install flash-attn >= 2.6"):
        FlashAttnKernel(module=fa25)


def test_flash_attn_kernel_detects_api_version() -> None:
    assert FlashAttnKernel(module=FAKES["2.6"]).legacy
    assert not FlashAttnKernel(module=FAKES["2.7-plain"]).legacy
    assert not FlashAttnKernel(module=FAKES["2.8-custom-op"]).legacy


def test_flash_attn_stand_in_keeps_the_cuda_checks() -> None:
    """The stand-in rejects what the CUDA op rejects, so passing through it means something."""
    q, k, v = (torch.randn(1, 4, 2, d) for d in (36, 36, 36))
    with pytest.raises(RuntimeError, match="multiple of 8"):
        _fwd_op(q, k, v, 0.0, 1.0, False, -1, -1, 0.0, None, False)
    q, k, v = (torch.randn(1, 4, 2, 8) for _ in range(3))
    out, lse, _, _ = _fwd_op(q, k, v, 0.0, 1.0, False, -1, -1, 0.0, None, False)
    dq, dk, dv = (torch.empty_like(t) for t in (q, k, v))
    options = (0.0, 1.0, False, -1, -1, 0.0, None, False, None)
    with pytest.raises(RuntimeError, match=r"softmax_lse \[B, H, Sq\]"):
        _bwd_op(out, q, k, v, out, lse.transpose(1, 2), dq, dk, dv, *options)
    softmax_d = _bwd_op(out, q, k, v, out, lse, dq, dk, dv, *options)
    assert softmax_d.shape == (1, 2, 128) and softmax_d.dtype == torch.float32


def flash_ring_errors(fake: str, causal: bool, dtype_name: str, d: int) -> list[float] | None:
    """On every rank: the whole ring through FlashAttnKernel(stand-in); rank 0 returns the
    relative errors of out, dq, dk, dv against float64."""
    dist = torch.distributed
    size, rank = (dist.get_world_size(), dist.get_rank()) if dist.is_initialized() else (1, 0)
    dtype = getattr(torch, dtype_name)
    b, n, hq, hkv = 1, 2 * size * 5, 8, 2
    g = torch.Generator().manual_seed(11)
    q, k, v, dout = (torch.randn(b, n, h, d, generator=g, dtype=torch.float64) for h in (hq, hkv, hkv, hq))
    xs = [x.requires_grad_() for x in (q, k, v)]
    ref = attention(*xs, causal)
    ref_grads = torch.autograd.grad(ref, xs, dout)
    kernel = FlashAttnKernel(module=FAKES[fake])
    loc = [hf_ring.shard(x.detach().to(dtype)).requires_grad_() for x in (q, k, v)]
    out = _RingAttention.apply(*loc, d**-0.5, make_schedule("zigzag", causal, rank, size), kernel, Ring())
    grads = torch.autograd.grad(out, loc, hf_ring.shard(dout.to(dtype)))
    got = [hf_ring.unshard(t) for t in (out, *grads)]
    if rank:
        return None
    return [rel_err(x, r) for x, r in zip(got, (ref.detach(), *ref_grads))]


RING_CASES = [
    (fake, causal, dtype, d)
    for fake, causal, (dtype, d) in itertools.product(
        FAKES, (True, False), (("float32", 80), ("bfloat16", 80), ("float32", 36))
    )
]


@pytest.mark.parametrize("fake, causal, dtype, d", RING_CASES)
def test_ring_through_flash_attn_kernel_single_process(fake: str, causal: bool, dtype: str, d: int) -> None:
    assert not torch.distributed.is_initialized()
    errs = flash_ring_errors(fake, causal, dtype, d)
    for gname, err in zip(("out", "dq", "dk", "dv"), errs):
        assert err <= TOL[getattr(torch, dtype)], f"{gname} rel err {err:.2e}"


@pytest.mark.parametrize("world", [2, 3])
def test_ring_through_flash_attn_kernel(world: int) -> None:
    cases = [c for c in RING_CASES if c[0] == "2.8-custom-op" or c[2:] == ("float32", 80)]
    for fake, causal, dtype, d in cases:
        errs, *_ = run_ranks(world, flash_ring_errors, fake, causal, dtype, d)
        for gname, err in zip(("out", "dq", "dk", "dv"), errs):
            assert err <= TOL[getattr(torch, dtype)], (
                f"{fake} causal={causal} {dtype} D={d}: {gname} {err:.2e}"
            )


def test_flash_attn_interface_module_is_the_default() -> None:
    """Without a module argument FlashAttnKernel imports flash_attn.flash_attn_interface."""
    if importlib.util.find_spec("flash_attn") is not None:
        pytest.skip("flash_attn is installed")
    with pytest.raises(ModuleNotFoundError, match="flash_attn"):
        FlashAttnKernel()
