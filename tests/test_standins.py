"""The attention stand-ins keep the libraries' rules (``docs/standins.md``, "Attention kernels"), and the
CUDA kernels hand the ring ``lse = -inf`` for rows that see no key; the varlen grouping of a ring step."""

from __future__ import annotations

import math

import pytest
import torch

from hf_ring.ops.kernels import FlashAttnKernel, ReferenceKernel, TorchCUDAKernel
from hf_ring.ops.schedule import Block
from hf_ring.ops.varlen import VarlenCall, varlen_calls
from testkit.aten_standin import AtenCUDAStandIn
from testkit.cuda_standins import flash_module
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
