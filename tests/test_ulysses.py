"""Ulysses and Ulysses x ring attention against float64 attention on the unsharded sequence (gloo
ranks), the hybrid layout, the model-level step against one process, and the errors."""

from __future__ import annotations

from functools import partial

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import hf_ring
from hf_ring.ops import ulysses as ops_ulysses
from hf_ring.ops.zigzag import hybrid, hybrid_multiple
from testkit.oracle import attention, rel_err
from testkit.spawn import run_ranks

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
NAMES = ("out", "dq", "dk", "dv")


def _grads(fn, xs: list[torch.Tensor], dout: torch.Tensor) -> list[torch.Tensor]:
    """``[fn(*xs), *d(fn)/d(xs)]`` for the upstream gradient ``dout``."""
    xs = [x.detach().requires_grad_() for x in xs]
    out = fn(*xs)
    return [out, *torch.autograd.grad(out, xs, dout.to(out.dtype))]


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, enable_gqa=True).transpose(1, 2)


# ------------------------------------------------------------------------------------------ layout
@pytest.mark.parametrize("size,ulysses", [(4, 1), (4, 2), (4, 4), (6, 3), (6, 2), (8, 2)])
def test_hybrid_layout_is_zigzag_over_the_ring_then_contiguous(size: int, ulysses: int) -> None:
    """Rank ``r * U + u`` holds piece ``u`` of ring position ``r``'s zigzag shard; the pieces of all
    ranks cover the sequence once, and each ring position's pieces laid end to end are its shard."""
    ring = size // ulysses
    n = hybrid_multiple(size, ulysses) * 3
    x = torch.arange(n)
    pieces = [hybrid(x, 0, size, rank, ulysses) for rank in range(size)]
    assert sorted(torch.cat(pieces).tolist()) == list(range(n))
    c = n // (2 * ring)
    for r in range(ring):
        whole = torch.cat(pieces[r * ulysses : (r + 1) * ulysses])
        assert whole.tolist() == [*range(r * c, (r + 1) * c), *range((2 * ring - 1 - r) * c, (2 * ring - r) * c)]


def test_kv_replication_is_the_fewest_copies_that_split() -> None:
    assert [ops_ulysses.kv_replication(h, 4) for h in (1, 2, 3, 4, 6, 8)] == [4, 2, 4, 1, 2, 1]
    assert ops_ulysses.kv_replication(2, 3) == 3 and ops_ulysses.kv_replication(6, 3) == 1


# ----------------------------------------------------------------------------------- attention op
def ulysses_errors(cases: list[dict], ulysses_size: int, direct: bool = False) -> list[dict]:
    """On every rank: CP over the world with ``ulysses_size``; each case through ``hf_ring.shard``
    (the hybrid layout), ``hf_ring.ring_attention`` (which routes to Ulysses) and ``hf_ring.unshard``;
    rank 0's relative errors of the output and all gradients against float64, with single-device
    SDPA in the same dtype as a baseline. ``direct``: call the op with ``ulysses_group=None`` (the
    world) and no ring instead (pure Ulysses only)."""
    world = dist.get_world_size()
    cp = hf_ring.setup_context_parallel(world, ulysses_size=ulysses_size)
    results = []
    for c in cases:
        g = torch.Generator().manual_seed(c["seed"])
        b, n, hq, hkv, d = c["B"], c["N"], c["Hq"], c["Hkv"], c["D"]
        dtype = DTYPES[c["dtype"]]
        q = torch.randn(b, n, hq, d, generator=g, dtype=torch.float64)
        k = torch.randn(b, n, hkv, d, generator=g, dtype=torch.float64)
        v = torch.randn(b, n, hkv, d, generator=g, dtype=torch.float64)
        dout = torch.randn(b, n, hq, d, generator=g, dtype=torch.float64)
        causal = c["causal"]
        ref = _grads(partial(attention, causal=causal), [q, k, v], dout)
        sdpa = _grads(partial(_sdpa, causal=causal), [x.to(dtype) for x in (q, k, v)], dout)
        if direct:
            fn = partial(ops_ulysses.ulysses_attention, ulysses_group=None, causal=causal, validate=True)
        else:
            fn = partial(hf_ring.ring_attention, causal=causal, validate=True)
        got = _grads(fn, [hf_ring.shard(x.to(dtype)) for x in (q, k, v)], hf_ring.shard(dout))
        assert got[0].shape == (b, n // world, hq, d)
        assert all(x.dtype == dtype for x in got)
        got = [hf_ring.unshard(x) for x in got]
        if cp.cp_rank == 0:
            results.append(
                {
                    **c,
                    **{f"uly_{m}": rel_err(x, r) for m, x, r in zip(NAMES, got, ref)},
                    **{f"sdpa_{m}": rel_err(x, r) for m, x, r in zip(NAMES, sdpa, ref)},
                }
            )
    return results


def make_cases(world: int, ulysses: int, dtype: str, heads: tuple, chunk: int = 5) -> list[dict]:
    n = hybrid_multiple(world, ulysses) * chunk
    out = []
    for i, (causal, (hq, hkv), d) in enumerate((c, h, d) for c in (True, False) for h in heads for d in (64, 80)):
        out.append(dict(B=2, N=n, Hq=hq, Hkv=hkv, D=d, causal=causal, dtype=dtype, seed=i))
    return out


def check(results: list[dict]) -> None:
    assert results
    for r in results:
        label = f"{r['dtype']} causal={r['causal']} Hq={r['Hq']} Hkv={r['Hkv']} D={r['D']} N={r['N']}"
        for m in NAMES:
            if r["dtype"] == "fp32":
                assert r[f"uly_{m}"] <= 1e-5, f"{label}: {m} rel err {r[f'uly_{m}']:.2e} > 1e-5"
            else:
                assert r[f"uly_{m}"] <= 2 * r[f"sdpa_{m}"], (
                    f"{label}: {m} rel err {r[f'uly_{m}']:.2e} > 2x single-device bf16 SDPA ({r[f'sdpa_{m}']:.2e})"
                )


@pytest.mark.parametrize(
    "world,ulysses,heads",
    [
        (2, 2, ((4, 4), (8, 2), (6, 1))),  # pure Ulysses 2
        (4, 4, ((8, 8), (8, 2), (8, 1), (4, 4))),  # pure Ulysses 4; fewer K/V heads than U
        (4, 2, ((4, 4), (8, 2), (6, 1))),  # Ulysses 2 x ring 2
    ],
    ids=["U2", "U4", "U2xR2"],
)
def test_ulysses_matches_float64_oracle(world: int, ulysses: int, heads: tuple) -> None:
    check(run_ranks(world, ulysses_errors, make_cases(world, ulysses, "fp32", heads), ulysses)[0])


def test_ulysses_bf16_within_twice_sdpa() -> None:
    cases = make_cases(4, 2, "bf16", ((8, 2),))
    check(run_ranks(4, ulysses_errors, cases, 2)[0])


def test_op_with_the_world_as_ulysses_group() -> None:
    """The op itself with ``ulysses_group=None`` (the world) and no ring, GQA 8/1 over 4 ranks."""
    cases = [dict(B=1, N=4 * 9, Hq=8, Hkv=1, D=80, causal=True, dtype="fp32", seed=3)]
    check(run_ranks(4, ulysses_errors, cases, 4, direct=True)[0])
