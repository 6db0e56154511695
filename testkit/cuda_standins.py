"""Stand-ins for the CUDA attention libraries, run on CPU (judged by ``testkit.oracle``).

* flash-attn 2.6.3 - 2.8.3: ``testkit.flash_standin.FlashAttnStandIn`` (its checks, window preprocessing
  and mask: ``testkit.flash_rules``). ``FAKES`` names the interface forms ``FlashAttnKernel`` meets:
  ``"2.8-custom-op"`` (``torch.library`` custom ops, as flash-attn >= 2.7 registers them on torch >= 2.4:
  Python signature ``(*args, **kwargs)``), ``"2.7-plain"`` (plain functions) and ``"2.6"`` (one
  ``window_size`` tuple, 8-tuple returns, no varlen). They answer for a 2.8.3 (2.6.3) release on an sm_90
  GPU and take float32 too (``allow_fp32``, a test allowance), so the glue is compared with float64 tightly.
* torch's aten CUDA ops: ``testkit.aten_standin.AtenCUDAStandIn``; its cuDNN attention ops:
  ``testkit.cudnn_standin.CudnnStandIn``.
* flash-attn 3: ``testkit.flash3_standin.FlashAttn3StandIn``; ``FA3_FAKES`` names the interface forms
  ``FlashAttn3Kernel`` meets: ``"custom-op"`` (``torch.library`` custom ops with separate window edges, as since
  2025-07) and ``"plain"`` (plain functions with one ``window_size`` tuple, 2025-03 .. 2025-07); sm_90.
* flash-attn 4: ``testkit.flash4_standin.FlashAttn4StandIn`` (sm_100).

Every rule of the stand-ins is listed, with the library file, lines and versions, in
``docs/standins.md`` ("Attention kernels").
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import Tensor

from hf_ring.ops.kernels import (
    BlockKernel,
    CudnnKernel,
    FlashAttn3Kernel,
    FlashAttn4Kernel,
    FlashAttnKernel,
    TorchCUDAKernel,
    TorchEfficientKernel,
    get_kernel,
)
from testkit.aten_standin import AtenCUDAStandIn
from testkit.cudnn_standin import CudnnStandIn
from testkit.flash3_standin import FlashAttn3StandIn
from testkit.flash4_standin import FlashAttn4StandIn
from testkit.flash_standin import FlashAttnStandIn

__all__ = [
    "ATEN_FP32",
    "FA3_FAKES",
    "FAKES",
    "KERNELS",
    "NEW_KERNELS",
    "TOL",
    "AtenCUDAStandIn",
    "FlashAttnStandIn",
    "flash_module",
    "inputs",
    "make_kernel",
]

# --------------------------------------------------------------------------- flash-attn

DEFAULT = FlashAttnStandIn(version=(2, 8, 3), capability=(9, 0), allow_fp32=True)


def flash_attn_forward(
    q: Tensor, k: Tensor, v: Tensor, dropout_p: float, softmax_scale: float, causal: bool, window_size_left: int,
    window_size_right: int, softcap: float, alibi_slopes: Tensor | None, return_softmax: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    """``_flash_attn_forward`` (2.7+), the default stand-in."""
    return DEFAULT.fwd(q, k, v, dropout_p, softmax_scale, causal, window_size_left, window_size_right, softcap,
                       alibi_slopes, return_softmax)  # fmt: skip


def flash_attn_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, softmax_lse: Tensor, dq: Tensor | None,
    dk: Tensor | None, dv: Tensor | None, dropout_p: float, softmax_scale: float, causal: bool, window_size_left: int,
    window_size_right: int, softcap: float, alibi_slopes: Tensor | None, deterministic: bool,
    rng_state: Tensor | None = None,
) -> Tensor:  # fmt: skip
    """``_flash_attn_backward`` (2.7+), the default stand-in: fills dq, dk, dv."""
    return DEFAULT.bwd(
        dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal, window_size_left,
        window_size_right, softcap, alibi_slopes, deterministic, rng_state,
    )  # fmt: skip


def flash_attn_varlen_forward(
    q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int,
    max_seqlen_k: int, dropout_p: float, softmax_scale: float, causal: bool, window_size_left: int = -1,
    window_size_right: int = -1, softcap: float = 0.0, alibi_slopes: Tensor | None = None,
    return_softmax: bool = False, block_table: Tensor | None = None, leftpad_k: Tensor | None = None,
    seqused_k: Tensor | None = None, zero_tensors: bool = False,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    """``_flash_attn_varlen_forward`` (2.7+), the default stand-in."""
    return DEFAULT.varlen_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                              softmax_scale, causal, window_size_left, window_size_right, softcap, alibi_slopes,
                              return_softmax, block_table, leftpad_k, seqused_k, zero_tensors)  # fmt: skip


def flash_attn_varlen_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, softmax_lse: Tensor, dq: Tensor | None,
    dk: Tensor | None, dv: Tensor | None, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int,
    max_seqlen_k: int, dropout_p: float, softmax_scale: float, causal: bool, window_size_left: int,
    window_size_right: int, softcap: float, alibi_slopes: Tensor | None, deterministic: bool,
    rng_state: Tensor | None = None, zero_tensors: bool = False,
) -> Tensor:  # fmt: skip
    """``_flash_attn_varlen_backward`` (2.7+), the default stand-in: fills dq, dk, dv."""
    return DEFAULT.varlen_bwd(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                              max_seqlen_k, dropout_p, softmax_scale, causal, window_size_left, window_size_right,
                              softcap, alibi_slopes, deterministic, rng_state, zero_tensors)  # fmt: skip


DEFAULT_26 = FlashAttnStandIn(version=(2, 6, 3), capability=(9, 0), allow_fp32=True)
flash_attn_forward_26, flash_attn_backward_26 = DEFAULT_26.fwd_26, DEFAULT_26.bwd_26


def flash_attn_forward_25(q, k, v, dropout_p, softmax_scale, causal, window_size, alibi_slopes, return_softmax):
    """flash-attn 2.5's signature (no ``softcap``): ``FlashAttnKernel`` refuses it before any call."""
    raise AssertionError("not called: FlashAttnKernel refuses flash-attn without softcap")


# As in flash-attn >= 2.7 on torch >= 2.4: torch.library custom ops that declare what the real ones
# declare (2.7.0 .. 2.8.3.post1): the forwards mutate nothing, the backwards fill dq, dk, dv.
# Registered once per process, at import (workers import this module).
_fwd_op = torch.library.custom_op(
    "hf_ring_tests::flash_attn_forward", flash_attn_forward, mutates_args=(), device_types="cpu"
)
_bwd_op = torch.library.custom_op(
    "hf_ring_tests::flash_attn_backward", flash_attn_backward, mutates_args=("dq", "dk", "dv"), device_types="cpu"
)
_varlen_fwd_op = torch.library.custom_op(
    "hf_ring_tests::flash_attn_varlen_forward", flash_attn_varlen_forward, mutates_args=(), device_types="cpu"
)
_varlen_bwd_op = torch.library.custom_op(
    "hf_ring_tests::flash_attn_varlen_backward",
    flash_attn_varlen_backward,
    mutates_args=("dq", "dk", "dv"),
    device_types="cpu",
)

FAKES = {
    "2.8-custom-op": SimpleNamespace(
        __version__="2.8.3",
        _flash_attn_forward=_fwd_op,
        _flash_attn_backward=_bwd_op,
        _flash_attn_varlen_forward=_varlen_fwd_op,
        _flash_attn_varlen_backward=_varlen_bwd_op,
    ),
    "2.7-plain": SimpleNamespace(
        __version__="2.8.3",
        _flash_attn_forward=flash_attn_forward,
        _flash_attn_backward=flash_attn_backward,
        _flash_attn_varlen_forward=flash_attn_varlen_forward,
        _flash_attn_varlen_backward=flash_attn_varlen_backward,
    ),
    "2.6": SimpleNamespace(
        __version__="2.6.3", _flash_attn_forward=flash_attn_forward_26, _flash_attn_backward=flash_attn_backward_26
    ),
}


def flash_module(version: tuple[int, int, int], capability: tuple[int, int], allow_fp32: bool = False):
    """``flash_attn.flash_attn_interface`` of one release on one GPU (plain functions), with its version."""
    fa = FlashAttnStandIn(version, capability, allow_fp32).module()
    fa.__version__ = ".".join(map(str, version))
    return fa


# --------------------------------------------------------------------------- flash-attn 3

FA3 = FlashAttn3StandIn(capability=(9, 0), allow_fp32=True)


def fa3_forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    k_new: Tensor | None = None,
    v_new: Tensor | None = None,
    qv: Tensor | None = None,
    out_: Tensor | None = None,
    cu_seqlens_q: Tensor | None = None,
    cu_seqlens_k: Tensor | None = None,
    cu_seqlens_k_new: Tensor | None = None,
    seqused_q: Tensor | None = None,
    seqused_k: Tensor | None = None,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    page_table: Tensor | None = None,
    kv_batch_idx: Tensor | None = None,
    leftpad_k: Tensor | None = None,
    rotary_cos: Tensor | None = None,
    rotary_sin: Tensor | None = None,
    seqlens_rotary: Tensor | None = None,
    q_descale: Tensor | None = None,
    k_descale: Tensor | None = None,
    v_descale: Tensor | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size_left: int = -1,
    window_size_right: int = -1,
    attention_chunk: int = 0,
    softcap: float = 0.0,
    rotary_interleaved: bool = True,
    scheduler_metadata: Tensor | None = None,
    num_splits: int = 1,
    pack_gqa: bool | None = None,
    sm_margin: int = 0,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """flash-attn 3's ``_flash_attn_forward`` (its custom op's signature), on the sm_90 stand-in."""
    return FA3.fwd(q, k, v, k_new, v_new, qv, out_, cu_seqlens_q, cu_seqlens_k, cu_seqlens_k_new, seqused_q,
                   seqused_k, max_seqlen_q, max_seqlen_k, page_table, kv_batch_idx, leftpad_k, rotary_cos, rotary_sin,
                   seqlens_rotary, q_descale, k_descale, v_descale, softmax_scale, causal, window_size_left,
                   window_size_right, attention_chunk, softcap, rotary_interleaved, scheduler_metadata, num_splits,
                   pack_gqa, sm_margin)  # fmt: skip


def fa3_backward(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    softmax_lse: Tensor,
    cu_seqlens_q: Tensor | None = None,
    cu_seqlens_k: Tensor | None = None,
    sequed_q: Tensor | None = None,
    sequed_k: Tensor | None = None,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    dq: Tensor | None = None,
    dk: Tensor | None = None,
    dv: Tensor | None = None,
    softmax_scale: float | None = None,
    is_causal: bool = False,
    window_size_left: int = -1,
    window_size_right: int = -1,
    softcap: float = 0.0,
    deterministic: bool = False,
    sm_margin: int = 0,
) -> Tensor:
    """flash-attn 3's ``_flash_attn_backward`` (its custom op's signature): fills dq, dk, dv."""
    return FA3.bwd(dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, sequed_q, sequed_k, max_seqlen_q,
                   max_seqlen_k, dq, dk, dv, softmax_scale, is_causal, window_size_left, window_size_right, softcap,
                   deterministic, sm_margin)  # fmt: skip


# As flash-attn 3 registers them since 2025-07 ("flash_attn_3::_flash_attn_forward", mutates_args=() /
# ("dq", "dk", "dv")); registered once per process, at import
_fa3_fwd_op = torch.library.custom_op("hf_ring_tests::fa3_forward", fa3_forward, mutates_args=(), device_types="cpu")
_fa3_bwd_op = torch.library.custom_op(
    "hf_ring_tests::fa3_backward", fa3_backward, mutates_args=("dq", "dk", "dv"), device_types="cpu"
)
FA3_FAKES = {
    "custom-op": SimpleNamespace(_flash_attn_forward=_fa3_fwd_op, _flash_attn_backward=_fa3_bwd_op),
    "plain": FA3.module(plain=True),
}
FA4 = FlashAttn4StandIn(capability=(10, 0), allow_fp32=True)
CUDNN_FP32 = CudnnStandIn(capability=(9, 0), allow_fp32=True)


# --------------------------------------------------------------------------- kernels over the stand-ins

ATEN_FP32 = AtenCUDAStandIn(allow_fp32=True)  # shared by the parametrised tests (records nothing)


def make_kernel(name: str) -> BlockKernel:
    """``flash_attn:<fake>``: FlashAttnKernel over a flash-attn stand-in; ``torch_cuda`` / ``torch_efficient``:
    the CUDA kernels over the aten stand-in (flash ops taking float32 too); else ``get_kernel`` on CPU."""
    if name.startswith("flash_attn:"):
        return FlashAttnKernel(module=FAKES[name.split(":", 1)[1]])
    if name == "torch_cuda":
        return TorchCUDAKernel(ops=ATEN_FP32)
    if name == "torch_efficient":
        return TorchEfficientKernel(ops=ATEN_FP32)
    if name.startswith("flash_attn_3:"):
        return FlashAttn3Kernel(module=FA3_FAKES[name.split(":", 1)[1]])
    if name == "flash_attn_4":
        return FlashAttn4Kernel(module=FA4.module(), capability=(10, 0))
    if name == "cudnn":
        return CudnnKernel(ops=CUDNN_FP32, version=CUDNN_FP32.version)
    return get_kernel(name, torch.device("cpu"), torch.float32)


NEW_KERNELS = ["cudnn", *(f"flash_attn_3:{v}" for v in FA3_FAKES), "flash_attn_4"]
KERNELS = ["torch", "reference", "torch_cuda", "torch_efficient", *(f"flash_attn:{v}" for v in FAKES), *NEW_KERNELS]


TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def inputs(shape: tuple, dtype: torch.dtype, seed: int = 0) -> tuple[Tensor, ...]:
    b, sq, sk, hq, hkv, d, _ = shape
    g = torch.Generator().manual_seed(seed)
    q, k, v, dout = (
        torch.randn(b, s, h, d, generator=g, dtype=torch.float64) for s, h in ((sq, hq), (sk, hkv), (sk, hkv), (sq, hq))
    )
    return q, k, v, dout
