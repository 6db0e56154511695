"""DeepSpeed-Ulysses head parallelism, alone or as the inner level of a Ulysses x ring hybrid.

A context-parallel group of ``P = U * R`` ranks: ``U`` consecutive ranks form a Ulysses group, the
ranks with the same place ``u`` in their Ulysses group form a ring of ``R`` (CP rank
``= ring_pos * U + u``). The sequence of ``N`` tokens is laid out in two levels
(``hf_ring.ops.zigzag.hybrid``): the zigzag over the ``R`` ring positions, then each ring
position's shard cut into ``U`` contiguous pieces::

    P = 4 = U 2 x R 2, sequence cut into 2R = 4 chunks c0 c1 c2 c3
    ring position 0 holds [c0 | c3]:  rank 0 = (r 0, u 0) holds its first half, rank 1 its second
    ring position 1 holds [c1 | c2]:  rank 2 = (r 1, u 0), rank 3 = (r 1, u 1) likewise

Attention then runs in three moves: an all-to-all inside the Ulysses group trades this rank's
``[N/P tokens, all heads]`` for ``[N/R tokens, H/U heads]`` -- the whole zigzag shard of its ring
position, on its ``U``-th of the heads --, exact ring attention over the ring group on those heads
(one block kernel call when ``R = 1``: pure Ulysses), and the inverse all-to-all back. In backward
every all-to-all is undone by its inverse. Q, K and V travel as one message. This module imports
only torch.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import Tensor

from .checks import check_qkv
from .comm import Ring, check_same_across_ranks, group_size_rank
from .kernels import BlockKernel
from .ring import head_groups_of, ring_attention
from .schedule import Schedule
from .windows import MaskPlan, masked_attention

__all__ = ["all_to_all", "from_heads_grads", "heads_to_rows", "kv_replication", "rows_to_heads", "to_heads",
           "ulysses_ring_attention"]  # fmt: skip


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, scatter_dim, gather_dim):  # type: ignore[override]
        ctx.group, ctx.scatter_dim, ctx.gather_dim = group, scatter_dim, gather_dim
        return _all_to_all(x, group, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        # the inverse all-to-all: what was gathered is scattered back and vice versa
        return _all_to_all(grad, ctx.group, ctx.gather_dim, ctx.scatter_dim), None, None, None


def _all_to_all(x: Tensor, group: dist.ProcessGroup | None, scatter_dim: int, gather_dim: int) -> Tensor:
    size, _ = group_size_rank(group)
    if size == 1:
        return x
    send = torch.stack(x.chunk(size, dim=scatter_dim)).contiguous()  # (U, ...): row j goes to rank j
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return torch.cat(recv.unbind(0), dim=gather_dim)  # row j came from rank j


def all_to_all(x: Tensor, group: dist.ProcessGroup | None, *, scatter_dim: int, gather_dim: int) -> Tensor:
    """Differentiable all-to-all over ``group`` (``None``: the world group) of ``U`` ranks.

    ``x`` is cut into ``U`` equal chunks along ``scatter_dim`` (its length must be a multiple of
    ``U``); chunk ``j`` goes to rank ``j``, and the chunks this rank receives are laid end to end
    along ``gather_dim`` in rank order. The backward is the inverse all-to-all (``scatter_dim`` and
    ``gather_dim`` swapped). Example: ``[B, S, H, D]`` with ``scatter_dim=2, gather_dim=1`` ->
    ``[B, U * S, H / U, D]``.
    """
    scatter_dim, gather_dim = scatter_dim % x.dim(), gather_dim % x.dim()
    return _AllToAll.apply(x, group, scatter_dim, gather_dim)


def kv_replication(hkv: int, ulysses_size: int) -> int:
    """How many times each K/V head is repeated before the all-to-all: ``U / gcd(Hkv, U)``.

    That is the least ``r`` such that ``U`` divides ``r * Hkv`` (each rank then receives
    ``r * Hkv / U`` whole K/V heads): ``1`` -- K/V travel unexpanded -- whenever ``U`` divides
    ``Hkv``; e.g. ``Hkv = 2, U = 4`` gives ``r = 2``, ``Hkv = 1, U = 4`` gives ``r = 4``.
    """
    return ulysses_size // math.gcd(hkv, ulysses_size)


def _dims(x: Tensor) -> list[int]:
    """The first four sizes of ``x``, ``-1`` for missing ones (and a fifth ``-2`` for extra ones)."""
    return [*x.shape[:4], *[-1] * (4 - min(x.dim(), 4))] if x.dim() <= 4 else [*x.shape[:3], -2]


def _check(q: Tensor, k: Tensor, v: Tensor, ulysses_size: int, head_groups: int = 1) -> None:
    check_qkv(q, k, v, "ulysses_ring_attention")
    if q.shape[2] % ulysses_size:
        raise ValueError(
            f"ulysses_ring_attention: ulysses_size={ulysses_size} does not divide the {q.shape[2]} query heads, "
            "so the heads cannot be split evenly across the Ulysses group. Pick a ulysses_size that divides "
            f"{q.shape[2]} in hf_ring.setup_context_parallel (ulysses_size=1 is plain ring attention)."
        )
    local = k.shape[2] * kv_replication(k.shape[2], ulysses_size) // ulysses_size
    if head_groups != 1:
        head_groups_of(q.shape[2] // ulysses_size, local, head_groups, "ulysses_ring_attention (heads per rank)")


def to_heads(
    q: Tensor, k: Tensor, v: Tensor, sinks: Tensor | None, group: dist.ProcessGroup | None, *,
    differentiable: bool = False,
) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:  # fmt: skip
    """The Ulysses all-to-all before attention: this rank's ``[B, S, H, D]`` rows of every head ->
    ``[B, U * S, H / U, D]``, the whole ring position's rows of its ``U``-th of the heads, for q, k and v
    as one message (K/V heads repeated ``kv_replication(Hkv, U)`` times first); ``sinks [Hq]`` cut to
    this rank's heads, per-row ``sinks [B, S, Hq]`` moved as the queries. ``differentiable``: through
    the all-to-all Function (its backward is the inverse all-to-all); otherwise a plain exchange."""
    u_size, u_rank = group_size_rank(group)
    b, s, hq, d = q.shape
    rep = kv_replication(k.shape[2], u_size)
    if rep > 1:  # fewer K/V heads than ranks: the fewest copies that split evenly
        k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
    hkv = k.shape[2]
    # one message: each rank's head chunk j of q, k and v side by side, (B, S, U * (hq + 2 hkv) / U, D)
    parts = [t.reshape(b, s, u_size, -1, d) for t in (q, k, v)]
    msg = torch.cat(parts, dim=3).flatten(2, 3)
    del parts
    a2a = (lambda x, sd, gd: all_to_all(x, group, scatter_dim=sd, gather_dim=gd)) if differentiable else \
        (lambda x, sd, gd: _all_to_all(x, group, sd, gd))  # fmt: skip
    msg = a2a(msg, 2, 1)  # (B, U * S, (Hq + 2 Hkv) / U, D)
    ql, kl, vl = msg.split((hq // u_size, hkv // u_size, hkv // u_size), dim=2)
    if sinks is not None and sinks.shape == (hq,):  # this rank received query heads [u Hq / U, (u + 1) Hq / U)
        sinks = sinks.view(u_size, -1)[u_rank]
    elif sinks is not None and sinks.shape == (b, s, hq):  # per-row sinks travel as the queries do
        sinks = a2a(sinks, 2, 1)
    elif sinks is not None:
        raise ValueError(f"ulysses_ring_attention: sinks must be [Hq] or [B, S, Hq], got {tuple(sinks.shape)}")
    return ql, kl, vl, sinks


def heads_to_rows(x: Tensor, group: dist.ProcessGroup | None) -> Tensor:
    """The inverse all-to-all, no autograd: ``[B, U * S, H / U, ...]`` -> ``[B, S, H, ...]``."""
    return _all_to_all(x, group, 1, 2)


def rows_to_heads(x: Tensor, group: dist.ProcessGroup | None) -> Tensor:
    """The all-to-all before attention for one tensor, no autograd: ``[B, S, H, ...]`` -> ``[B, U * S, H / U, ...]``."""
    return _all_to_all(x, group, 2, 1)


def from_heads_grads(
    dq: Tensor, dk: Tensor, dv: Tensor, hkv: int, group: dist.ProcessGroup | None
) -> tuple[Tensor, Tensor, Tensor]:
    """The gradients of ``to_heads``'s q, k, v (``[B, U * S, H / U, D]`` each) back in this rank's rows,
    as one message (the inverse all-to-all); a repeated K/V head's copies summed. ``hkv``: the K/V heads
    before the repetition."""
    u_size, _ = group_size_rank(group)
    msg = heads_to_rows(torch.cat((dq, dk, dv), dim=2), group)  # (B, S, U * (hq + 2 hkv) / U, D)
    b, s, _, d = msg.shape
    hq_u, hkv_u = dq.shape[2], dk.shape[2]
    per = msg.view(b, s, u_size, hq_u + 2 * hkv_u, d)
    dq_, dk_, dv_ = (t.reshape(b, s, -1, d) for t in per.split((hq_u, hkv_u, hkv_u), dim=3))
    rep = kv_replication(hkv, u_size)
    if rep > 1:
        dk_, dv_ = (t.view(b, s, hkv, rep, d).sum(3) for t in (dk_, dv_))
    return dq_, dk_, dv_


def ulysses_ring_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    ulysses_group: dist.ProcessGroup | None,
    ring_group: dist.ProcessGroup | None = None,
    ring: Ring | None = None,
    causal: bool = True,
    softmax_scale: float | None = None,
    backend: str | BlockKernel = "auto",
    validate: bool = False,
    dropout_p: float = 0.0,
    attn_mask: Tensor | None = None,
    schedule: Schedule | None = None,
    mask: MaskPlan | None = None,
    softcap: float | None = None,
    sinks: Tensor | None = None,
    head_groups: int = 1,
) -> Tensor:
    """Exact attention over a sequence sharded across a Ulysses group, or a Ulysses x ring grid.

    Args:
        q: ``[B, S_local, Hq, D]``, this rank's piece of the sequence in the ``hybrid`` layout
            (``hf_ring.shard`` after ``setup_context_parallel(..., ulysses_size=U)``), with
            ``Hq % U == 0``.
        k, v: ``[B, S_local, Hkv, D]``, ``Hq % Hkv == 0``. K/V heads travel unexpanded when ``U``
            divides ``Hkv``; otherwise each is repeated ``kv_replication(Hkv, U) = U / gcd(Hkv, U)``
            times (``repeat_interleave``, the fewest copies that split evenly; their gradients are
            summed back).
        ulysses_group: the ``U`` ranks that trade sequence for heads (``None``: the world group).
        ring_group: the ``R`` ranks with the same place in their Ulysses groups, over which ring
            attention runs on ``H / U`` heads; ``None``: no ring (``R = 1``, pure Ulysses: one block
            kernel call per rank). ``ring``: a ``Ring`` instead of ``ring_group`` (benchmarks).
        causal, softmax_scale, backend, validate, dropout_p, attn_mask: as for
            ``hf_ring.ops.ring.ring_attention`` (``validate``: every rank of the grid checks, before
            the all-to-all, that all pass the same shapes; two all-gathers of 16 integers).
        schedule: packed documents: the ring schedule of this rank's ring position over the rows
            of that position's whole shard (what the all-to-all gathers: the ``U`` pieces of the
            Ulysses group end to end), one step per ring rank; ``hf_ring.shard_batch`` makes it.
        mask: a sliding window or chunked attention (``hf_ring.ops.windows.mask_plan`` of this rank's
            ring position over the batch's layout), instead of ``schedule``.
        softcap, sinks: as for ``ring_attention``; ``sinks [Hq]`` is cut to this rank's ``Hq / U`` heads
            (its gradient is zero for the other heads on this rank, and summed over the grid with
            every other parameter's gradient); per-row ``sinks [B, S_local, Hq]`` go through the
            all-to-all as the queries do.
        head_groups: the ring's head groups (``ring_attention``) over the heads each rank holds after the
            all-to-all: ``G`` must divide those K/V heads (``r * Hkv / U``).

    Returns:
        ``[B, S_local, Hq, D]`` in the dtype of ``q``, differentiable in ``q``, ``k`` and ``v``.

    ``B * U * S_local`` rows of ``Hq / U + 2 * r * Hkv / U`` heads pass through the all-to-all
    before attention, ``B * U * S_local`` rows of ``Hq / U`` heads after it (and the same in
    backward). ``S_local * R`` must be even when ``R > 1`` (the zigzag); ``hf_ring.shard_batch``
    pads the sequence to a multiple of ``hf_ring.ops.zigzag.hybrid_multiple(P, U)``.
    """
    u_size, _ = group_size_rank(ulysses_group)
    if ring is not None and ring_group is not None:
        raise ValueError("ulysses_ring_attention: pass ring_group or ring, not both")
    if ring is None:
        ring = Ring(ring_group) if ring_group is not None else _NoRing()
    if validate:  # before the all-to-all, which would fail or hang on ranks that disagree
        _validate([*_dims(q), *_dims(k), *_dims(v), int(causal)], ulysses_group, ring)
    _check(q, k, v, u_size, head_groups)
    ql, kl, vl, sinks = to_heads(q, k, v, sinks, ulysses_group, differentiable=True)
    if mask is not None:
        if dropout_p or attn_mask is not None or schedule is not None or not causal:
            raise ValueError(
                "ulysses_ring_attention: a mask plan takes no dropout_p, attn_mask or schedule, and is causal"
            )
        out = masked_attention(
            ql, kl, vl, mask, ring=ring, softmax_scale=softmax_scale, backend=backend, softcap=softcap, sinks=sinks,
            head_groups=head_groups,
        )  # fmt: skip
        return all_to_all(out, ulysses_group, scatter_dim=1, gather_dim=2)
    out = ring_attention(
        ql,
        kl,
        vl,
        ring=ring,
        causal=causal,
        softmax_scale=softmax_scale,
        backend=backend,
        validate=False,  # the shapes after the all-to-all follow from those checked above
        dropout_p=dropout_p,
        attn_mask=attn_mask,
        schedule=schedule,
        softcap=softcap,
        sinks=sinks,
        head_groups=head_groups,
    )  # (B, U * S, Hq / U, D)
    return all_to_all(out, ulysses_group, scatter_dim=1, gather_dim=2)  # (B, S, Hq, D)


def _validate(meta: list[int], ulysses_group: dist.ProcessGroup | None, ring: Ring) -> None:
    """Raise ``ValueError`` on every rank of the Ulysses x ring grid unless all pass the same ``meta``:
    one check inside the Ulysses group, then one along the ring that also carries whether the first
    failed (every ring meets every Ulysses group, so a mismatch anywhere reaches every rank)."""
    what = "ulysses_ring_attention inputs [q, k, v shapes, causal]"
    err: ValueError | None = None
    try:
        check_same_across_ranks(meta, ulysses_group, what)
    except ValueError as e:
        err = e
    if ring.size > 1:
        try:
            check_same_across_ranks([*meta, int(err is not None)], ring.group, what + " [+ Ulysses group disagreed]")
        except ValueError as e:
            err = err or e
    if err is not None:
        raise err


class _NoRing:
    """A ring of one rank (pure Ulysses): ``ring_attention`` makes one kernel call and never
    opens a channel."""

    size, rank, group = 1, 0, None

    def channel(self, tag: int = 0) -> None:  # pragma: no cover - never called for one rank
        raise RuntimeError("a ring of one rank has no channel")
