"""The attention stand-ins (flash-attn 2, 3 and 4, torch's CUDA ops and its cuDNN attention) keep the libraries'
rules (``docs/standins.md``, "Attention kernels"), and the
CUDA kernels hand the ring ``lse = -inf`` for rows that see no key; the varlen grouping of a ring step."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from hf_ring.ops.kernels import (
    CudnnKernel,
    FlashAttn3Kernel,
    FlashAttn4Kernel,
    FlashAttnKernel,
    ReferenceKernel,
    TorchCUDAKernel,
    band_mask,
)
from hf_ring.ops.schedule import Block
from hf_ring.ops.varlen import VarlenCall, varlen_calls
from testkit.aten_standin import AtenCUDAStandIn
from testkit.cuda_standins import flash_module
from testkit.cudnn_standin import CudnnStandIn
from testkit.flash3_standin import FlashAttn3StandIn, fa3_window
from testkit.flash4_standin import FlashAttn4StandIn, fa4_window
from testkit.flash_rules import flash_keeps, flash_mask
from testkit.flash_standin import FlashAttnStandIn
from testkit.oracle import rel_err


def _qkv(sq: int, sk: int, d: int = 16, dtype: torch.dtype = torch.bfloat16, b: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(sq * 100 + sk)
    return [torch.randn(b, s, h, d, generator=g).to(dtype) for s, h in ((sq, 4), (sk, 2), (sk, 2))]


def test_flash_standin_refuses_what_its_release_refuses() -> None:
    """[F4] sm_100 from 2.7.3 only; [F5] fp16/bf16 only; [F6] head dims <= 256, multiples of 8 from 2.7."""
    q, k, v = _qkv(4, 4)
    args = (0.0, 0.25, False, -1, -1, 0.0, None, False)
    cases = [((2, 6, 3), (10, 0), False), ((2, 7, 2), (10, 0), False), ((2, 7, 3), (10, 0), True),
             ((2, 6, 3), (9, 0), True), ((2, 8, 3), (7, 5), False)]  # fmt: skip
    for version, capability, ok in cases:
        fa = FlashAttnStandIn(version, capability)
        if ok:
            fa.fwd(q, k, v, *args)
        else:
            with pytest.raises(RuntimeError, match="Ampere GPUs or newer"):
                fa.fwd(q, k, v, *args)
    fa = FlashAttnStandIn()
    with pytest.raises(RuntimeError, match="only support fp16 and bf16"):
        fa.fwd(*(t.float() for t in (q, k, v)), *args)
    with pytest.raises(RuntimeError, match="at most 256"):
        fa.fwd(*_qkv(4, 4, 264), *args)
    with pytest.raises(RuntimeError, match="multiple of 8"):
        fa.fwd(*_qkv(4, 4, 36), *args)
    FlashAttnStandIn((2, 6, 3)).fwd(*_qkv(4, 4, 36), *args)  # 2.6.x pads in C++


def test_flash_standin_rows_without_keys() -> None:
    """[F9] out 0, lse +inf for a row that sees no key (causal bottom-right, Sq > Sk); [F10] the backward
    reads an lse of +inf as p = 0, and -inf as 0 (so it would weigh visible keys by exp(s)); [F2] a varlen
    call's rows of no sequence stay as ``torch::empty`` left them (NaN here)."""
    fa = FlashAttnStandIn()
    q, k, v = _qkv(6, 2)
    out, lse, _, _ = fa.fwd(q, k, v, 0.0, 0.25, True, -1, -1, 0.0, None, False)
    assert torch.isposinf(lse[:, :, :4]).all() and (out[:, :4] == 0).all() and torch.isfinite(lse[:, :, 4:]).all()
    dq, dk, dv = (torch.empty_like(t) for t in (q, k, v))
    fa.bwd(out, q, k, v, out, lse, dq, dk, dv, 0.0, 0.25, True, -1, -1, 0.0, None, False)
    assert (dq[:, :4] == 0).all()
    lse0 = lse.clone()
    lse0[:, :, 5] = -math.inf  # a row that does see keys, with lse -inf: p = exp(s), not 0 and not NaN
    fa.bwd(out, q, k, v, out, lse0, dq, dk, dv, 0.0, 0.25, True, -1, -1, 0.0, None, False)
    assert torch.isfinite(dq).all() and (dq[:, 5].float().abs().sum() > 0)
    qv, kv, vv = (t[0] for t in _qkv(5, 6))
    cu_q, cu_k = torch.tensor([0, 2, 4], dtype=torch.int32), torch.tensor([0, 3, 6], dtype=torch.int32)
    out, lse, _, _ = fa.varlen_fwd(qv, kv, vv, cu_q, cu_k, 2, 3, 0.0, 0.25, False)
    assert torch.isnan(out[4]).all() and torch.isnan(lse[:, 4]).all() and torch.isfinite(out[:4].float()).all()


def test_flash_standin_varlen_window_clamps_against_max_seqlen_k() -> None:
    """[F2] one sequence of 6 queries and 2 keys with ``window=(0, 3)``: against its own Sk the right edge
    3 >= 2 would clamp to Sk; the call's max_seqlen_k of 4 keeps it, so its first row sees no key."""
    fa = FlashAttnStandIn()
    q, k, v = (t[0] for t in _qkv(10, 6))
    cu_q, cu_k = torch.tensor([0, 6, 10], dtype=torch.int32), torch.tensor([0, 2, 6], dtype=torch.int32)
    _, lse, _, _ = fa.varlen_fwd(q, k, v, cu_q, cu_k, 6, 4, 0.0, 0.25, False, 0, 3)
    assert torch.isposinf(lse[:, 0]).all() and torch.isfinite(lse[:, 1:6]).all()
    _, dense, _, _ = fa.fwd(q[None, :6], k[None, :2], v[None, :2], 0.0, 0.25, False, 0, 3, 0.0, None, False)
    assert torch.isposinf(dense[0, :, :2]).all()  # dense: clamped to Sk = 2, rows 0 and 1 see nothing


def test_aten_standin_capabilities() -> None:
    """[T1] torch's flash op on sm_80+ (sm_100 too); [T7] the memory-efficient op's kernels: bf16 from
    sm_80, fp16/fp32 from sm_50, through sm_121, head dims up to 65536 (512 runs)."""
    q, k, v = (t.transpose(1, 2) for t in _qkv(4, 4))
    AtenCUDAStandIn(capability=(10, 0))._scaled_dot_product_flash_attention(q, k, v, scale=0.25)
    with pytest.raises(RuntimeError, match="Ampere"):
        AtenCUDAStandIn(capability=(7, 5))._scaled_dot_product_flash_attention(q, k, v, scale=0.25)
    q, k, v = (torch.randn(1, 4, 2, 512).bfloat16() for _ in range(3))
    args = (None, None, None, None, None, 0.0, 0, True)
    for capability, dtype, ok in [((10, 0), torch.bfloat16, True), ((7, 5), torch.bfloat16, False),
                                  ((7, 5), torch.float16, True), ((13, 0), torch.float16, False)]:  # fmt: skip
        run = AtenCUDAStandIn(capability=capability)._efficient_attention_forward
        if ok:
            run(q.to(dtype), k.to(dtype), v.to(dtype), *args, scale=0.1)
        else:
            with pytest.raises(RuntimeError, match="no kernel found"):
                run(q.to(dtype), k.to(dtype), v.to(dtype), *args, scale=0.1)


@pytest.mark.parametrize("name", ["flash_attn", "flash_attn_varlen", "torch_cuda"])
def test_cuda_kernels_give_rows_without_keys_minus_inf(name: str) -> None:
    """flash kernels mark a row without keys with lse +inf; the kernels hand the ring -inf (and out 0),
    which the merge and the sinks take as "no keys": the same as the reference kernel."""
    q, k, v = _qkv(6, 2)
    band = (6, 0) if name == "torch_cuda" else (0, 0)  # causal bottom-right is the band (Sk, 0)
    ref_out, ref_lse = ReferenceKernel().forward(q, k, v, causal=False, scale=0.25, window=band)
    assert torch.isneginf(ref_lse[:, :4]).all()
    if name == "torch_cuda":
        out, lse = TorchCUDAKernel(ops=AtenCUDAStandIn()).forward(q, k, v, causal=True, scale=0.25)
    else:
        kernel = FlashAttnKernel(module=flash_module((2, 8, 3), (9, 0)))
        if name == "flash_attn":
            out, lse = kernel.forward(q, k, v, causal=False, scale=0.25, window=(0, 0))
        else:
            cu = torch.tensor([0, 6], dtype=torch.int32), torch.tensor([0, 2], dtype=torch.int32)
            out, lse = kernel.varlen_forward(q[0], k[0], v[0], *cu, 6, 2, causal=False, scale=0.25, window=(0, 0))
            out, lse = out[None], lse[None]
    assert torch.isneginf(lse[:, :4]).all() and not torch.isposinf(lse).any() and (out[:, :4] == 0).all()
    assert rel_err(out[:, 4:], ref_out[:, 4:]) <= 1e-2


def test_varlen_calls_one_per_mask_kind() -> None:
    """A step's blocks: unmasked blocks with the same query rows share a sequence; each band is one call;
    blocks a band ``(L, 0)`` computes exactly join it; sequences of one kind that would share query rows
    go to a second call of that kind."""
    blocks = (
        Block((0, 4), (0, 4), True, unit=0),  # square causal, 4 <= L + 1: joins the band (3, 0)
        Block((4, 10), (0, 9), False, unit=0, window=(3, 0)),
        Block((10, 11), (9, 13), False, unit=0),  # one row, 4 keys: joins the band
        Block((11, 14), (13, 15), False, unit=0),  # unmasked
        Block((11, 14), (20, 22), False, unit=0),  # same query rows: the same sequence
        Block((14, 17), (22, 30), False, unit=0, window=(2, 5)),
        Block((15, 17), (30, 33), False, unit=0, window=(2, 5)),  # overlaps the previous one's rows
    )
    calls = varlen_calls(blocks, 40, 1, torch.device("cpu"))
    assert all(isinstance(c, VarlenCall) for c in calls)
    kinds = sorted((c.causal, c.window or (-1, -1), len(c.cu_q) - 1) for c in calls)
    assert kinds == [(False, (-1, -1), 1), (False, (2, 5), 1), (False, (2, 5), 1), (False, (3, 0), 3)], kinds
    unmasked = next(c for c in calls if c.window is None)
    assert unmasked.k_idx.tolist() == [13, 14, 20, 21]


# --------------------------------------------------------------------------- cuDNN, flash-attn 3 and 4


def test_cudnn_standin_refuses_what_torch_refuses() -> None:
    """[D1] cuDNN 9+, sm_80-sm_121; [D2] fp16/bf16; [D3] head dims multiples of 8, at most 128 (256 only in d256
    builds on sm_90/sm_10x, their backward <= 128, (192, 128), (256, 256)); [D4] no key sequence of one row."""
    q, k, v = (t.transpose(1, 2) for t in _qkv(8, 8, 16))
    args = (None, True, 0.0, True, False)
    CudnnStandIn()._scaled_dot_product_cudnn_attention(q, k, v, *args, scale=0.25)
    for standin, match in [(CudnnStandIn(capability=(7, 5)), r"\[sm80, sm121\]"), (CudnnStandIn(version=8907), "9.0.0"),
                           (CudnnStandIn(capability=(12, 2)), r"\[sm80, sm121\]")]:  # fmt: skip
        with pytest.raises(RuntimeError, match=match):
            standin._scaled_dot_product_cudnn_attention(q, k, v, *args, scale=0.25)
    fresh = CudnnStandIn()
    with pytest.raises(RuntimeError, match="fp16/bf16"):
        fresh._scaled_dot_product_cudnn_attention(q.float(), k.float(), v.float(), *args, scale=0.25)
    big = [t.transpose(1, 2) for t in _qkv(8, 8, 136)]
    with pytest.raises(RuntimeError, match="cuDNN limit"):
        fresh._scaled_dot_product_cudnn_attention(*big, *args, scale=0.1)
    CudnnStandIn(version=92300, d256=True)._scaled_dot_product_cudnn_attention(*big, *args, scale=0.1)
    with pytest.raises(RuntimeError, match="multiple of 8"):
        fresh._scaled_dot_product_cudnn_attention(*(t.transpose(1, 2) for t in _qkv(8, 8, 36)), *args, scale=0.1)
    with pytest.raises(RuntimeError, match="key/value sequence length 1"):
        fresh._scaled_dot_product_cudnn_attention(*(t.transpose(1, 2) for t in _qkv(8, 1)), *args, scale=0.1)


def test_cudnn_kernel_layouts_and_one_key_blocks() -> None:
    """[D5] K/V keep their heads, dK/dV come back with them; [D6] the output in the query's memory order and
    ``logsumexp [B, H, Sq, 1]`` float32, which the backward gets back; [D4] a block of one key runs on the
    reference kernel (exact), never on cuDNN."""
    ops = CudnnStandIn(allow_fp32=True)
    kernel = CudnnKernel(ops=ops, version=ops.version)
    q, k, v = (t.float() for t in _qkv(7, 9, 40))
    out, lse = kernel.forward(q, k, v, causal=False, scale=0.3)
    grads = kernel.backward(out, q, k, v, out, lse, causal=False, scale=0.3)
    fwd, bwd = ops.calls["fwd"][0], ops.calls["bwd"][0]
    assert fwd["k"].shape == (1, 2, 9, 40) and fwd["q"].stride(2) == 4 * 40  # [B, H, S, D] views of [B, S, H, D]
    assert bwd["lse"].shape == (1, 4, 7, 1) and bwd["lse"].dtype == torch.float32
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]
    ref_out, ref_lse = ReferenceKernel().forward(q.double(), k.double(), v.double(), causal=False, scale=0.3)
    assert rel_err(out, ref_out) <= 1e-5 and rel_err(lse, ref_lse) <= 1e-5
    q1, k1, v1 = (t.float() for t in _qkv(5, 1, 40))
    calls = len(ops.calls["fwd"])
    out1, lse1 = kernel.forward(q1, k1, v1, causal=False, scale=0.3)
    assert len(ops.calls["fwd"]) == calls and torch.allclose(out1, v1.repeat_interleave(2, 2).expand_as(out1))


def test_cudnn_backward_takes_grad_out_in_any_layout() -> None:
    """[D9] torch lays dO out like O before the graph is built (``permute_to_matching_layout``), so a ``grad_out``
    whose last stride is not 1 gives the same gradients as a contiguous one; ``out`` keeps its unit last stride."""
    ops = CudnnStandIn(allow_fp32=True)
    q, k, v = (t.float().transpose(1, 2) for t in _qkv(6, 9, 16))
    out, lse = ops._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, True, scale=0.25)[:2]
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(3))
    strided = dout.transpose(-1, -2).contiguous().transpose(-1, -2)  # same values, last stride Sq
    assert strided.stride(-1) != 1 and torch.equal(strided, dout)
    rest = (lse, None, None, None, None, None, 6, 9, 0.0, True)
    ref = ops._scaled_dot_product_cudnn_attention_backward(dout, q, k, v, out, *rest, scale=0.25)
    got = ops._scaled_dot_product_cudnn_attention_backward(strided, q, k, v, out, *rest, scale=0.25)
    assert all(torch.equal(a, b) for a, b in zip(ref, got))
    out_t = out.transpose(-1, -2).contiguous().transpose(-1, -2)
    with pytest.raises(RuntimeError, match="out must have a contiguous last dimension"):
        ops._scaled_dot_product_cudnn_attention_backward(dout, q, k, v, out_t, *rest, scale=0.25)


def test_fa3_window_rule_never_changes_a_band() -> None:
    """[H6] flash-attn 3 clamps ``left >= Sk - 1`` and ``right >= Sq - 1`` to ``-1`` and then reads ``-1`` as
    ``Sk - 1`` / ``Sq - 1``: for every block shape and band the mask is the band itself (flash-attn 2's clamp
    against ``Sk`` does change some: rows ``< Sq - 2 Sk`` lose their keys)."""
    changed_fa2 = 0
    for sq, sk, left, right in itertools.product(range(1, 9), range(1, 9), range(0, 10), range(0, 10)):
        band = band_mask(sq, sk, (left, right))
        for forward in (True, False):
            assert torch.equal(flash_mask(sq, sk, fa3_window(False, left, right, sq, sk, forward)), band)
        changed_fa2 += not torch.equal(flash_keeps(sq, sk, False, (left, right)), band)
        if right == 0:
            assert torch.equal(flash_mask(sq, sk, fa3_window(True, -1, -1, sq, sk)), band_mask(sq, sk, (sq + sk, 0)))
    assert changed_fa2 > 0


def test_fa3_standin_gpus_builds_and_rows_without_keys() -> None:
    """[H1] sm_8x and sm_90 (sm_100's cubins are missing: the sm_90a kernels do not run there); [H7] a build
    without local attention refuses a band; [H9] a row without keys: out 0, lse -inf (seqlen_k == 0: +inf, which
    the kernel hands the ring as -inf)."""
    q, k, v = _qkv(6, 2)
    for capability, ok in [((8, 0), True), ((9, 0), True), ((10, 0), False), ((7, 5), False)]:
        fa = FlashAttn3StandIn(capability)
        if ok:
            fa.fwd(q, k, v, softmax_scale=0.25)
        else:
            with pytest.raises(RuntimeError, match="Ampere|no kernel image"):
                fa.fwd(q, k, v, softmax_scale=0.25)
    with pytest.raises(RuntimeError, match="does not support local attention"):
        FlashAttn3StandIn(build_flags={"FLASHATTENTION_DISABLE_LOCAL": True}).fwd(q, k, v, window_size_left=2)
    out, lse, *_ = FlashAttn3StandIn().fwd(q, k, v, softmax_scale=0.25, window_size_left=0, window_size_right=0)
    assert torch.isneginf(lse[:, :, :4]).all() and (out[:, :4] == 0).all() and torch.isfinite(lse[:, :, 4:]).all()
    kernel = FlashAttn3Kernel(module=FlashAttn3StandIn().module())
    _, empty = kernel.forward(q, k[:, :0], v[:, :0], causal=False, scale=0.25)
    assert torch.isneginf(empty).all()
    assert kernel.refuses((10, 0), torch.bfloat16, 128, False, False)
    assert not kernel.refuses((9, 0), torch.bfloat16, 256, True, True)
    narrow = FlashAttn3Kernel(module=kernel.fa, build_flags={"FLASHATTENTION_DISABLE_HDIM256": True,
                                                             "FLASHATTENTION_DISABLE_SOFTCAP": True})  # fmt: skip
    assert "head_dim 256 > 192" in narrow.refuses((9, 0), torch.bfloat16, 256, False, False)
    assert "soft-capping" in narrow.refuses((9, 0), torch.bfloat16, 128, True, False)


def test_fa4_standin_archs_head_dims_and_windows() -> None:
    """[B1] the forward runs on sm_80, the backward from sm_90; [B3] head dims up to 128 on sm_100 (256 on
    sm_90); [B5] ``None`` edges are unbounded and there are no clamps: any band is the band; [B6] rows without
    keys: lse -inf."""
    q, k, v = _qkv(6, 2)
    FlashAttn4StandIn((8, 0))._fwd(q, k, v)
    out, lse, *_ = FlashAttn4StandIn((8, 0))._fwd(q, k, v, window_size_left=0, window_size_right=0, return_lse=True)
    assert torch.isneginf(lse[:, :, :4]).all() and (out[:, :4] == 0).all()
    with pytest.raises(AssertionError, match="Supported: 9.x"):
        FlashAttn4StandIn((8, 0))._bwd(q, k, v, out, out, lse)
    big = _qkv(4, 4, 256)
    FlashAttn4StandIn((9, 0))._fwd(*big)
    with pytest.raises(AssertionError, match=r"\(256, 256\) is not supported"):
        FlashAttn4StandIn((10, 0))._fwd(*big)
    for sq, sk, left, right in itertools.product(range(1, 7), range(1, 7), range(0, 8), range(0, 8)):
        assert torch.equal(flash_mask(sq, sk, fa4_window(False, left, right, sq, sk)), band_mask(sq, sk, (left, right)))
    assert torch.equal(flash_mask(3, 5, fa4_window(False, None, 0, 3, 5)), torch.ones(3, 5, dtype=torch.bool).tril(2))
    kernel = FlashAttn4Kernel(module=FlashAttn4StandIn().module(), capability=(10, 0))
    assert "head_dim 256 > 128 on sm_100" in kernel.refuses((10, 0), torch.bfloat16, 256, False, False)
    assert kernel.refuses((8, 0), torch.bfloat16, 64, False, False)
    assert not kernel.refuses((9, 0), torch.bfloat16, 256, True, True)
