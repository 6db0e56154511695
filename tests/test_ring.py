"""Ring attention against float64 attention on the unsharded sequence, on gloo ranks."""

from __future__ import annotations

import itertools
from functools import partial

import pytest
import torch
import torch.nn.functional as F

import hf_ring
from hf_ring.ops.ring import block_attention
from hf_ring.ops.schedule import Block
from testkit.oracle import attention, rel_err
from testkit.spawn import run_ranks

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
NAMES = ("out", "dq", "dk", "dv")


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    """Single-device SDPA in the layout of the ring: ``[B, N, H, D]``."""
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, enable_gqa=True).transpose(1, 2)


def _grads(fn, xs: list[torch.Tensor], dout: torch.Tensor) -> list[torch.Tensor]:
    """``[fn(*xs), *d(fn)/d(xs)]`` for the upstream gradient ``dout``."""
    xs = [x.detach().requires_grad_() for x in xs]
    out = fn(*xs)
    return [out, *torch.autograd.grad(out, xs, dout.to(out.dtype))]


def ring_errors(cases: list[dict], backend: str = "auto") -> list[dict]:
    """On every rank: run each case through the ring and return rank 0's relative errors of the
    output and all gradients against float64, with single-device SDPA in the same dtype as a
    baseline."""
    rank = torch.distributed.get_rank()
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
        ring = _grads(
            partial(hf_ring.ring_attention, causal=causal, backend=backend),
            [hf_ring.shard(x.to(dtype)) for x in (q, k, v)],
            hf_ring.shard(dout),
        )
        ring = [hf_ring.unshard(x) for x in ring]
        assert all(r.dtype == dtype for r in ring)
        if rank == 0:
            results.append(
                {
                    **c,
                    **{f"ring_{n}": rel_err(x, r) for n, x, r in zip(NAMES, ring, ref)},
                    **{f"sdpa_{n}": rel_err(x, r) for n, x, r in zip(NAMES, sdpa, ref)},
                }
            )
    return results


def make_cases(world: int, dtype: str, chunk: int = 23) -> list[dict]:
    return [
        dict(B=2, N=2 * world * chunk, Hq=hq, Hkv=hkv, D=d, causal=causal, dtype=dtype, seed=i)
        for i, (causal, (hq, hkv), d) in enumerate(itertools.product((True, False), ((4, 4), (8, 2)), (64, 80)))
    ]


def check(results: list[dict]) -> None:
    for r in results:
        label = f"{r['dtype']} causal={r['causal']} Hq={r['Hq']} Hkv={r['Hkv']} D={r['D']} N={r['N']}"
        for n in NAMES:
            if r["dtype"] == "fp32":
                assert r[f"ring_{n}"] <= 1e-5, f"{label}: {n} rel err {r[f'ring_{n}']:.2e} > 1e-5"
            else:
                assert r[f"ring_{n}"] <= 2 * r[f"sdpa_{n}"], (
                    f"{label}: {n} rel err {r[f'ring_{n}']:.2e} > 2x single-device bf16 SDPA ({r[f'sdpa_{n}']:.2e})"
                )


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_ring_matches_float64_oracle(world: int, dtype: str) -> None:
    (results, *_) = run_ranks(world, ring_errors, make_cases(world, dtype))
    check(results)


@pytest.mark.parametrize("world", [2, 3])
def test_reference_backend_matches_oracle(world: int) -> None:
    (results, *_) = run_ranks(world, ring_errors, make_cases(world, "fp32")[:4], backend="reference")
    check(results)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_error_does_not_grow_with_ring_size(dtype: str) -> None:
    cases = [dict(B=1, N=8 * 64, Hq=8, Hkv=2, D=80, causal=True, dtype=dtype, seed=7)]
    (one, *_) = run_ranks(1, ring_errors, cases)
    (four, *_) = run_ranks(4, ring_errors, cases)
    for n in NAMES:
        base = max(one[0][f"ring_{n}"], 1e-7 if dtype == "fp32" else 0.0)
        assert four[0][f"ring_{n}"] <= 2 * base, f"{dtype} {n}: P=4 {four[0][f'ring_{n}']:.2e} vs P=1 {base:.2e}"


def test_single_process_without_distributed() -> None:
    """No process group at all: plain attention, same results as the oracle."""
    assert not torch.distributed.is_initialized()
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 37, 8, 80, generator=g, requires_grad=True)
    k = torch.randn(2, 37, 2, 80, generator=g, requires_grad=True)
    v = torch.randn(2, 37, 2, 80, generator=g, requires_grad=True)
    out = hf_ring.ring_attention(q, k, v)
    ref = attention(q, k, v, causal=True)
    assert rel_err(out, ref) <= 1e-5
    dout = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), dout)
    want = torch.autograd.grad(ref, (q, k, v), dout.double())
    for n, x, r in zip(NAMES[1:], got, want):
        assert rel_err(x, r) <= 1e-5, n


def ring_peak_bytes(n: int, hq: int, hkv: int, d: int) -> dict:
    """Peak bytes of the tensors one fwd+bwd of the ring creates on this rank (inputs and ``dout``
    excluded), with the sizes of q and of k on this rank."""
    from testkit.live_tensors import LiveTensorBytes

    size = torch.distributed.get_world_size()
    g = torch.Generator().manual_seed(3)
    q, k, v, dout = (hf_ring.shard(torch.randn(1, n, h, d, generator=g)) for h in (hq, hkv, hkv, hq))
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    with LiveTensorBytes() as mem:
        out = hf_ring.ring_attention(q, k, v)
        grads = torch.autograd.grad(out, (q, k, v), dout)
        del out, grads
    return {"P": size, "peak": mem.peak, "q": q.numel() * 4, "kv": k.numel() * 4}


@pytest.mark.parametrize("world", [1, 2, 3])
def test_ring_memory_per_rank(world: int) -> None:
    """The tensors a fwd+bwd creates on a rank, counted in bytes of its q shard (q) and k shard (kv):
    one rank makes a single kernel call (out, dq, dk, dv: 2 q + 2 kv); a ring rank adds the K/V
    message and its receive buffer (4 kv), the travelling float32 dK/dV pair (4 kv) and one kernel
    call's block gradients (q + 2 kv) -- nothing that outlives its step."""
    (r, *_) = run_ranks(world, ring_peak_bytes, 6 * 160, 8, 2, 80)
    q, kv = r["q"], r["kv"]
    budget = 2 * q + 2 * kv if world == 1 else 3 * q + 10 * kv
    lse = r["q"] // 80 * 2  # the float32 log-sum-exp and its merge temporaries
    assert r["peak"] <= budget + lse, f"P={world}: peak {r['peak']} B > budget {budget} + {lse} B"


def contiguous_layout_errors(n: int) -> list[float]:
    """Rank 0's view of the errors of ``order="contiguous"`` (rank r holds chunk r of P) against
    float64 attention: out, dq, dk, dv, gathered whole."""
    rank, size = torch.distributed.get_rank(), torch.distributed.get_world_size()
    g = torch.Generator().manual_seed(11)
    q, dout = (torch.randn(1, n, 8, 80, generator=g, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(1, n, 2, 80, generator=g, dtype=torch.float64) for _ in range(2))
    ref = _grads(partial(attention, causal=True), [q, k, v], dout)

    def chunk(x: torch.Tensor) -> torch.Tensor:
        return x.chunk(size, dim=1)[rank].float().contiguous()

    ring = _grads(partial(hf_ring.ring_attention, order="contiguous"), [chunk(x) for x in (q, k, v)], chunk(dout))
    errs = []
    for got, want in zip(ring, ref):
        parts = [torch.empty_like(got) for _ in range(size)]
        torch.distributed.all_gather(parts, got.contiguous())
        errs.append(rel_err(torch.cat(parts, dim=1), want))
    return errs


def test_contiguous_layout_matches_float64_oracle() -> None:
    """The comparison layout runs the same Function (P=3, GQA 8/2, D=80, 3 x 17 tokens)."""
    (errs, *_) = run_ranks(3, contiguous_layout_errors, 3 * 17)
    for name, e in zip(NAMES, errs):
        assert e <= 1e-5, f"{name}: {e:.2e}"


# ------------------------------------------------------------------------- block_attention (one rank)
BLOCKS = (  # query rows of 13 against key rows of 21: causal, banded, unmasked; row 12 in no block
    Block((0, 5), (0, 5), causal=True, unit=0),
    Block((5, 9), (2, 12), causal=False, unit=0, window=(3, 1)),
    Block((0, 5), (15, 21), causal=False, unit=0),
    Block((9, 12), (12, 15), causal=False, unit=0),
)


def _blocks_mask(blocks: tuple[Block, ...], sq: int, sk: int) -> torch.Tensor:
    """``[Sq, Sk]``: the pairs the blocks compute, from ``Block``'s docstring (bands bottom-right)."""
    mask = torch.zeros(sq, sk, dtype=torch.bool)
    for b in blocks:
        nq, nk = b.q[1] - b.q[0], b.kv[1] - b.kv[0]
        i, j = torch.arange(nq)[:, None], torch.arange(nk)[None, :]
        keep = torch.ones(nq, nk, dtype=torch.bool)
        if b.window is not None:
            off = j - i - (nk - nq)
            keep = (off >= -b.window[0]) & (off <= b.window[1])
        elif b.causal:
            keep = j <= i
        mask[b.q[0] : b.q[1], b.kv[0] : b.kv[1]] |= keep
    return mask


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("extras", ["plain", "softcap_sinks", "row_sinks"])
def test_block_attention_matches_float64(dtype: torch.dtype, extras: str) -> None:
    """Query rows against other key rows (GQA 6/2, head_dim 80), blocks of every mask kind and a row
    in none, with soft-capping and sinks: out and every gradient against the oracle under the same
    pairs."""
    g = torch.Generator().manual_seed(3)
    q, dout = (torch.randn(1, 13, 6, 80, generator=g, dtype=torch.float64) * s for s in (2.0, 1.0))
    k, v = (torch.randn(1, 21, 2, 80, generator=g, dtype=torch.float64) for _ in range(2))
    cap = 4.0 if extras != "plain" else None
    sinks = None if extras == "plain" else torch.randn(*((1, 13) if extras == "row_sinks" else ()), 6, generator=g)
    xs = [x.to(dtype).requires_grad_() for x in (q, k, v, *(() if sinks is None else (sinks,)))]
    out = block_attention(*xs[:3], BLOCKS, softcap=cap, sinks=xs[3] if sinks is not None else None)
    got = [out, *torch.autograd.grad(out, xs, dout.to(dtype))]
    refs = [x.to(dtype).double().requires_grad_() for x in (q, k, v, *(() if sinks is None else (sinks,)))]
    mask = _blocks_mask(BLOCKS, 13, 21)
    ref = attention(*refs[:3], mask=mask, softcap=cap, sinks=refs[3] if sinks is not None else None)
    want = [ref, *torch.autograd.grad(ref, refs, dout)]
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    for name, a, w in zip(("out", "dq", "dk", "dv", "dsinks"), got, want):
        assert rel_err(a, w) <= tol, (name, rel_err(a, w))
    assert out[0, 12].abs().max() == 0  # the row in no block


def test_block_attention_refuses_what_it_cannot_address() -> None:
    q, k = torch.randn(1, 4, 2, 8), torch.randn(1, 6, 2, 8)
    with pytest.raises(ValueError, match=r"is not in rows \(unit=0\)"):
        block_attention(q, k, k, [Block((0, 1), (0, 1), causal=True)])  # halves, not rows
    with pytest.raises(ValueError, match=r"is not in rows \(unit=0\) of q 4 and k 6"):
        block_attention(q, k, k, [Block((0, 4), (0, 7), causal=False, unit=0)])
    with pytest.raises(ValueError, match=r"differ in length with B > 1"):
        block_attention(q.expand(2, -1, -1, -1), k.expand(2, -1, -1, -1), k.expand(2, -1, -1, -1), [])
    with pytest.raises(ValueError, match=r"block_attention: query heads \(2\) must be a multiple"):
        block_attention(q, torch.randn(1, 6, 3, 8), torch.randn(1, 6, 3, 8), [])
