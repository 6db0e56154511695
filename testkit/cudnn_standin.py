"""torch's cuDNN attention ops on CPU: ``aten._scaled_dot_product_cudnn_attention`` and its ``_backward``,
with torch 2.13's schemas and output layouts and the rules torch checks before it runs them
(``sdp_utils.cpp`` ``can_use_cudnn_attention``; the dense path of ``cudnn/MHA.cpp``). Every rule cites
``docs/standins.md``'s row (``[D<n>]``), which gives the file, lines and versions; the lines quoted here are those of
pytorch/pytorch ``sdp_utils.cpp`` at 001f694, ``MHA.cpp`` at 02a4a0f and ``attention_backward.cu`` at 00afd8f.

``CudnnStandIn(capability, version, allow_fp32)``: a GPU of ``capability`` with cuDNN runtime ``version``
(``91002`` is 9.10.2); ``allow_fp32`` is a test allowance (the real op takes fp16/bf16 only, [D2]), so the
glue can be compared with float64 at 1e-5. ``calls`` records what each op received. ``avoid_recompile``:
``TORCH_CUDNN_SDPA_AVOID_RECOMPILE`` as torch read it (``None``: read it now) [D12]. The namespace also holds
torch's flash ops (``aten``: an ``AtenCUDAStandIn`` of the same GPU), as ``torch.ops.aten`` does.

Three rules of the cuDNN releases torch ships (their sources: ``docs/standins.md``):
[D10] the sm_90 backward below cuDNN 9.26 turns dQ rows NaN whose LSE is below ``-ln(FLT_MAX)`` when
``s_kv % 128 == 64`` (pytorch/pytorch#196678, NVIDIA/cudnn-frontend#628: the last 128-row KV tile's
zero-filled half is scored 0, ``exp(0 - lse)`` overflows, ``inf * 0``); [D11] ``check_cudnn_sdpa_decode``:
a query of one row raises on sm_10x/sm_11x with cuDNN 9.19-9.25.0 except 9.24.1 (MHA.cpp at
cyyever/pytorch 0339585, a fork that follows pytorch main); [D12] the ragged dense path of
``TORCH_CUDNN_SDPA_AVOID_RECOMPILE=1`` (same file): stats allocated as ``[B, Sq, H, 1]`` memory, the backward's
batch rows read at ``b * Sq * stats.stride(-2)``.
"""

from __future__ import annotations

import math
import os

import torch
from torch import Tensor

from testkit.aten_standin import AtenCUDAStandIn, _attn64, _check, _grads64, _scores64, _top_left

__all__ = ["CudnnStandIn"]

_MAX_DIM = 65535  # check_cudnn_tensor_shapes (sdp_utils.cpp L632-644): batch and heads [D8]
_EXP_OVERFLOW = math.log(torch.finfo(torch.float32).max)  # 88.72: exp(x) is inf in float32 above it [D10]


class CudnnStandIn:
    """The two cuDNN attention ops of ``torch.ops.aten``, in float64 on CPU."""

    HALF = (torch.float16, torch.bfloat16)

    def __init__(
        self, capability: tuple[int, int] = (9, 0), version: int = 91002, allow_fp32: bool = False, d256: bool = False,
        avoid_recompile: bool | None = None,
    ) -> None:  # fmt: skip
        self.capability, self.version, self.d256 = capability, version, d256
        self.dtypes = self.HALF + ((torch.float32,) if allow_fp32 else ())
        self.calls: dict[str, list[dict]] = {}
        # [D12] use_ragged_in_dense's `static bool flag = check_env(...) == true` (MHA.cpp L230-231): read once;
        # c10/util/env.cpp L83-100 (pytorch/pytorch 1071fd2)
        flag = os.environ.get("TORCH_CUDNN_SDPA_AVOID_RECOMPILE") == "1"  # c10::utils::check_env: "1" only
        self.avoid_recompile = flag if avoid_recompile is None else avoid_recompile
        self.aten = AtenCUDAStandIn(allow_fp32=allow_fp32, record=True, capability=capability)

    # torch.ops.aten holds torch's flash ops too: the kernel's other route
    def _scaled_dot_product_flash_attention(self, *args: object, **kwargs: object) -> tuple:
        return self.aten._scaled_dot_product_flash_attention(*args, **kwargs)  # type: ignore[arg-type]

    def _scaled_dot_product_flash_attention_backward(self, *args: object, **kwargs: object) -> tuple:
        return self.aten._scaled_dot_product_flash_attention_backward(*args, **kwargs)  # type: ignore[arg-type]

    def _ragged(self, *bhsd: Tensor) -> bool:
        """[D12] use_ragged_in_dense (MHA.cpp L224-256 at cyyever/pytorch 0339585): the variable, no bias (never
        here), and q, k, v, o all ``x.transpose(1, 2).is_contiguous()`` (``[B, S, H, D]`` memory)."""
        return self.avoid_recompile and all(t.dim() == 4 and t.transpose(1, 2).is_contiguous() for t in bhsd)

    def _decode(self, s_q: int) -> None:
        """[D11] check_cudnn_sdpa_decode (MHA.cpp L214-220 at cyyever/pytorch 0339585), called first by
        run_cudnn_SDP_fprop and run_cudnn_SDP_bprop (L1580, L1949): a query of one row on SM 10.x/11.x with
        cuDNN 9.19 <= version <= 9.25.0, 9.24.1 spared (``sdp::is_cudnn_attention_decode_disabled``, as its
        message and pytorch#194927 state it)."""
        blackwell = self.capability[0] in (10, 11)
        disabled = blackwell and 91900 <= self.version <= 92500 and self.version != 92401
        _check(
            s_q != 1 or not disabled,
            "cuDNN SDPA decode is disabled for cuDNN versions 9.19-9.25.0 (except 9.24.1) on SM 10.x and 11.x.",
        )

    # ------------------------------------------------------------------ the rules of can_use_cudnn_attention

    def _head_dim_limit(self, d_qk: int, d_v: int, backward: bool) -> bool:
        """[D3]: head dims up to 128; up to 256 on sm_90 / sm_10x with cuDNN > 9.22 and a cuDNN frontend with
        the d256 kernels (``d256``, a build property); (192, 128) from 9.11 there; the backward of a d256 build
        only for <= 128, (192, 128) and (256, 256) (sdp_utils.cpp L662-684, L761-800)."""
        major, minor = self.capability
        sm90_10x = (major == 9 and minor == 0) or major == 10
        sm107_old = major == 10 and minor == 7 and self.version <= 92500
        limit = 128
        if sm90_10x and not sm107_old and self.version > 92200 and self.d256:
            limit = 256
            if backward and not ((d_qk <= 128 and d_v <= 128) or (d_qk, d_v) in ((192, 128), (256, 256))):
                return False
        elif sm90_10x and self.version >= 91100 and (d_qk, d_v) == (192, 128):
            limit = 192
        return d_qk <= limit and d_v <= limit

    def _check(self, q: Tensor, k: Tensor, v: Tensor, backward: bool = False) -> None:
        """``[B, H, S, D]`` tensors."""
        cc = self.capability[0] * 10 + self.capability[1]
        # [D1] sdp_utils.cpp L969-974 (cuDNN < 9.0), L869-891 (check_cudnn_hardware_support: sm_80..sm_121)
        _check(self.version >= 90000, "cuDNN version too old to use cuDNN Attention (< v9.0.0)")
        _check(80 <= cc <= 121, "cuDNN MHA only supports gpu architectures in the range [sm80, sm121]")
        # [D2] L912-922 (check_dtypes_low_precision); MHA.cpp L452-455: HALF unless bfloat16
        _check(q.dtype in self.dtypes, "cuDNN attention takes fp16/bf16 (check_dtypes_low_precision)")
        _check(k.dtype == q.dtype and v.dtype == q.dtype, "query, key and value must have the same dtype")
        for t in (q, k, v):
            _check(t.dim() == 4 and t.stride(-1) == 1, "the last dimension of q, k, v must be contiguous")  # [D6]
        b, h, _, d = q.shape
        _check(d % 8 == 0 and v.shape[-1] % 8 == 0, "head_dim should be a multiple of 8")  # [D3] L685-691
        _check(self._head_dim_limit(d, v.shape[-1], backward), "head_dim above the cuDNN limit")  # [D3]
        _check(k.shape[2] != 1, "cudnn SDPA does not support key/value sequence length 1.")  # [D4] L716-721
        _check(k.shape[0] == b and v.shape[0] == b and k.shape[2] == v.shape[2], "batch / seq_k mismatch")
        # [D5] L1006; the 2.13 wheel's sdp_utils_cpp.h L357-395 (K and V heads each divide Q's: the stand-in also
        # asks K and V for one head count, stricter)
        _check(h % k.shape[1] == 0 and k.shape[1] == v.shape[1], "num_heads must be a multiple of num_heads_k")
        _check(b <= _MAX_DIM and h <= _MAX_DIM, "cuDNN SDPA does not support batch size or num_heads > 65535")  # [D8]

    @staticmethod
    def _bshd(t: Tensor) -> Tensor:
        return t.transpose(1, 2)

    def _record(self, op: str, **kw: object) -> None:
        self.calls.setdefault(op, []).append(kw)

    # ------------------------------------------------------------------ the ops

    def _scaled_dot_product_cudnn_attention(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attn_bias: Tensor | None,
        compute_log_sumexp: bool,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        return_debug_mask: bool = False,
        *,
        scale: float | None = None,
    ) -> tuple:
        """``[B, H, S, D]`` in; output in the query's memory order [D6], ``logsumexp [B, H, Sq, 1]`` float32 [D6];
        causal top-left [D7]."""
        self._record("fwd", q=query, k=key, causal=is_causal)
        self._check(query, key, value)
        _check(attn_bias is None and dropout_p == 0.0 and not return_debug_mask, "stand-in: no bias, dropout, mask")
        sq, sk, d = query.shape[2], key.shape[2], query.shape[3]
        self._decode(sq)  # [D11]
        scale = scale if scale is not None else d**-0.5
        q, k, v = (self._bshd(t) for t in (query, key, value))
        keep = _top_left(sq, sk, 1 if is_causal else 0)  # [D7] MHA.cpp L475: set_causal_mask (top-left)
        out, lse = _attn64(q, k, v, scale, keep)
        _check(value.shape[3] == d, "stand-in: equal head dims (alloc_with_matching_layout's simple case)")
        out_bhsd = torch.empty_like(query)  # alloc_with_matching_layout: the query's memory order [D6]
        out_bhsd.copy_(out.transpose(1, 2))
        lse4 = torch.empty(0)
        if compute_log_sumexp:  # [D6] [B, H, Sq, 1]; [D12] on the ragged path [B, Sq, H, 1] memory, transposed
            b, h = query.shape[:2]
            ragged = self._ragged(query, key, value, out_bhsd)
            # run_cudnn_SDP_fprop, MHA.cpp L1588-1597 at cyyever/pytorch 0339585
            lse4 = torch.empty((b, sq, h, 1) if ragged else (b, h, sq, 1), dtype=torch.float32)
            lse4 = lse4.transpose(1, 2) if ragged else lse4
            lse4.copy_(lse.float().unsqueeze(-1))
        seed, offset = torch.empty((), dtype=torch.int64), torch.empty((), dtype=torch.int64)
        return out_bhsd, lse4, None, None, sq, sk, seed, offset, None

    def _scaled_dot_product_cudnn_attention_backward(
        self,
        grad_out: Tensor,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        out: Tensor,
        logsumexp: Tensor,
        philox_seed: Tensor,
        philox_offset: Tensor,
        attn_bias: Tensor | None,
        cum_seq_q: Tensor | None,
        cum_seq_k: Tensor | None,
        max_q: int,
        max_k: int,
        dropout_p: float,
        is_causal: bool,
        *,
        scale: float | None = None,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """dQ, dK, dV ``empty_like`` q, k, v (dK/dV with ``Hkv`` heads) [D5]; the stats read through their
        strides [D6]; ``Delta`` from the ``out`` passed in [D9]; ``grad_out`` in any layout (torch lays it out like
        ``out`` first: MHA.cpp L1360-1380) [D9]."""
        self._record("bwd", q=query, k=key, lse=logsumexp, out=out, dout=grad_out, causal=is_causal)
        self._check(query, key, value, backward=True)
        _check(attn_bias is None and cum_seq_q is None and cum_seq_k is None, "stand-in: dense, no bias")
        _check(dropout_p == 0.0, "stand-in: no dropout")
        b, h, sq, d = query.shape
        sk = key.shape[2]
        self._decode(sq)  # [D11]
        _check((max_q, max_k) == (sq, sk), "max_q / max_k are the dense lengths")
        _check(logsumexp.dtype == torch.float32 and tuple(logsumexp.shape) == (b, h, sq, 1), "logsumexp [B, H, Sq, 1]")
        for name, t in (("out", out), ("grad_out", grad_out)):
            _check(t.shape == query.shape[:3] + value.shape[3:] and t.dtype == query.dtype, f"{name} shape/dtype")
        # [D9] MHA.cpp L844-848: O goes to the graph with its own strides (a unit last stride: stricter than torch);
        # dO is copied into O's layout when cuDNN needs it (L1360-1380, permute_to_matching_layout L381-400)
        _check(out.stride(-1) == 1, "out must have a contiguous last dimension")
        scale = scale if scale is not None else d**-0.5
        q, k, v, o, do = (self._bshd(t) for t in (query, key, value, out, grad_out))
        s = _scores64(q, k, scale, _top_left(sq, sk, 1 if is_causal else 0))  # [D7] MHA.cpp L795
        stats = logsumexp[..., 0]  # through its strides [D6]
        if self._ragged(query, key, value, out):  # dO is laid out like O first on that path
            # [D12] run_cudnn_SDP_bprop: batch row b starts at cum_seqlen_q[b] * stats.stride(-2) = b * Sq * that
            # stride (MHA.cpp L1984-1999, L1998); within it the graph's Stats strides (build_graph_backward,
            # L1219-1223, L1303-1306) read heads and rows
            st = logsumexp.stride()
            stats = logsumexp.as_strided((b, h, sq), (sq * st[2], st[1], st[2]), logsumexp.storage_offset())
        grads = _grads64(do, q, k, v, o, stats, s, scale)  # [D9] sdpa_backward(O, dO, Stats): L860-861
        if self.capability[0] == 9 and self.version < 92600 and sk % 128 == 64:
            # [D10] pytorch/pytorch#196678, NVIDIA/cudnn-frontend#628: the KV tail's zero-filled half scored 0:
            # exp(0 - lse) is inf for lse < -ln(FLT_MAX), times the zero-filled K gives NaN in that dQ row (dK, dV
            # and the forward are right)
            bad = (stats < -_EXP_OVERFLOW).transpose(1, 2)[..., None]  # [B, Sq, H, 1]
            grads = (grads[0].masked_fill(bad, math.nan), *grads[1:])
        # empty_like keeps the inputs' layout [D5]: attention_backward.cu L245-247
        made = [torch.empty_like(x) for x in (query, key, value)]
        for m, g in zip(made, grads):
            m.copy_(g.transpose(1, 2))
        return made[0], made[1], made[2]
