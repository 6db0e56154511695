"""Float64 attention over the whole sequence: the oracle every test compares against."""

from __future__ import annotations

import torch
from torch import Tensor


def attention(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float | None = None) -> Tensor:
    """``q: [B, N, Hq, D]``, ``k, v: [B, N, Hkv, D]`` -> ``[B, N, Hq, D]``, computed in float64."""
    q, k, v = q.double(), k.double(), v.double()
    rep = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(rep, 2), v.repeat_interleave(rep, 2)
    scale = scale if scale is not None else q.shape[-1] ** -0.5
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if causal:
        n = s.shape[-1]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), v)


def rel_err(x: Tensor, ref: Tensor) -> float:
    """``|x - ref| / |ref|`` in float64 (Frobenius norms)."""
    x, ref = x.detach().double(), ref.detach().double()
    return float((x - ref).norm() / ref.norm())
