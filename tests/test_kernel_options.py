"""The block kernels' options against float64, one call at a time: sliding-window bands, soft-capping, rows
that see no key, grouped-query heads and packed (varlen) calls, forward and every gradient, for every kernel
that takes them (flash-attn 2, 3 and 4 through their stand-ins, ``testkit/cuda_standins.py``); cuDNN, which
takes none of them, refuses them by name."""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor

from hf_ring.ops.kernels import band_mask
from testkit.cuda_standins import make_kernel
from testkit.oracle import attention, rel_err

OPTION_KERNELS = ["flash_attn:2.8-custom-op", "flash_attn_3:custom-op", "flash_attn_3:plain", "flash_attn_4"]

# (B, Sq, Sk, Hq, Hkv, D, causal, window, softcap); windows aligned bottom-right, causal on square blocks only
CASES = [
    (2, 13, 29, 6, 2, 80, False, (4, 0), 0.0),  # a band of five keys per row
    (1, 17, 17, 8, 2, 36, False, (3, 2), 2.0),  # both edges, a cap, head_dim padded to 40
    (1, 19, 11, 4, 1, 64, False, (2, 0), 5.0),  # the first 8 rows see no key: out 0, lse -inf, no gradient
    (2, 15, 15, 6, 3, 72, True, None, 3.0),  # causal with a cap
    (1, 21, 9, 8, 8, 128, False, None, 2.0),  # a cap alone, equal heads
]


def oracle(
    q: Tensor, k: Tensor, v: Tensor, dout: Tensor, *, causal: bool, scale: float, softcap: float,
    window: tuple[int, int] | None,
) -> list[Tensor]:  # fmt: skip
    """``[out, lse, dq, dk, dv]`` in float64 of one ``[B, S, H, D]`` block from the one float64 oracle
    (``testkit.oracle.attention``), under the band (``band_mask``) or causal mask."""
    xs = [t.detach().double().requires_grad_() for t in (q, k, v)]
    sq, sk = q.shape[1], k.shape[1]
    keep = band_mask(sq, sk, window) if window else torch.ones(sq, sk, dtype=torch.bool)
    if causal:
        keep = keep & torch.ones(sq, sk, dtype=torch.bool).tril()
    out, lse = attention(*xs, scale=scale, mask=keep, softcap=softcap or None, with_lse=True)
    return [out.detach(), lse.detach(), *torch.autograd.grad(out, xs, dout.double())]


def _inputs(b: int, sq: int, sk: int, hq: int, hkv: int, d: int, seed: int = 0) -> list[Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, s, h, d, generator=g) for s, h in ((sq, hq), (sk, hkv), (sk, hkv), (sq, hq))]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "Sq{1}_Sk{2}_H{3}/{4}_D{5}_c{6}_w{7}_cap{8}".format(*c))
@pytest.mark.parametrize("name", OPTION_KERNELS)
def test_windows_caps_and_empty_rows_match_float64(name: str, case: tuple) -> None:
    """Out and ``lse`` (``-inf`` exactly where a row sees no key), dq, dk, dv within 1e-5 of float64."""
    b, sq, sk, hq, hkv, d, causal, window, softcap = case
    kernel = make_kernel(name)
    assert kernel.window and kernel.softcap
    q, k, v, dout = _inputs(b, sq, sk, hq, hkv, d)
    scale = 0.8 / math.sqrt(d)
    kw = dict(causal=causal, scale=scale, window=window, **({"softcap": softcap} if softcap else {}))
    ref_out, ref_lse, *ref_grads = oracle(q, k, v, dout, causal=causal, scale=scale, softcap=softcap, window=window)
    out, lse = kernel.forward(q, k, v, **kw)
    assert out.shape == q.shape and lse.shape == q.shape[:3] and lse.dtype == torch.float32
    empty = torch.isneginf(ref_lse)
    assert torch.equal(torch.isneginf(lse), empty) and not lse.isnan().any()
    assert rel_err(out, ref_out) <= 1e-5 and not out[empty[..., None].expand_as(out)].any()
    torch.testing.assert_close(lse[~empty].double(), ref_lse[~empty], rtol=1e-5, atol=1e-5)
    grads = kernel.backward(dout, q, k, v, out, lse, **kw)
    for gname, g, x, r in zip(("dq", "dk", "dv"), grads, (q, k, v), ref_grads):
        assert g.shape == x.shape and not g.isnan().any(), gname
        assert rel_err(g, r) <= 1e-5, f"{gname} rel err {rel_err(g, r):.2e}"


@pytest.mark.parametrize(
    "causal, window, softcap", [(True, None, 0.0), (False, (3, 0), 2.0), (False, (2, 3), 0.0)],
    ids=["causal", "band+cap", "two-sided"],
)  # fmt: skip
@pytest.mark.parametrize("name", OPTION_KERNELS)
def test_varlen_calls_match_float64_per_sequence(
    name: str, causal: bool, window: tuple[int, int] | None, softcap: float
) -> None:
    """Three sequences packed along rows (``cu_seqlens`` int32, GQA 6/2, head_dim 36), one window for all aligned
    to each sequence's bottom-right corner: out, ``lse [T, H]`` and the gradients equal each sequence's own
    float64 attention."""
    kernel = make_kernel(name)
    assert kernel.varlen
    lens_q = [5, 11, 8]
    lens_k = lens_q if causal else [7, 11, 13]
    hq, hkv, d, scale = 6, 2, 36, 36**-0.5
    q, k, v, dout = (t[0] for t in _inputs(1, sum(lens_q), sum(lens_k), hq, hkv, d, seed=3))
    cu_q, cu_k = (torch.tensor([0, *torch.tensor(x).cumsum(0).tolist()], dtype=torch.int32) for x in (lens_q, lens_k))
    kw = dict(causal=causal, scale=scale, window=window, **({"softcap": softcap} if softcap else {}))
    out, lse = kernel.varlen_forward(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), **kw)
    assert out.shape == q.shape and lse.shape == q.shape[:2] and lse.dtype == torch.float32
    grads = kernel.varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, max(lens_q), max(lens_k), **kw)
    want: list[list[Tensor]] = [[] for _ in range(5)]
    for i in range(3):
        rq, rk = slice(int(cu_q[i]), int(cu_q[i + 1])), slice(int(cu_k[i]), int(cu_k[i + 1]))
        got = oracle(q[None, rq], k[None, rk], v[None, rk], dout[None, rq], causal=causal, scale=scale,
                     softcap=softcap, window=window)  # fmt: skip
        for acc, t in zip(want, got):
            acc.append(t[0])
    ref = [torch.cat(ts) for ts in want]
    assert rel_err(out, ref[0]) <= 1e-5
    torch.testing.assert_close(lse.double(), ref[1], rtol=1e-5, atol=1e-5)
    for gname, g, r in zip(("dq", "dk", "dv"), grads, ref[2:]):
        assert rel_err(g, r) <= 1e-5, f"{gname} rel err {rel_err(g, r):.2e}"


def test_cudnn_takes_no_band_cap_or_packed_call() -> None:
    """torch's cuDNN op has no band, no cap and no varlen entry point here ([D7]): the kernel says so in
    ``refuses`` (so "auto" passes it over for such layers) and refuses a band outright, naming the fix."""
    kernel = make_kernel("cudnn")
    assert not (kernel.window or kernel.softcap or getattr(kernel, "varlen", False))
    assert "soft-cap" in kernel.refuses((9, 0), torch.bfloat16, 128, True, False)
    assert "window" in kernel.refuses((9, 0), torch.bfloat16, 128, False, True)
    assert kernel.refuses((9, 0), torch.bfloat16, 128, False, False) == ""
    q, k, v, dout = _inputs(1, 8, 8, 4, 2, 16)
    with pytest.raises(ValueError, match="no sliding-window"):
        kernel.forward(q, k, v, causal=False, scale=0.25, window=(2, 0))
    out, lse = kernel.forward(q, k, v, causal=True, scale=0.25)
    with pytest.raises(ValueError, match="no sliding-window"):
        kernel.backward(dout, q, k, v, out, lse, causal=True, scale=0.25, window=(2, 0))
