"""torch's CUDA attention ops on CPU: ``aten._scaled_dot_product_flash_attention`` (and ``_backward``), and
``aten._efficient_attention_forward`` / ``_backward``, with torch 2.13's schemas and the checks and
semantics of their CUDA code. Every rule cites ``docs/standins.md``'s row (``[T<n>]``): torch's flash op
runs the flash-attn 2 kernels torch vendors (``aten/src/ATen/native/transformers/cuda/flash_attn/``,
the same ``flash_api.cpp``/``mask.h`` code as flash-attn, ``testkit.flash_rules``), the memory-efficient
op the cutlass kernels of ``mem_eff_attention/`` (headers shipped in the torch 2.13 wheel).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from testkit.flash_rules import flash_keeps
from testkit.oracle import attention

__all__ = ["AtenCUDAStandIn"]


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise RuntimeError(msg)  # what TORCH_CHECK raises


def _scores64(q: Tensor, k: Tensor, scale: float, keep: Tensor) -> Tensor:
    """``[B, Hq, Sq, Sk]`` float64 scores of ``[B, S, H, D]`` inputs, ``-inf`` where ``keep`` is False."""
    rep = q.shape[2] // k.shape[2]
    s = torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double().repeat_interleave(rep, 2)) * scale
    return s.masked_fill(~keep, -math.inf)


def _attn64(q: Tensor, k: Tensor, v: Tensor, scale: float, keep: Tensor) -> tuple[Tensor, Tensor]:
    """float64 ``out [B, Sq, Hq, D]`` and ``lse [B, Hq, Sq]`` (``-inf`` for rows without keys) under the
    op's mask ``keep [Sq, Sk]``: exact attention, the oracle's."""
    out, lse = attention(q, k, v, scale=scale, mask=keep, with_lse=True)
    return out, lse.transpose(1, 2)


def _grads64(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, s: Tensor, scale: float):
    """What a flash-style backward computes from the given ``out`` and ``lse [B, H, Sq]`` (float64,
    ``[B, S, H, D]``, dK/dV summed over each K/V head's query group: flash_api.cpp L1055-1058 [T3]); an ``lse``
    of ``+inf`` gives ``p = 0``."""
    b, sk, hkv, d = k.shape
    rep = q.shape[2] // hkv
    p = torch.exp(s - lse.double()[..., None])
    do = dout.double()
    delta = (do * out.double()).sum(-1).transpose(1, 2)[..., None]  # [B, H, Sq, 1]
    ds = p * (torch.einsum("bqhd,bkhd->bhqk", do, v.double().repeat_interleave(rep, 2)) - delta)
    dq = torch.einsum("bhqk,bkhd->bqhd", ds, k.double().repeat_interleave(rep, 2)) * scale
    dk = (torch.einsum("bhqk,bqhd->bkhd", ds, q.double()) * scale).view(b, sk, hkv, rep, d).sum(3)
    dv = torch.einsum("bhqk,bqhd->bkhd", p, do).view(b, sk, hkv, rep, d).sum(3)
    return dq, dk, dv


def _top_left(sq: int, sk: int, mask_type: int) -> Tensor:
    """The memory-efficient op's ``custom_mask_type``: 0 none, 1 causal from the top left, 2 from the
    bottom right [T6]."""
    keep = torch.ones(sq, sk, dtype=torch.bool)
    return keep if mask_type == 0 else keep.tril(sk - sq if mask_type == 2 else 0)


class AtenCUDAStandIn:
    """``torch.ops.aten``'s CUDA attention ops used by the CUDA kernels, in float64 on CPU.

    Same names, signatures and output layouts as torch 2.13's schemas, and the checks the CUDA code makes
    that a caller can trip (``attention_backward.cu``, ``flash_api.cpp`` ``mha_fwd``/``mha_bwd``/
    ``mha_varlen_bwd``, ``_efficient_attention_forward/backward`` and the cutlass kernels'
    ``check_supported``). ``allow_fp32`` lets the flash ops take float32 (the real ones take fp16/bf16
    only), so their glue can be compared with float64 at 1e-5. ``calls`` records what each op received.
    ``capability``: the GPU's compute capability, as the CUDA code checks it (flash ops: sm_80+; the
    memory-efficient op's bf16 kernels: sm_80+, its fp16/fp32 ones from sm_50).
    """

    HALF = (torch.float16, torch.bfloat16)

    def __init__(self, allow_fp32: bool = False, record: bool = False, capability: tuple[int, int] = (9, 0)) -> None:
        self.flash_dtypes = self.HALF + ((torch.float32,) if allow_fp32 else ())
        self.capability = capability
        self.calls: dict[str, list[dict]] | None = {} if record else None

    def _record(self, op: str, **kw: object) -> None:
        if self.calls is not None:
            self.calls.setdefault(op, []).append(kw)

    # ------------------------------------------------------------------ flash (mha_fwd / mha_bwd)

    def _check_flash(self, q: Tensor, k: Tensor, v: Tensor) -> None:
        """``mha_fwd``/``mha_bwd`` on ``[B, S, H, D]`` tensors (pytorch/pytorch 03b7c19 ``flash_api.cpp``; the
        lines are those of ``docs/standins.md`` rows T1-T3)."""
        # [T1] flash_api.cpp L404-405 (mha_fwd), L869-870 (mha_bwd): major * 10 >= 80
        _check(self.capability[0] * 10 >= 80, "FlashAttention only supports Ampere GPUs or newer.")  # [T1]
        # [T2] L408-414 (mha_fwd), L876-884 (mha_bwd): fp16/bf16, k and v in q's dtype
        _check(q.dtype in self.flash_dtypes, "FlashAttention only support fp16 and bf16 data type")
        _check(k.dtype == q.dtype and v.dtype == q.dtype, "query and key/value must have the same dtype")
        for t in (q, k, v):
            _check(t.dim() == 4 and t.stride(-1) == 1, "Input tensor must have contiguous last dimension")
        b, _, h, d = q.shape
        # [T3] L451-453 (mha_fwd), L922-924, L928 (mha_bwd): head dim % 8, <= 256, heads % kv heads
        _check(d % 8 == 0, "head_size must be a multiple of 8, this is ensured by padding!")
        _check(d <= 256, "FlashAttention forward only supports head dimension at most 256")
        _check(h % k.shape[2] == 0, "Number of heads in key/value must divide number of heads in query")
        _check(k.shape == v.shape and k.shape[0] == b and k.shape[3] == d, "CHECK_SHAPE(k/v)")

    def _scaled_dot_product_flash_attention(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        return_debug_mask: bool = False,
        *,
        scale: float | None = None,
    ) -> tuple[Tensor, Tensor, None, None, int, int, Tensor, Tensor, Tensor]:
        """Takes ``[B, H, S, D]`` (transposed to ``[B, S, H, D]`` for ``mha_fwd``, window ``(-1, -1)``): the
        flash-attn mask (causal bottom-right), ``lse = +inf`` and out 0 for rows without keys [T4]: flash_api.cpp
        L457-462 (mha_fwd's window and causal), L178-181 (set_params_fprop), mask.h L171-172, L188 (449ec00)."""
        q, k, v = (t.transpose(1, 2) for t in (query, key, value))
        self._record("flash_fwd", q=q, k=k, v=v)
        self._check_flash(q, k, v)
        _check(dropout_p == 0.0 and not return_debug_mask, "stand-in: no dropout, no debug mask")
        scale = scale if scale is not None else q.shape[-1] ** -0.5
        keep = flash_keeps(q.shape[1], k.shape[1], is_causal, None, "fwd")
        out, lse = _attn64(q, k, v, scale, keep)
        # [T4] +inf for rows without keys: softmax.h L177 (00a1abb), flash_api.cpp L566-572 (seqlen_k == 0)
        lse = lse.masked_fill(torch.isneginf(lse), math.inf).float()
        rng_state = torch.empty(2, dtype=torch.uint64)  # dropout 0: allocated, never written
        unused = torch.empty((), dtype=torch.uint64)
        res = (out.to(q.dtype).contiguous().transpose(1, 2), lse.contiguous(), None, None)
        return (*res, q.shape[1], k.shape[1], rng_state, unused, torch.empty(0, dtype=q.dtype))

    def _scaled_dot_product_flash_attention_backward(
        self,
        grad_out: Tensor,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        out: Tensor,
        logsumexp: Tensor,
        cum_seq_q: Tensor | None,
        cum_seq_k: Tensor | None,
        max_q: int,
        max_k: int,
        dropout_p: float,
        is_causal: bool,
        philox_seed: Tensor | None,
        philox_offset: Tensor | None,
        *,
        scale: float | None = None,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """``_flash_attention_backward``: varlen iff ``cum_seq_q`` is defined, else ``mha_bwd`` [T5]
        (attention_backward.cu L914-963, L120-124, L157 at pytorch/pytorch 00afd8f)."""
        dout, q, k, v, o = (t.transpose(1, 2) for t in (grad_out, query, key, value, out))
        self._record("flash_bwd", q=q, k=k, lse=logsumexp, cum_seq_q=cum_seq_q, philox=(philox_seed, philox_offset))
        dout, o = dout.contiguous(), o.contiguous()  # "CUDA code assumes that dout is contiguous" (L88-90)
        if cum_seq_q is not None:  # mha_varlen_bwd (flash_api.cpp L1112-1113: int32 lengths) [T5]
            _check(cum_seq_q.dtype == torch.int32, "cu_seqlens_q must have dtype int32")
            _check(cum_seq_k is not None and cum_seq_k.dtype == torch.int32, "cu_seqlens_k must have dtype int32")
            _check(q.dim() == 3, "varlen: q must be [total_q, num_heads, head_size]")
        self._check_flash(q, k, v)
        _check(dropout_p == 0.0, "stand-in: no dropout (mha_bwd reads philox_seed only with dropout)")
        b, sq, h, d = q.shape
        for name, t in (("out", o), ("dout", dout)):
            _check(t.dtype == q.dtype, f"query and {name} must have the same dtype")
            _check(t.shape == q.shape, f"CHECK_SHAPE({name})")
        # read by raw pointer as contiguous float32 [B, H, Sq]
        _check(logsumexp.dtype == torch.float32, "logsumexp must be float32")
        _check(tuple(logsumexp.shape) == (b, h, sq) and logsumexp.is_contiguous(), "logsumexp [B, H, Sq] contiguous")
        scale = scale if scale is not None else d**-0.5
        s = _scores64(q, k, scale, flash_keeps(sq, k.shape[1], is_causal, None, "bwd"))
        lse = logsumexp.masked_fill(torch.isneginf(logsumexp), 0.0)  # -inf read as 0: softmax.h L76 [T4]
        grads = _grads64(dout, q, k, v, o, lse, s, scale)
        return tuple(g.to(q.dtype).contiguous().transpose(1, 2) for g in grads)  # type: ignore[return-value]

    # ------------------------------------------------------------------ memory-efficient (cutlass)

    def _check_efficient(
        self, q: Tensor, k: Tensor, v: Tensor, cu_q: object, cu_k: object, bias: object, direction: str = "F"
    ) -> None:
        # the dispatch over the kernels built per architecture: bf16 on sm_80..sm_121, fp16/fp32 on
        # sm_50..sm_121 (sm_121 runs sm_120's), each up to a head dim of kMaxK = 65536 [T7]
        cc = self.capability[0] * 10 + self.capability[1]
        cc = 120 if cc == 121 else cc
        built = (80 if q.dtype == torch.bfloat16 else 50) <= cc <= 121
        _check(built and max(q.shape[-1], v.shape[-1]) <= 65536, f"cutlass{direction}: no kernel found to launch!")
        _check(q.dim() == 4 and k.dim() == 4 and v.dim() == 4, "query.dim() == 4")
        _check(q.shape[0] == k.shape[0] == v.shape[0], "query.size(0) == key.size(0)")
        _check(k.shape[1] == v.shape[1], "key.size(1) == value.size(1)")
        _check(q.shape[2] == k.shape[2] == v.shape[2], "query.size(2) == key.size(2)")  # num heads
        _check(q.shape[3] == k.shape[3], "query.size(3) == key.size(3)")
        _check(q.dtype in (*self.HALF, torch.float32), "invalid dtype")
        _check(k.dtype == q.dtype and v.dtype == q.dtype, "same dtype")
        for t in (q, k, v):
            _check(t.stride(-1) == 1, "tensor must have its last dimension contiguous")
            # cutlass check_supported: strides multiples of kMinimumAlignment (4 on sm80)
            _check(t.stride(1) % 4 == 0, "query is not correctly aligned (strideM)")
            _check(t.shape[2] <= 1 or t.stride(2) % 4 == 0, "query is not correctly aligned (strideH)")
            _check(t.shape[0] <= 1 or t.stride(0) % 4 == 0, "query is not correctly aligned (strideB)")
        _check(cu_q is None and cu_k is None and bias is None, "stand-in: dense, no bias")

    def _efficient_attention_forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        bias: Tensor | None,
        cu_seqlens_q: Tensor | None,
        cu_seqlens_k: Tensor | None,
        max_seqlen_q: int | None,
        max_seqlen_k: int | None,
        dropout_p: float,
        custom_mask_type: int,
        compute_log_sumexp: bool = False,
        *,
        scale: float | None = None,
        seqlen_k: Tensor | None = None,
        window_size: int | None = None,
    ) -> tuple[Tensor, Tensor, Tensor, Tensor, int, int]:
        """``[B, M, H, K]`` in; ``lse [B, H, ceil32(M)]`` float32, ``+inf`` past ``M``; mask 1 top-left."""
        self._record("eff_fwd", q=query, k=key)
        self._check_efficient(query, key, value, cu_seqlens_q, cu_seqlens_k, bias)
        _check(dropout_p == 0.0 and window_size is None and seqlen_k is None, "stand-in: defaults")
        _check(custom_mask_type in (0, 1, 2), "Invalid value for `custom_mask_type`")
        b, m, h, d = query.shape
        scale = scale if scale is not None else d**-0.5
        keep = _top_left(m, key.shape[1], custom_mask_type)
        out, lse = _attn64(query, key, value, scale, keep)
        lse_p = torch.full((b, h, -(-m // 32) * 32 if compute_log_sumexp else 0), math.inf, dtype=torch.float32)
        if compute_log_sumexp:
            lse_p[..., :m] = lse
        seed, offset = torch.empty((), dtype=torch.int64), torch.empty((), dtype=torch.int64)
        return out.to(query.dtype).contiguous(), lse_p, seed, offset, m, key.shape[1]

    def _efficient_attention_backward(
        self,
        grad_out_: Tensor,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        bias: Tensor | None,
        out: Tensor,
        cu_seqlens_q: Tensor | None,
        cu_seqlens_k: Tensor | None,
        max_seqlen_q: int,
        max_seqlen_k: int,
        logsumexp: Tensor,
        dropout_p: float,
        philox_seed: Tensor,
        philox_offset: Tensor,
        custom_mask_type: int,
        bias_requires_grad: bool,
        *,
        scale: float | None = None,
        num_splits_key: int | None = None,
        window_size: int | None = None,
        shared_storage_dqdkdv: bool = False,
    ) -> tuple[Tensor, Tensor, Tensor, None]:
        self._record("eff_bwd", q=query, k=key, lse=logsumexp, out=out)
        self._check_efficient(query, key, value, cu_seqlens_q, cu_seqlens_k, bias, "B")
        _check(dropout_p == 0.0 and window_size is None and not bias_requires_grad, "stand-in: defaults")
        b, m, h, d = query.shape
        _check(grad_out_.shape == query.shape[:3] + value.shape[3:], "grad_out shape")
        _check(out.dtype == query.dtype and grad_out_.dtype == query.dtype, "out/grad_out dtype")
        # o_strideM() == head_dim_value * num_heads: out is read as dense [B, M, H, Kv]
        _check(out.stride(-1) == 1 and out.stride(1) == h * value.shape[3], "out must be dense [B, M, H, Kv]")
        _check(logsumexp.dtype == torch.float32 and logsumexp.dim() == 3, "logsumexp float32 [B, H, M']")
        _check(logsumexp.shape[:2] == (b, h) and logsumexp.shape[2] >= m and logsumexp.stride(2) == 1, "lse shape")
        _check(h <= 1 or logsumexp.stride(1) % 8 == 0, "LSE is not correctly aligned (strideH)")
        _check(b <= 1 or logsumexp.stride(0) % 8 == 0, "LSE is not correctly aligned (strideB)")
        scale = scale if scale is not None else d**-0.5
        s = _scores64(query, key, scale, _top_left(m, key.shape[1], custom_mask_type))
        grads = _grads64(grad_out_.contiguous(), query, key, value, out, logsumexp[..., :m], s, scale)
        dq, dk, dv = (g.to(query.dtype).contiguous() for g in grads)
        return dq, dk, dv, None
