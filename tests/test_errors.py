"""Every bad input of the public API raises ValueError with its message, and ranks that disagree
raise on every rank instead of hanging."""

from __future__ import annotations

import importlib
import os
import re
from typing import Any

import pytest
import torch

import hf_ring
from testkit.comm import NoCommRing
from testkit.spawn import run_ranks

CUDA = torch.cuda.is_available()


def qkv(b: int = 1, s: int = 4, hq: int = 4, hkv: int = 2, d: int = 8, **kw: Any) -> tuple[torch.Tensor, ...]:
    return torch.randn(b, s, hq, d, **kw), torch.randn(b, s, hkv, d, **kw), torch.randn(b, s, hkv, d, **kw)


def catch(fn: Any, *args: Any, **kwargs: Any) -> str | None:
    """The message of the ValueError that ``fn`` raises, or None (for workers: plain values only)."""
    try:
        fn(*args, **kwargs)
    except ValueError as e:
        return str(e)
    return None


# ---------------------------------------------------------------- single process: local checks


def test_query_heads_not_multiple_of_kv_heads() -> None:
    q, k, v = qkv(hq=6, hkv=4)
    with pytest.raises(ValueError, match=r"query heads \(6\) must be a multiple of key/value heads \(4\)"):
        hf_ring.ring_attention(q, k, v)


def test_dtype_mismatch() -> None:
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"dtypes differ \(torch.float32, torch.bfloat16, torch.float32\)"):
        hf_ring.ring_attention(q, k.bfloat16(), v)


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_device_mismatch() -> None:
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"on different devices \(cuda:0, cpu, cpu\)"):
        hf_ring.ring_attention(q.cuda(), k, v)


@pytest.mark.parametrize(
    "q_shape, kv_shape",
    [
        ((2, 4, 4, 8), (1, 4, 2, 8)),  # batch
        ((1, 4, 4, 8), (1, 6, 2, 8)),  # local sequence length
        ((1, 4, 4, 8), (1, 4, 2, 16)),  # head_dim
    ],
    ids=["batch", "seq", "head_dim"],
)
def test_q_and_kv_disagree(q_shape: tuple, kv_shape: tuple) -> None:
    q, k, v = torch.randn(q_shape), torch.randn(kv_shape), torch.randn(kv_shape)
    msg = re.escape(f"q {q_shape} and k/v {kv_shape} must agree on batch, local sequence length and head_dim")
    with pytest.raises(ValueError, match=msg):
        hf_ring.ring_attention(q, k, v)


def test_k_v_shape_mismatch() -> None:
    q, k, _ = qkv()
    v = torch.randn(1, 4, 1, 8)
    with pytest.raises(ValueError, match=r"k \(1, 4, 2, 8\) and v \(1, 4, 1, 8\) must have the same shape"):
        hf_ring.ring_attention(q, k, v)


@pytest.mark.parametrize("which", ["q", "k", "v"])
def test_wrong_ndim(which: str) -> None:
    xs = dict(zip("qkv", qkv()))
    xs[which] = xs[which].flatten(2)  # [B, S, H*D]: the layout of a projection, not of attention
    with pytest.raises(ValueError, match=r"expects q \[B, S, Hq, D\] and k, v \[B, S, Hkv, D\]; got q "):
        hf_ring.ring_attention(xs["q"], xs["k"], xs["v"])


def test_dropout_not_supported() -> None:
    with pytest.raises(ValueError, match=r"dropout_p=0.1 is not supported .* attention_dropout to 0"):
        hf_ring.ring_attention(*qkv(), dropout_p=0.1)


def test_attn_mask_not_supported() -> None:
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"explicit attn_mask is not supported.*hf_ring.shard_batch"):
        hf_ring.ring_attention(q, k, v, attn_mask=torch.ones(4, 4, dtype=torch.bool))


def test_unknown_backend() -> None:
    with pytest.raises(ValueError, match=r"unknown attention backend 'cudn' \(did you mean 'cudnn'\?\); choose one of"):
        hf_ring.ring_attention(*qkv(), backend="cudn")
    with pytest.raises(ValueError, match=r"backend='cudnn' needs CUDA tensors in float16/bfloat16"):
        hf_ring.ring_attention(*qkv(), backend="cudnn")


def test_flash_attn_backend_on_cpu() -> None:
    with pytest.raises(ValueError, match=r"backend='flash_attn' needs CUDA tensors in float16/bfloat16"):
        hf_ring.ring_attention(*qkv(), backend="flash_attn")
    with pytest.raises(ValueError, match=r"got torch.bfloat16 on cpu"):
        hf_ring.ring_attention(*qkv(dtype=torch.bfloat16), backend="flash_attn")


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_torch_backend_cuda_fp32() -> None:
    with pytest.raises(ValueError, match=r"backend='torch' has no kernel for torch.float32 on cuda"):
        hf_ring.ring_attention(*qkv(device="cuda"), backend="torch")


def test_unknown_order() -> None:
    with pytest.raises(ValueError, match=r"unknown order 'striped'"):
        hf_ring.ring_attention(*qkv(), order="striped")


def test_setup_without_launcher(monkeypatch: pytest.MonkeyPatch) -> None:
    assert not torch.distributed.is_initialized()
    for var in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(
        RuntimeError, match=r"torch.distributed is not initialised and no launcher environment"
    ):
        hf_ring.setup_context_parallel(2)
    assert "RANK" not in os.environ


# ---------------------------------------------------------------- several ranks


def odd_local_length() -> str | None:
    """On every rank: a zigzag call with an odd local length (5 rows per rank)."""
    return catch(hf_ring.ring_attention, *qkv(s=5))


@pytest.mark.parametrize("world", [2, 3])
def test_odd_local_length_zigzag(world: int) -> None:
    for msg in run_ranks(world, odd_local_length):
        assert msg is not None
        assert "local sequence length 5 is odd" in msg
        assert f"multiple of 2 * P = {2 * world}" in msg
        assert "hf_ring.shard_batch" in msg


def contiguous_odd_local_length() -> tuple[int, ...]:
    q, k, v = qkv(s=5)
    return tuple(hf_ring.ring_attention(q, k, v, order="contiguous").shape)


def test_odd_local_length_is_fine_for_contiguous() -> None:
    assert run_ranks(2, contiguous_odd_local_length) == [(1, 5, 4, 8)] * 2


def shard_different_shapes(ndim_differs: bool) -> str | None:
    """On every rank: shard a tensor whose shape differs on rank 1."""
    size, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    n = 2 * size * (3 if rank == 1 else 2)
    x = torch.zeros(1, n, 2, 1) if ndim_differs and rank == 1 else torch.zeros(1, n, 2)
    return catch(hf_ring.shard, x)


@pytest.mark.parametrize("ndim_differs", [False, True])
@pytest.mark.parametrize("world", [2, 3])
def test_shard_shape_mismatch_raises_everywhere(world: int, ndim_differs: bool) -> None:
    n0, n1 = 4 * world, 6 * world
    msgs = run_ranks(world, shard_different_shapes, ndim_differs)
    for r, msg in enumerate(msgs):
        assert msg is not None, f"rank {r} did not raise"
        assert "ranks of the context-parallel group disagree on the shape of the tensor to shard" in msg
        assert f"rank 0: [1, 1, {n0}, 2]" in msg
        assert f"rank 1: [1, 1, {n1}, 2{', 1' if ndim_differs else ''}]" in msg
    assert len(set(msgs)) == 1


def shard_indivisible(n: int) -> str | None:
    return catch(hf_ring.shard, torch.zeros(2, n))


@pytest.mark.parametrize("world", [2, 3])
def test_shard_length_not_multiple_of_2p(world: int) -> None:
    n = 2 * world * 3 + world  # a multiple of P but not of 2P
    for msg in run_ranks(world, shard_indivisible, n):
        assert msg is not None
        assert f"shard: length {n} along dim 1 is not a multiple of 2 * P = {2 * world}" in msg


def validate_mismatch(what: str) -> str | None:
    """On every rank: ring_attention(validate=True) where rank 1 differs in ``what``."""
    rank = torch.distributed.get_rank()
    odd = rank == 1
    s = 6 if odd and what == "length" else 4
    q, k, v = qkv(s=s)
    causal = not (odd and what == "causal")
    if odd and what == "dtype":
        q, k, v = q.double(), k.double(), v.double()
    return catch(hf_ring.ring_attention, q, k, v, causal=causal, validate=True)


@pytest.mark.parametrize(
    "what, rank1_row",
    [
        ("length", "[1, 6, 4, 8, 2, 1, 0"),
        ("causal", "[1, 4, 4, 8, 2, 0, 0"),
        ("dtype", "[1, 4, 4, 8, 2, 1, 3"),
    ],
)
@pytest.mark.parametrize("world", [2, 3])
def test_validate_mismatch_raises_everywhere(world: int, what: str, rank1_row: str) -> None:
    msgs = run_ranks(world, validate_mismatch, what, timeout=60)
    for r, msg in enumerate(msgs):
        assert msg is not None, f"rank {r} did not raise"
        assert "disagree on ring_attention inputs [B, S, Hq, D, Hkv, causal, dtype" in msg
        # prefixes: the rows may grow by a trailing field
        assert "rank 0: [1, 4, 4, 8, 2, 1, 0" in msg and f"rank 1: {rank1_row}" in msg


@pytest.mark.parametrize("bad", ["odd_length", "backend", "ndim"])
def test_validate_joins_the_all_gather_before_raising(monkeypatch: pytest.MonkeyPatch, bad: str) -> None:
    """Single process posing as rank 0 of 2: with validate=True the all-gather must happen even
    when this rank's own inputs are bad (here the all-gather is recorded, not run)."""
    ring_mod = importlib.import_module("hf_ring.ops.ring")
    calls: list[list[int]] = []
    monkeypatch.setattr(ring_mod, "check_same_across_ranks", lambda values, group, what: calls.append(values))
    q, k, v = qkv(s=5 if bad == "odd_length" else 4)
    if bad == "ndim":
        q = q.flatten(2)
    with pytest.raises(ValueError):
        ring_mod.ring_attention(
            q, k, v, ring=NoCommRing(2, 0), backend="cudnn" if bad == "backend" else "auto", validate=True
        )
    assert calls, "raised before the all-gather: the other ranks would hang in it"


def one_bad_rank(what: str) -> str | None:
    """On every rank: validate=True where only rank 1's own inputs are bad."""
    bad = torch.distributed.get_rank() == 1
    q, k, v = qkv(s=5 if bad and what == "odd_length" else 4)
    if bad and what == "ndim":
        q = q.flatten(2)
    backend = "cudnn" if bad and what == "backend" else "auto"
    return catch(hf_ring.ring_attention, q, k, v, backend=backend, validate=True)


@pytest.mark.parametrize("what", ["odd_length", "backend", "ndim"])
@pytest.mark.parametrize("world", [2, 3])
def test_validate_with_bad_inputs_on_one_rank(world: int, what: str) -> None:
    for r, msg in enumerate(run_ranks(world, one_bad_rank, what, timeout=60)):
        assert msg is not None and "ranks of the context-parallel group disagree" in msg, f"rank {r}: {msg}"


def setup_cp(cp_size: int) -> str | None:
    return catch(hf_ring.setup_context_parallel, cp_size)


def test_setup_cp_size_not_dividing_world() -> None:
    for msg in run_ranks(4, setup_cp, 3):
        assert msg is not None
        assert "world size 4 is not divisible by cp_size=3" in msg


def shard_batch_differing(field: str) -> tuple[str | None, float]:
    """Every rank passes the same batch except rank 1, whose ``field`` differs in one element."""
    import time

    import hf_ring

    rank = torch.distributed.get_rank()
    n = 24
    batch = {
        "input_ids": torch.arange(n)[None] % 7,
        "labels": torch.arange(n)[None] % 5,
        "position_ids": torch.arange(n)[None],
    }
    if rank == 1:
        if field == "position_ids":  # packed documents on this rank only
            batch["position_ids"] = torch.cat((torch.arange(10), torch.arange(14)))[None]
        else:
            batch[field] = batch[field].clone()
            batch[field][0, 17] += 1
    t0 = time.perf_counter()
    msg = catch(hf_ring.shard_batch, batch, group=None)
    return msg, time.perf_counter() - t0


@pytest.mark.parametrize("field", ["input_ids", "labels", "position_ids"])
def test_shard_batch_different_content_raises_everywhere(field: str) -> None:
    """Same shapes, different content on one rank: every rank raises at once, naming the field."""
    for msg, seconds in run_ranks(3, shard_batch_differing, field):
        assert msg is not None and f"{field} differs" in msg and "split_dataset_by_node" in msg, msg
        assert seconds < 30
