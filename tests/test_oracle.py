"""The float64 oracle itself (``testkit.oracle``): its masks against their definitions written as loops,
plain causal attention against torch's SDPA, rows that see no key, sinks and soft-capping against
their closed forms, and the log-sum-exp."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from testkit.oracle import attention, reference, rel_err, visible


def _inputs(b: int, nq: int, nk: int, hq: int = 6, hkv: int = 2, d: int = 80, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, n, h, d, generator=g, dtype=torch.float64) for n, h in ((nq, hq), (nk, hkv), (nk, hkv))]


@pytest.mark.parametrize("window", [None, 1, 4])
@pytest.mark.parametrize("chunk", [None, 3])
def test_visible_follows_the_definitions(window: int | None, chunk: int | None) -> None:
    starts = [[0, 5, 6, 13], [0, 17]]
    got = visible(23, window=window, starts=starts, chunk=chunk)
    for b, row in enumerate(starts):
        for i in range(23):
            for j in range(23):
                di = max(s for s in row if s <= i)
                dj = max(s for s in row if s <= j)
                want = j <= i and di == dj
                want &= window is None or j > i - window
                want &= chunk is None or (i - di) // chunk == (j - di) // chunk
                assert bool(got[b, i, j]) == want, (b, i, j)


def test_causal_gqa_matches_sdpa() -> None:
    q, k, v = _inputs(2, 11, 11)
    want = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True
    ).transpose(1, 2)
    torch.testing.assert_close(attention(q, k, v, True), want)
    q, k, v = _inputs(1, 7, 13)  # more keys than queries: causal aligned to the top left
    want = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
        attn_mask=torch.ones(7, 13, dtype=torch.bool).tril(), enable_gqa=True,
    ).transpose(1, 2)  # fmt: skip
    torch.testing.assert_close(attention(q, k, v, True), want)


def test_rows_without_keys_are_zero_with_zero_gradients() -> None:
    q, k, v = (x.requires_grad_() for x in _inputs(1, 5, 5))
    mask = torch.ones(5, 5, dtype=torch.bool).tril()
    mask[2] = False  # row 2 sees nothing
    out, lse = attention(q, k, v, mask=mask, with_lse=True)
    assert torch.isneginf(lse[0, 2]).all() and not torch.isnan(out).any()
    assert out[0, 2].abs().max() == 0
    out.sum().backward()
    assert all(not torch.isnan(x.grad).any() for x in (q, k, v))
    assert q.grad[0, 2].abs().max() == 0


def test_lse_sinks_and_softcap_closed_forms() -> None:
    q, k, v = _inputs(2, 9, 9)
    q = q * 3.0
    cap = 2.5
    out, lse = attention(q, k, v, True, softcap=cap, with_lse=True)
    rep = q.shape[2] // k.shape[2]
    s = torch.einsum("bqhd,bkhd->bqhk", q, k.repeat_interleave(rep, 2)) * q.shape[-1] ** -0.5
    s = (cap * torch.tanh(s / cap)).masked_fill(~torch.ones(9, 9, dtype=torch.bool).tril()[:, None], -math.inf)
    torch.testing.assert_close(lse, torch.logsumexp(s, -1))
    for sinks in (torch.randn(6, dtype=torch.float64), torch.randn(2, 9, 6, dtype=torch.float64)):
        o_s, l_s = attention(q, k, v, True, softcap=cap, sinks=sinks, with_lse=True)
        torch.testing.assert_close(l_s, torch.logaddexp(lse, sinks.expand_as(lse)))
        torch.testing.assert_close(o_s, out * torch.sigmoid(lse - sinks.expand_as(lse))[..., None])
    o_none = attention(q, k, v, True, sinks=torch.full((6,), -math.inf, dtype=torch.float64))
    torch.testing.assert_close(o_none, attention(q, k, v, True))


def test_reference_returns_float64_grads() -> None:
    q, k, v = _inputs(1, 6, 6)
    dout = torch.randn(1, 6, 6, 80, dtype=torch.float64)
    out, lse, dq, dk, dv = reference(q.float(), k.float(), v.float(), dout, True, 0.1)
    assert all(t.dtype == torch.float64 for t in (out, lse, dq, dk, dv))
    assert (dq.shape, dk.shape, lse.shape) == (q.shape, k.shape, (1, 6, 6))
    xs = [x.float().double().requires_grad_() for x in (q, k, v)]
    o = attention(*xs, True, 0.1)
    o.backward(dout)
    assert rel_err(dk, xs[1].grad) < 1e-12 and rel_err(out, o) < 1e-12
