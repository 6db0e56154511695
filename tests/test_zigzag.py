"""shard / unshard: the exact zigzag layout and the round trip, on gloo ranks."""

from __future__ import annotations

import math

import pytest
import torch

import hf_ring
from testkit.spawn import run_ranks

DIMS = (0, 1, 2, -1)
CHUNKS = (1, 3, 5)  # rows per chunk of 2P (odd on purpose)
OTHER = (2, 3, 2)  # sizes of the other axes of a 3-D tensor


def full_shape(dim: int, n: int) -> tuple[int, ...]:
    shape = list(OTHER)
    shape[dim] = n
    return tuple(shape)


def round_trips(dims: tuple[int, ...], chunks: tuple[int, ...]) -> list[dict]:
    """On every rank: shard then unshard an arange tensor along each dim; report what happened."""
    size = torch.distributed.get_world_size()
    out = []
    for dim in dims:
        for c in chunks:
            n = 2 * size * c
            shape = full_shape(dim, n)
            x = torch.arange(math.prod(shape)).reshape(shape).float()
            s = hf_ring.shard(x, dim=dim)
            u = hf_ring.unshard(s, dim=dim)
            out.append(
                dict(dim=dim, c=c, shard_shape=tuple(s.shape), equal=torch.equal(u, x), dtype=str(u.dtype))
            )
    return out


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_round_trip(world: int) -> None:
    for rank, results in enumerate(run_ranks(world, round_trips, DIMS, CHUNKS)):
        assert len(results) == len(DIMS) * len(CHUNKS)
        for r in results:
            want = list(full_shape(r["dim"], 2 * world * r["c"]))
            want[r["dim"]] //= world
            assert r["shard_shape"] == tuple(want), (rank, r)
            assert r["equal"], f"rank {rank}: unshard(shard(x)) != x for dim={r['dim']} chunk={r['c']}"
            assert r["dtype"] == "torch.float32"


def zigzag_positions(dim: int, chunk: int) -> list[list[int]]:
    """On every rank: which global positions along ``dim`` this rank's shard holds."""
    size = torch.distributed.get_world_size()
    n = 2 * size * chunk
    pos = torch.arange(n).reshape([n if d == dim % 3 else 1 for d in range(3)])
    x = pos.expand(full_shape(dim, n)).contiguous()
    s = hf_ring.shard(x, dim=dim).movedim(dim, 0)
    return s.reshape(s.shape[0], -1)[:, 0].tolist()


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("dim", [1, -1])
def test_zigzag_layout(world: int, dim: int) -> None:
    """Rank r holds chunks r and 2P-1-r of 2P, in that order."""
    c = 3
    per_rank = run_ranks(world, zigzag_positions, dim, c)
    for r, got in enumerate(per_rank):
        first, second = r, 2 * world - 1 - r
        want = list(range(first * c, (first + 1) * c)) + list(range(second * c, (second + 1) * c))
        assert got == want, f"rank {r} of {world}"
    # together the shards hold every position exactly once
    assert sorted(p for got in per_rank for p in got) == list(range(2 * world * c))


def unshard_distinct(dim: int, chunk: int) -> tuple[list[int], tuple[int, ...], bool]:
    """On every rank: unshard a local tensor whose values identify (rank, local row); returns the
    values along ``dim``, the shape, and whether the other axes were carried along intact."""
    rank = torch.distributed.get_rank()
    local = torch.arange(2 * chunk) + 100 * rank  # local row i of rank r holds 100 r + i
    shape = [2, 2, 2]
    shape[dim] = 2 * chunk
    x = local.reshape([-1 if d == dim % 3 else 1 for d in range(3)]).expand(shape)
    u = hf_ring.unshard(x, dim=dim).movedim(dim, 0)
    flat = u.reshape(u.shape[0], -1)
    return flat[:, 0].tolist(), tuple(u.shape), torch.equal(flat, flat[:, :1].expand_as(flat))


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("dim", [0, 2])
def test_unshard_of_different_values(world: int, dim: int) -> None:
    """Global chunk r comes from rank r's first half, chunk 2P-1-r from its second half."""
    c = 3
    want: list[int] = [0] * (2 * world * c)
    for r in range(world):
        for i in range(c):
            want[r * c + i] = 100 * r + i
            want[(2 * world - 1 - r) * c + i] = 100 * r + c + i
    for r, (got, shape, intact) in enumerate(run_ranks(world, unshard_distinct, dim, c)):
        assert got == want, f"rank {r} of {world}"
        assert shape == (2 * world * c, 2, 2) and intact


def test_single_process_is_identity() -> None:
    """Without torch.distributed, shard and unshard return their input."""
    assert not torch.distributed.is_initialized()
    x = torch.randn(2, 7, 3)
    assert hf_ring.shard(x) is x
    assert hf_ring.unshard(x, dim=-1) is x
