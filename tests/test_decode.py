"""``hf_ring.ops.decode``: attention of replicated new tokens to a KV cache sharded across a CP group,
against a float64 oracle on odd shapes (GQA, M = 3 new tokens, keys held in any order, uneven and
empty shards), with sliding windows, chunks, soft-capping and sinks; ``gather_rows``."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from hf_ring.ops.decode import decode_attention, gather_rows, partial_attention
from testkit.spawn import run_ranks

B, HQ, HKV, D, DV, N, M = 2, 6, 2, 12, 10, 37, 3


def _oracle(q, k, v, scale, window=None, chunk=None, softcap=0.0, sinks=None):
    """Attention of the last M positions of a sequence of N + M over all keys, float64, dense."""
    g = HQ // HKV
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = (q @ k.transpose(-1, -2)) * scale  # (B, Hq, M, N + M)
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    qp, kp = torch.arange(N, N + M)[:, None], torch.arange(N + M)[None]
    ok = kp <= qp
    if window:
        ok &= kp > qp - window
    if chunk:
        ok &= kp // chunk == qp // chunk
    s = s.masked_fill(~ok, float("-inf"))
    if sinks is not None:
        s = torch.cat((s, sinks[None, :, None, None].expand(B, HQ, M, 1)), -1)
    p = s.softmax(-1)[..., : N + M]
    return (p @ v).transpose(1, 2)  # (B, M, Hq, Dv)


def _case():
    g = torch.Generator().manual_seed(3)
    q = torch.randn(B, HQ, M, D, generator=g, dtype=torch.float64)
    k = torch.randn(B, HKV, N + M, D, generator=g, dtype=torch.float64)
    v = torch.randn(B, HKV, N + M, DV, generator=g, dtype=torch.float64)
    return q, k, v, torch.randn(HQ, generator=g, dtype=torch.float64)


OPTIONS = [{}, {"window": 7}, {"window": 40}, {"chunk": 16}, {"softcap": 2.0}, {"sinks": True}]


def sharded_errors(dtype: str = "float64") -> list[float]:
    """On every rank: the cache's first N keys dealt to the ranks in a shuffled order (rank 0 gets
    none when P > 2), the last M replicated; the error of each option against the oracle."""
    rank, size = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    q, k, v, sinks = _case()
    perm = torch.randperm(N, generator=torch.Generator().manual_seed(5))
    owner = torch.arange(N) % size if size <= 2 else 1 + torch.arange(N) % (size - 1)
    mine = perm[owner == rank]
    tail = torch.arange(N, N + M)
    errs = []
    for opts in OPTIONS:
        o = {k_: val for k_, val in opts.items() if k_ != "sinks"}
        want = _oracle(q, k, v, 0.3, sinks=sinks if opts.get("sinks") else None, **o)
        cast = getattr(torch, dtype)
        got = decode_attention(
            q.to(cast), (k[:, :, mine].to(cast), v[:, :, mine].to(cast), mine),
            (k[:, :, tail].to(cast), v[:, :, tail].to(cast), tail), tail, group=None, scale=0.3,
            sinks=sinks.to(cast) if opts.get("sinks") else None, **o,
        )  # fmt: skip
        errs.append(float((got.double() - want).abs().max() / want.abs().max()))
    return errs


def test_partial_attention_one_process():
    for err in sharded_errors():
        assert err < 1e-12


@pytest.mark.parametrize("dtype,tol", [("float64", 1e-12), ("float32", 1e-5)])
def test_decode_attention_sharded(dtype, tol):
    for world in (2, 3):
        for errs in run_ranks(world, sharded_errors, dtype):
            assert max(errs) < tol, errs


def test_partial_attention_no_key():
    q, k, v, _ = _case()
    out, lse = partial_attention(q, k[:, :, :0], v[:, :, :0], torch.arange(N, N + M), torch.arange(0), scale=0.3)
    assert out.abs().max() == 0 and bool(torch.isinf(lse).all())


def gathered(count: int) -> list:
    rank, size = dist.get_rank(), dist.get_world_size()
    pos = torch.arange(rank, 20, size)  # rank r holds positions r, r + P, ...
    x = pos.double()[None, None].expand(2, 3, -1) * 10  # [B, C, S_local]
    return gather_rows(x, pos, 20 - count, count, None, dim=2).tolist()


def test_gather_rows():
    for rows in run_ranks(3, gathered, 4):
        assert rows[1][2] == [160.0, 170.0, 180.0, 190.0]
    assert run_ranks(2, gathered, 25)[0][0][0][:6] == [0.0] * 5 + [0.0]  # positions -5..-1 are zero, then 0
