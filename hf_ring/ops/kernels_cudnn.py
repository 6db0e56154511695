"""cuDNN attention through torch as a block kernel (``CudnnKernel``). This module imports only torch.

torch 2.13's ``aten._scaled_dot_product_cudnn_attention`` and ``_scaled_dot_product_cudnn_attention_backward``
(schemas in ``native_functions.yaml``; the dense path of ``aten/src/ATen/native/cudnn/MHA.cpp``)::

    _scaled_dot_product_cudnn_attention(query, key, value, attn_bias, compute_log_sumexp, dropout_p=0.,
        is_causal=False, return_debug_mask=False, *, scale=None)
        -> (output, logsumexp [B, H, Sq, 1] float32, cum_seq_q, cum_seq_k, max_q, max_k, philox_seed,
            philox_offset, debug_attn_mask)
    _scaled_dot_product_cudnn_attention_backward(grad_out, query, key, value, out, logsumexp, philox_seed,
        philox_offset, attn_bias, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal, *, scale=None)
        -> (grad_query, grad_key, grad_value)

Tensors are ``[B, H, S, D]``; cuDNN reads them through their strides, so ``[B, S, H, D]`` memory goes in as
transposed views and the output comes back in the query's memory order. K/V may have fewer heads (the
graph takes each tensor's own head count; dK/dV come back with ``Hkv`` heads). The rules ``refuses`` keeps
are those torch checks before it picks this op (``sdp_utils.cpp`` ``can_use_cudnn_attention``): sm_80 to
sm_121, fp16/bf16, head dims that are multiples of 8 and at most 128 (the larger ones only some builds
have, so they are refused here), no key block of one row, cuDNN 9 or newer. Causal is aligned top-left
(``set_causal_mask``); the ring asks for it on square blocks only. There is no band and no soft-capping.

Three rules of the cuDNN releases torch ships decide which blocks go to cuDNN at all (the others run on
torch's flash op, ``TorchCUDAKernel``, exactly; a block of one key row on the reference kernel):

* D10: below cuDNN 9.26 the sm_90 backward returns NaN in dQ for rows whose log-sum-exp is below
  ``-ln(FLT_MAX)`` when ``s_kv % 128 == 64`` (pytorch#196678, cudnn-frontend#628). hf_ring hands the backward
  the merged LSE, which makes such rows rare, not impossible, and reading the LSE to find them would stop the
  host; so every backward of such a key length runs on torch's flash op there.
* D11: cuDNN 9.19-9.25.0 (except 9.24.1) on sm_10x/sm_11x: newer torch refuses a query block of one row
  (``check_cudnn_sdpa_decode``, for wrong results on B200, pytorch#193893); such blocks never go to cuDNN there.
* D12: with ``TORCH_CUDNN_SDPA_AVOID_RECOMPILE=1`` (read once, as torch's ``check_env``: only ``"1"`` sets it)
  and ``[B, S, H, D]``-contiguous tensors torch takes its ragged path: the forward lays the stats out as
  ``[B, Sq, H, 1]`` memory and the backward offsets each batch row by ``stats.stride(-2)``; the backward is
  handed that layout then (the contiguous ``[B, H, Sq, 1]`` one reads other rows' LSE when ``B > 1``). A forward
  whose stats show torch deciding otherwise than the variable says raises.

The rows and file lines: ``docs/standins.md`` (D1-D12).
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import Tensor

from .kernels_cpu import ReferenceKernel
from .kernels_cuda import _HALF, TorchCUDAKernel, _beyond, _pad8, _sm

__all__ = ["CudnnKernel", "decode_disabled", "lse_nan_backward", "ragged_env"]

_MAX_HEAD_DIM = 128  # check_cudnn_tensor_shapes' head_dim_limit without the d256 builds
_MIN_VERSION = 90000  # can_use_cudnn_attention: "cuDNN version too old to use cuDNN Attention (< v9.0.0)"
_LSE_NAN_FIXED = 92600  # D10: the sm_90 backward's KV-tail mask, fixed in the cuDNN 9.26 backend
_DECODE_OFF = (91900, 92500, 92401)  # D11: s_q == 1 refused for 9.19 <= version <= 9.25.0, except 9.24.1
RAGGED_ENV = "TORCH_CUDNN_SDPA_AVOID_RECOMPILE"  # D12


def lse_nan_backward(version: int, capability: tuple[int, int] | None, s_kv: int) -> bool:
    """[D10] Whether cuDNN's backward of a block with ``s_kv`` keys gives NaN dQ rows for an LSE below
    ``-ln(FLT_MAX)`` on this GPU (``None``: unknown, taken as affected)."""
    return s_kv % 128 == 64 and version < _LSE_NAN_FIXED and (capability is None or capability[0] == 9)


def decode_disabled(version: int, capability: tuple[int, int] | None) -> bool:
    """[D11] Whether cuDNN attention must not get a query block of one row on this GPU (``None``: unknown, taken
    as sm_10x)."""
    low, high, spared = _DECODE_OFF
    return (capability is None or capability[0] in (10, 11)) and low <= version <= high and version != spared


def ragged_env() -> bool:
    """[D12] ``TORCH_CUDNN_SDPA_AVOID_RECOMPILE`` as torch reads it (``c10::utils::check_env(...) == true``)."""
    return os.environ.get(RAGGED_ENV) == "1"


def _no_band(window: tuple[int, int] | None) -> None:
    if window is not None:
        raise ValueError(
            "backend='cudnn' has no sliding-window (band) mask (torch's cuDNN attention op takes none); "
            "backend='auto' runs windowed layers on flash-attn 3/4 or 2, else on the reference kernel."
        )


class CudnnKernel:
    """cuDNN attention (``aten._scaled_dot_product_cudnn_attention`` and ``_backward``), fp16/bf16, CUDA.

    ``ops``: the op namespace (``torch.ops.aten``; a stand-in in tests); ``version``: the cuDNN runtime
    (``torch.backends.cudnn.version()``, e.g. ``91002``); ``capability``: the GPU's (``None``: unknown, every
    rule below taken as applying); ``avoid_recompile``: whether torch runs its ragged dense path (``None``: read
    ``TORCH_CUDNN_SDPA_AVOID_RECOMPILE`` now, as torch does once). Blocks with a single key row (which cuDNN
    does not take) run on the reference kernel, exactly; blocks the cuDNN release gets wrong or refuses (the
    backward of a key length ``64 mod 128`` below 9.26 on sm_90, a query row alone on sm_10x/sm_11x with
    9.19-9.25.0) on torch's flash op (``self.other``), exactly. The backward gets the forward's
    ``logsumexp`` layout back (``[B, H, Sq, 1]`` float32; ``[B, Sq, H, 1]`` memory on torch's ragged path) and
    ``out`` may be the merged attention's.
    """

    name = "cudnn"
    softcap = False
    window = False
    heads_major = False

    def __init__(
        self, ops: Any = None, version: int | None = None, capability: tuple[int, int] | None = None,
        avoid_recompile: bool | None = None,
    ) -> None:  # fmt: skip
        self.ops = ops if ops is not None else torch.ops.aten
        self.version = int(version if version is not None else (torch.backends.cudnn.version() or 0))
        self.capability = capability
        self.ragged = ragged_env() if avoid_recompile is None else bool(avoid_recompile)
        self._one_key = ReferenceKernel()
        self.other = TorchCUDAKernel(ops=self.ops)  # torch's flash op: the same namespace holds it

    def refuses(self, capability: tuple[int, int] | None, dtype: torch.dtype, head_dim: int | None,
                softcap: bool, window: bool) -> str:  # fmt: skip
        """Why this kernel cannot run a layer (``""``: it can): cuDNN >= 9.0, sm_80-sm_121, fp16/bf16, head
        dims up to 128, no cap, no band."""
        if self.version < _MIN_VERSION:
            return f"torch's cuDNN attention needs cuDNN 9.0 or newer, this torch has {self.version or 'none'}"
        if capability is not None and not 80 <= capability[0] * 10 + capability[1] <= 121:
            return f"cuDNN attention runs on sm_80-sm_121, this GPU is {_sm(capability)}"
        if dtype not in _HALF:
            return f"cuDNN attention takes float16/bfloat16 only, not {dtype}"
        return _beyond("cuDNN attention", head_dim, _MAX_HEAD_DIM, softcap, window)

    def _check(self, q: Tensor, k: Tensor) -> None:
        d = q.shape[-1]
        if d > _MAX_HEAD_DIM:
            raise ValueError(
                f"head_dim {d} > {_MAX_HEAD_DIM}: backend='cudnn' has no kernel above {_MAX_HEAD_DIM} here. Use "
                "backend='auto' (flash-attn 3 takes up to 256; torch's memory-efficient op any)."
            )

    def forward(
        self, q: Tensor, k: Tensor, v: Tensor, *, causal: bool, scale: float, window: tuple[int, int] | None = None
    ) -> tuple[Tensor, Tensor]:
        """``q [B, Sq, Hq, D]``, ``k, v [B, Sk, Hkv, D]`` -> ``out [B, Sq, Hq, D]``, ``lse [B, Sq, Hq]`` float32."""
        _no_band(window)
        self._check(q, k)
        if k.shape[1] == 1:  # cuDNN takes no key sequence of length 1 (check_cudnn_tensor_shapes)
            return self._one_key.forward(q, k, v, causal=causal, scale=scale)
        if q.shape[1] == 1 and decode_disabled(self.version, self.capability):  # [D11]
            return self.other.forward(q, k, v, causal=causal, scale=scale)
        d = q.shape[-1]
        qb, kb, vb = (_pad8(t) for t in (q, k, v))
        res = self.ops._scaled_dot_product_cudnn_attention(
            qb.transpose(1, 2), kb.transpose(1, 2), vb.transpose(1, 2), None, True, 0.0, causal, False, scale=scale
        )
        self._same_path(res[1], qb, kb, vb)
        return res[0].transpose(1, 2)[..., :d], res[1][..., 0].transpose(1, 2)

    def _same_path(self, stats: Tensor, *bshd: Tensor) -> None:
        """[D12] The forward's stats show which dense path torch took: ``[B, Sq, H, 1]`` memory on the ragged
        one, which it takes iff the variable is set and q, k, v (and so the output) are ``[B, S, H, D]``
        memory. A disagreement means the variable changed after torch read it: the backward's layout would
        be the wrong one."""
        h = stats.shape[1]
        if h == 1 or stats.shape[2] == 1:  # the two layouts coincide
            return
        ragged = stats.stride(2) == h
        if ragged != (self.ragged and all(t.is_contiguous() for t in bshd)):
            raise RuntimeError(
                f"torch's cuDNN attention {'took' if ragged else 'did not take'} its ragged path "
                f"({RAGGED_ENV}) but hf_ring read the variable as {'unset' if not self.ragged else 'set'} when "
                f"it built this kernel: set or unset {RAGGED_ENV} before the first attention call of the process "
                "and leave it so (torch reads it once), or use backend='torch'."
            )

    def backward(
        self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, *, causal: bool, scale: float,
        window: tuple[int, int] | None = None,
    ) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
        """Gradients shaped like ``q, k, v``; ``out``/``lse`` may be those of the merged attention."""
        _no_band(window)
        self._check(q, k)
        if k.shape[1] == 1:
            return self._one_key.backward(dout, q, k, v, out, lse, causal=causal, scale=scale)
        d, sq, sk = q.shape[-1], q.shape[1], k.shape[1]
        if (sq == 1 and decode_disabled(self.version, self.capability)) or lse_nan_backward(
            self.version, self.capability, sk
        ):  # [D11], [D10]
            return self.other.backward(dout, q, k, v, out, lse, causal=causal, scale=scale)
        # dO in the output's memory order (cuDNN before 9.5.1 assumes the same strides); all [B, S, H, D] memory,
        # so torch takes its ragged path iff the variable is set [D12]
        dop, qp, kp, vp, op = (_pad8(t).contiguous().transpose(1, 2) for t in (dout, q, k, v, out))
        if self.ragged:  # [B, Sq, H, 1] memory: each batch row starts at b * Sq * stats.stride(-2)
            lse4 = lse.to(torch.float32).contiguous().unsqueeze(-1).transpose(1, 2)
        else:
            lse4 = lse.transpose(1, 2).to(torch.float32).contiguous().unsqueeze(-1)  # [B, H, Sq, 1], as returned
        seed = torch.empty((), dtype=torch.int64, device=q.device)  # read only with dropout
        dq, dk, dv = self.ops._scaled_dot_product_cudnn_attention_backward(
            dop, qp, kp, vp, op, lse4, seed, seed, None, None, None, sq, sk, 0.0, causal, scale=scale
        )
        return dq.transpose(1, 2)[..., :d], dk.transpose(1, 2)[..., :d], dv.transpose(1, 2)[..., :d]
