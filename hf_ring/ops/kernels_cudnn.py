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
The rows and file lines: ``docs/standins.md`` (D1-D9).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from .kernels_cpu import ReferenceKernel
from .kernels_cuda import _HALF, _beyond, _pad8, _sm

__all__ = ["CudnnKernel"]

_MAX_HEAD_DIM = 128  # check_cudnn_tensor_shapes' head_dim_limit without the d256 builds
_MIN_VERSION = 90000  # can_use_cudnn_attention: "cuDNN version too old to use cuDNN Attention (< v9.0.0)"


def _no_band(window: tuple[int, int] | None) -> None:
    if window is not None:
        raise ValueError(
            "backend='cudnn' has no sliding-window (band) mask (torch's cuDNN attention op takes none); "
            "backend='auto' runs windowed layers on flash-attn 3/4 or 2, else on the reference kernel."
        )


class CudnnKernel:
    """cuDNN attention (``aten._scaled_dot_product_cudnn_attention`` and ``_backward``), fp16/bf16, CUDA.

    ``ops``: the op namespace (``torch.ops.aten``; a stand-in in tests); ``version``: the cuDNN runtime
    (``torch.backends.cudnn.version()``, e.g. ``91002``). Blocks with a single key row (which cuDNN does
    not take) run on the reference kernel, exactly. The backward gets the forward's ``logsumexp`` layout
    back (``[B, H, Sq, 1]`` float32) and ``out`` may be the merged attention's.
    """

    name = "cudnn"
    softcap = False
    window = False
    heads_major = False

    def __init__(self, ops: Any = None, version: int | None = None) -> None:
        self.ops = ops if ops is not None else torch.ops.aten
        self.version = int(version if version is not None else (torch.backends.cudnn.version() or 0))
        self._one_key = ReferenceKernel()

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
        d = q.shape[-1]
        qp, kp, vp = (_pad8(t).transpose(1, 2) for t in (q, k, v))
        res = self.ops._scaled_dot_product_cudnn_attention(qp, kp, vp, None, True, 0.0, causal, False, scale=scale)
        return res[0].transpose(1, 2)[..., :d], res[1][..., 0].transpose(1, 2)

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
        # dO in the output's memory order (cuDNN before 9.5.1 assumes the same strides)
        dop, qp, kp, vp, op = (_pad8(t).contiguous().transpose(1, 2) for t in (dout, q, k, v, out))
        lse4 = lse.transpose(1, 2).to(torch.float32).contiguous().unsqueeze(-1)  # [B, H, Sq, 1], as returned
        seed = torch.empty((), dtype=torch.int64, device=q.device)  # read only with dropout
        dq, dk, dv = self.ops._scaled_dot_product_cudnn_attention_backward(
            dop, qp, kp, vp, op, lse4, seed, seed, None, None, None, sq, sk, 0.0, causal, scale=scale
        )
        return dq.transpose(1, 2)[..., :d], dk.transpose(1, 2)[..., :d], dv.transpose(1, 2)[..., :d]
