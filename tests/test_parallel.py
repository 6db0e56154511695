"""setup_context_parallel: the DP x CP process groups, and group=None meaning the CP group."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import hf_ring
from hf_ring.parallel import context_parallel_state, default_group
from testkit.oracle import attention, rel_err
from testkit.spawn import run_ranks


def _members(group: dist.ProcessGroup) -> list[int]:
    """Global ranks of ``group``, as its members see them (one all-gather inside the group)."""
    me = torch.tensor([dist.get_rank()])
    got = [torch.empty_like(me) for _ in range(dist.get_world_size(group))]
    dist.all_gather(got, me, group=group)
    return [int(t) for t in got]


def _rank_sum(group: dist.ProcessGroup) -> int:
    t = torch.tensor([dist.get_rank()])
    dist.all_reduce(t, group=group)
    return int(t)


def groups(cp_size: int) -> dict:
    """On every rank: build the groups and report them."""
    cp = hf_ring.setup_context_parallel(cp_size)
    return dict(
        rank=dist.get_rank(),
        cp_rank=cp.cp_rank,
        cp_size=cp.cp_size,
        dp_rank=cp.dp_rank,
        dp_size=cp.dp_size,
        cp_members=_members(cp.cp_group),
        dp_members=_members(cp.dp_group),
        cp_sum=_rank_sum(cp.cp_group),
        dp_sum=_rank_sum(cp.dp_group),
        group_rank=dist.get_rank(cp.cp_group),
        default_is_cp=default_group() is cp.cp_group,
        state_is_cp=context_parallel_state() is cp,
    )


def test_cp2_on_four_ranks() -> None:
    res = run_ranks(4, groups, 2)
    for r, g in enumerate(res):
        assert g["rank"] == r
        assert (g["cp_rank"], g["cp_size"], g["dp_rank"], g["dp_size"]) == (r % 2, 2, r // 2, 2)
        assert g["cp_members"] == ([0, 1] if r < 2 else [2, 3]), f"rank {r}"
        assert g["dp_members"] == ([0, 2] if r % 2 == 0 else [1, 3]), f"rank {r}"
        assert g["cp_sum"] == (1 if r < 2 else 5)
        assert g["dp_sum"] == (2 if r % 2 == 0 else 4)
        assert g["group_rank"] == g["cp_rank"]
        assert g["default_is_cp"] and g["state_is_cp"]


@pytest.mark.parametrize("cp_size", [1, 4])
def test_degenerate_grids_on_four_ranks(cp_size: int) -> None:
    """cp_size 4: one CP group of all ranks and singleton DP groups; cp_size 1: the reverse."""
    for r, g in enumerate(run_ranks(4, groups, cp_size)):
        if cp_size == 4:
            assert (g["cp_rank"], g["cp_size"], g["dp_rank"], g["dp_size"]) == (r, 4, 0, 1)
            assert g["cp_members"] == [0, 1, 2, 3] and g["dp_members"] == [r]
        else:
            assert (g["cp_rank"], g["cp_size"], g["dp_rank"], g["dp_size"]) == (0, 1, r, 4)
            assert g["cp_members"] == [r] and g["dp_members"] == [0, 1, 2, 3]


def default_group_ring(causal: bool) -> dict:
    """On every rank: two CP groups of 2 attend to different sequences with group=None (shard,
    ring and unshard all default to the CP group); returns the errors against float64."""
    cp = hf_ring.setup_context_parallel(2)
    g = torch.Generator().manual_seed(1000 + cp.dp_rank)  # different data in each CP group
    b, n, hq, hkv, d = 1, 2 * 2 * 7, 4, 2, 16
    q, k, v, dout = (torch.randn(b, n, h, d, generator=g, dtype=torch.float64) for h in (hq, hkv, hkv, hq))
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    ref = attention(q, k, v, causal)
    ref_grads = torch.autograd.grad(ref, [q, k, v], dout)
    xs = [hf_ring.shard(x.detach().float()).requires_grad_() for x in (q, k, v)]
    out = hf_ring.ring_attention(*xs, causal=causal)
    grads = torch.autograd.grad(out, xs, hf_ring.shard(dout).float())
    got = [hf_ring.unshard(t) for t in (out, *grads)]
    explicit = hf_ring.ring_attention(*xs, causal=causal, group=cp.cp_group)
    return dict(
        dp_rank=cp.dp_rank,
        errors=[rel_err(x, r) for x, r in zip(got, (ref.detach(), *ref_grads))],
        same_as_explicit_group=torch.equal(explicit, out),
        local_rows=out.shape[1],
        checksum=float(ref.detach().sum()),
    )


@pytest.mark.parametrize("causal", [True, False])
def test_group_none_uses_the_cp_group(causal: bool) -> None:
    res = run_ranks(4, default_group_ring, causal)
    for r, x in enumerate(res):
        assert x["local_rows"] == 2 * 2 * 7 // 2, f"rank {r}: sharded over the world instead of its CP group"
        for name, err in zip(("out", "dq", "dk", "dv"), x["errors"]):
            assert err <= 1e-5, f"rank {r} (dp_rank {x['dp_rank']}): {name} rel err {err:.2e}"
        assert x["same_as_explicit_group"]
    # the two CP groups really did attend to different data
    assert res[0]["checksum"] == res[1]["checksum"] != res[2]["checksum"] == res[3]["checksum"]


def group_timeouts(timeout) -> dict:
    """On every rank: the timeout and name of each group ``setup_context_parallel`` builds."""
    cp = hf_ring.setup_context_parallel(4, ulysses_size=2, timeout=timeout)

    def of(g: dist.ProcessGroup) -> tuple[float, str]:
        return g._get_backend(torch.device("cpu")).options._timeout.total_seconds(), g.group_desc

    world = of(dist.group.WORLD)[0]
    return {"state": cp.timeout.total_seconds(), "world": world, "groups": [of(g) for g in
            (cp.cp_group, cp.dp_group, cp.ulysses_group, cp.ring_group)]}  # fmt: skip


def test_groups_take_the_timeout() -> None:
    """``timeout`` reaches every group (a frozen rank then makes the others raise after it, not after
    torch's 30 minutes; tests/test_checkpoints.py shows it end to end); by default the groups take
    the default group's timeout."""
    from datetime import timedelta

    for r in run_ranks(4, group_timeouts, timedelta(seconds=7)):
        assert r["state"] == 7.0
        assert r["groups"] == [(7.0, f"hf_ring_{name}") for name in ("cp", "dp", "ulysses", "ring")]
    for r in run_ranks(4, group_timeouts, None):
        assert r["state"] == r["world"] and {t for t, _ in r["groups"]} == {r["world"]}
    with pytest.raises(RuntimeError, match="timeout must be a positive timedelta or seconds"):
        run_ranks(4, group_timeouts, -1)
