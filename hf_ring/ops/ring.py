"""Exact ring attention: one autograd Function driving a schedule of block kernel calls.

Each rank of a context-parallel group of ``P`` ranks holds ``1/P`` of the sequence. K/V blocks
travel around the ring (sent on while the current one is computed); partial outputs merge exactly
through their log-sum-exp in float32. In backward, the same ring turns again: dQ stays local and
the dK/dV accumulators (float32) travel with the blocks and arrive back at their owners after
``P`` hops. Each step's block results are freed before the next kernel call. One rank makes a
single kernel call: no accumulators, no merge.

Kernels with variable-length entry points (``kernel.varlen``) get a step's many small blocks --
packed documents, sliding windows -- as a few calls, one per mask kind (``varlen.varlen_calls``).

Layer masks (sliding windows, chunked attention) are schedules too (``schedule.band_block``): blocks
that cross a window's edge reach the kernel with their band (``window=(left, right)``), and a schedule
may end before ``P`` steps (no rank needs a later block): the K/V then make fewer hops, and in
backward the last hop sends each dK/dV accumulator straight back to the rank that owns it.

``block_attention`` is the same Function for one step without a ring: query rows against any key
rows, as a list of blocks (the border route of ``windows.masked_attention``).

The op is a pure function of its arguments: the ring it runs on (``Ring``, or a process group) and
the block kernel (an object, or a backend name) are passed in; ``group=None`` is the world group.
Defaults such as "the CP group of ``setup_context_parallel``" are resolved by the layers above
(``hf_ring.ring_attention``, the transformers glue). This module imports only torch.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import Tensor

from .checks import check_extras, check_qkv
from .comm import Ring, check_same_across_ranks
from .kernels import BlockKernel, get_kernel
from .merge import add_sinks, merge_, sink_grad
from .schedule import Block, Schedule, make_schedule
from .varlen import VarlenCall, step_calls

__all__ = ["block_attention", "head_groups_of", "ring_attention", "ring_backward", "ring_forward"]


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32  # float64 inputs: oracle runs


def _slices(b: Block, n: int) -> tuple[slice, slice, slice]:
    """(batch rows, query rows, key rows) of block ``b`` over ``n`` local rows."""
    return slice(*b.batch) if b.batch else slice(None), b.rows(b.q, n), b.rows(b.kv, n)


def _kv_message(k: Tensor, v: Tensor, hm: bool) -> Tensor:
    """K and V as one contiguous message: (2, B, S, Hkv, D), or (2, B, Hkv, S, D) when ``hm``."""
    return torch.stack((k.transpose(1, 2), v.transpose(1, 2))) if hm else torch.stack((k, v))


def _kv_view(buf: Tensor, hm: bool) -> Tensor:
    """The (2, B, S, Hkv, D) view of a K/V message."""
    return buf.transpose(2, 3) if hm else buf


def _single_block(steps: list[tuple[Block, ...]]) -> bool:
    """One rank, one block over the whole shard: a plain kernel call, nothing to merge."""
    if len(steps) != 1 or len(steps[0]) != 1:
        return False
    b = steps[0][0]
    return b.unit == 2 and b.q == (0, 2) and b.kv == (0, 2) and b.batch is None and b.window is None


def _band(b: Block | VarlenCall) -> dict[str, tuple[int, int]]:
    """The kernel keyword of a banded call (nothing for the others: kernels without bands still run them)."""
    return {} if b.window is None else {"window": b.window}


def _rows(t: Tensor) -> Tensor:
    """``[B, S, ...]`` -> ``[B * S, ...]``, a view of contiguous ``t`` (the accumulators, K/V messages)."""
    return t.view(t.shape[0] * t.shape[1], *t.shape[2:])


def _take(t: Tensor, idx: Tensor) -> Tensor:
    """Rows ``idx`` of the flattened ``[B * S, ...]`` rows of ``t [B, S, ...]``, without copying all of ``t``."""
    if t.is_contiguous():
        return _rows(t)[idx]
    n = t.shape[1]
    return t[idx // n, idx % n]


def head_groups_of(hq: int, hkv: int, groups: int, who: str = "ring_attention") -> list[tuple[slice, slice]]:
    """The query and K/V head slices of ``groups`` head groups, GQA groups kept whole: group ``g`` is K/V
    heads ``[g Hkv / G, (g + 1) Hkv / G)`` and the ``Hq / Hkv`` query heads of each (query head ``h`` reads
    K/V head ``h // (Hq / Hkv)``). Raises ``ValueError`` unless ``groups`` divides ``Hkv``."""
    if isinstance(groups, bool) or not isinstance(groups, int) or groups < 1 or hkv % groups:
        fits = [g for g in range(1, hkv + 1) if hkv % g == 0]
        raise ValueError(
            f"{who}: head_groups={groups!r} must divide the {hkv} K/V heads (GQA groups are kept whole, so the "
            f"K/V messages do not grow); pick one of {fits}"
        )
    qg, kg = hq // groups, hkv // groups
    return [(slice(g * qg, (g + 1) * qg), slice(g * kg, (g + 1) * kg)) for g in range(groups)]


def _group_sinks(sinks: Tensor | None, qs: slice) -> Tensor | None:
    """A head group's sinks: ``[Hq]`` or ``[B, S, Hq]`` cut to query heads ``qs``."""
    return None if sinks is None else sinks[qs] if sinks.dim() == 1 else sinks[:, :, qs]


def ring_forward(
    q: Tensor, k: Tensor, v: Tensor, scale: float, steps: Schedule, kernel: BlockKernel, ring: Ring | None,
    sinks: Tensor | None = None, cap: float = 0.0,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """The ring's forward loop, no autograd: ``(out [B, S, Hq, D] in q's dtype, lse [B, S, Hq] float32)``.

    ``q: (B, S, Hq, D)``; ``k, v: (B, S, Hkv, D)``: this rank's shard (any strides); ``sinks``: ``(Hq,)``,
    ``(B, S, Hq)`` or None; ``ring`` None: one step over any key rows ``k, v: (B, Sk, Hkv, D)``
    (``block_attention``). ``_RingAttention`` and the tiled layer (``ops.tiled_layer``) run it."""
    n_steps = len(steps)
    s_loc = q.shape[1]
    acc = _acc_dtype(q.dtype)
    kw = {"softcap": cap} if cap else {}  # only kernels with softcap = True take the keyword
    if _single_block(steps):  # one rank: one kernel call, nothing to merge
        b = steps[0][0]
        out, lse = kernel.forward(q, k, v, causal=b.causal, scale=scale, **kw)
        if sinks is not None:
            out, lse = add_sinks(out, lse.to(acc), sinks)
        return out, lse
    out = torch.zeros(q.shape, dtype=acc, device=q.device)
    lse = torch.full(q.shape[:3], float("-inf"), dtype=acc, device=q.device)
    # kernels that read K/V faster in [B, H, S, D] memory get the K/V message in that order (the
    # stack copies anyway); blocks are sliced from its (2, B, S, Hkv, D) view
    hm = kernel.heads_major
    kv = _kv_message(k, v, hm)  # one message per hop
    bufs = (kv, torch.empty_like(kv) if n_steps > 1 else kv)
    comm = ring.channel(0) if n_steps > 1 and ring is not None else None
    for step, blocks in enumerate(steps):
        cur = bufs[step % 2]
        if comm is not None and step + 1 < n_steps:
            comm.send_recv(cur, bufs[(step + 1) % 2])
            comm.commit()
        kvv = _kv_view(cur, hm)
        for b in step_calls(blocks, kernel, s_loc, q.shape[0], q.device):
            if isinstance(b, VarlenCall):
                o_b, l_b = kernel.varlen_forward(
                    _take(q, b.q_idx), _take(kvv[0], b.k_idx), _take(kvv[1], b.k_idx),
                    b.cu_q, b.cu_k, b.max_q, b.max_k, causal=b.causal, scale=scale, **kw, **_band(b),
                )  # fmt: skip
                o_acc, l_acc = _rows(out)[b.q_idx], _rows(lse)[b.q_idx]
                merge_(o_acc, l_acc, o_b, l_b)
                _rows(out).index_copy_(0, b.q_idx, o_acc)
                _rows(lse).index_copy_(0, b.q_idx, l_acc)
                del o_b, l_b, o_acc, l_acc
                continue
            bs, qr, kr = _slices(b, s_loc)
            o_b, l_b = kernel.forward(
                q[bs, qr], kvv[0, bs, kr], kvv[1, bs, kr], causal=b.causal, scale=scale, **kw, **_band(b)
            )
            merge_(out[bs, qr], lse[bs, qr], o_b, l_b)
            del o_b, l_b  # free the block result before the next kernel call
        if comm is not None and step + 1 < n_steps:
            comm.wait()
    del kv, bufs
    if sinks is not None:
        out, lse = add_sinks(out, lse, sinks)
    return out.to(q.dtype), lse


def ring_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, scale: float, steps: Schedule,
    kernel: BlockKernel, ring: Ring | None, sinks: Tensor | None = None, cap: float = 0.0, sinks_grad: bool = False,
) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:  # fmt: skip
    """The ring's backward loop, no autograd: ``(dq, dk, dv, dsinks)`` in the dtypes of ``q, k, v`` and
    ``sinks`` (``dsinks`` None unless ``sinks_grad``), from ``ring_forward``'s ``out`` and ``lse``. The
    same ring turns again: dQ stays local, the float32 dK/dV accumulators travel one hop behind the K/V
    blocks they belong to and arrive back at their owner."""
    n_steps, s_loc = len(steps), q.shape[1]
    kw = {"softcap": cap} if cap else {}
    # the sink's gradient from this rank's rows; summed over the CP group with every other parameter's
    dsinks = sink_grad(dout, out, lse, sinks) if sinks is not None and sinks_grad else None
    if _single_block(steps):
        dq, dk, dv = kernel.backward(dout, q, k, v, out, lse, causal=steps[0][0].causal, scale=scale, **kw)
        return dq, dk, dv, dsinks
    acc_dtype = _acc_dtype(q.dtype)
    hm = kernel.heads_major
    dout = dout.contiguous()
    dq = torch.zeros(q.shape, dtype=acc_dtype, device=q.device)
    kv = _kv_message(k, v, hm)
    kv_bufs = (kv, torch.empty_like(kv) if n_steps > 1 else kv)
    # dK/dV accumulators travel one hop behind the K/V blocks they belong to.
    dkv_bufs = [torch.zeros(kv.shape, dtype=acc_dtype, device=q.device)]
    if n_steps > 1:  # the first receive overwrites it whole: no need to zero it
        dkv_bufs.append(torch.empty(kv.shape, dtype=acc_dtype, device=q.device))
    kv_comm = ring.channel(0) if n_steps > 1 and ring is not None else None
    dkv_comm = ring.channel(1) if n_steps > 1 and ring is not None else None
    for step, blocks in enumerate(steps):
        cur = kv_bufs[step % 2]
        if kv_comm is not None and step + 1 < n_steps:
            kv_comm.send_recv(cur, kv_bufs[(step + 1) % 2])
            kv_comm.commit()
        grads = []
        kvv = _kv_view(cur, hm)
        for b in step_calls(blocks, kernel, s_loc, q.shape[0], q.device):
            if isinstance(b, VarlenCall):
                dq_b, dk_b, dv_b = kernel.varlen_backward(
                    *(_take(t, b.q_idx) for t in (dout, q)), _take(kvv[0], b.k_idx), _take(kvv[1], b.k_idx),
                    *(_take(t, b.q_idx) for t in (out, lse)), b.cu_q, b.cu_k, b.max_q, b.max_k,
                    causal=b.causal, scale=scale, **kw, **_band(b),
                )  # fmt: skip
                _rows(dq).index_add_(0, b.q_idx, dq_b.to(acc_dtype))
                grads.append((b.k_idx, None, dk_b, dv_b))
                continue
            bs, qr, kr = _slices(b, s_loc)
            dq_b, dk_b, dv_b = kernel.backward(
                dout[bs, qr], q[bs, qr], kvv[0, bs, kr], kvv[1, bs, kr], out[bs, qr], lse[bs, qr],
                causal=b.causal, scale=scale, **kw, **_band(b),
            )  # fmt: skip
            dq[bs, qr] += dq_b
            grads.append((bs, kr, dk_b, dv_b))
        acc = dkv_bufs[step % 2]
        accv = _kv_view(acc, hm)
        if dkv_comm is not None and step > 0:
            dkv_comm.wait()  # acc now holds what earlier ranks added for this K/V block
        for bs, kr, dk_b, dv_b in grads:
            if kr is None:  # a varlen call: bs holds its key rows
                _rows(accv[0]).index_add_(0, bs, dk_b.to(acc_dtype))
                _rows(accv[1]).index_add_(0, bs, dv_b.to(acc_dtype))
                continue
            accv[0, bs, kr] += dk_b
            accv[1, bs, kr] += dv_b
        grads = dq_b = dk_b = dv_b = None  # free this step's block gradients before the next kernel call
        if dkv_comm is not None:
            # the last hop of a schedule shorter than the ring goes straight to the owner
            hops = ring.size - n_steps + 1 if step + 1 == n_steps else 1  # type: ignore[union-attr]
            if hops == 1:
                dkv_comm.send_recv(acc, dkv_bufs[(step + 1) % 2])
            else:
                dkv_comm.send_recv(acc, dkv_bufs[(step + 1) % 2], hops=hops)
            dkv_comm.commit()
        if kv_comm is not None and step + 1 < n_steps:
            kv_comm.wait()
    if dkv_comm is not None:
        dkv_comm.wait()  # after P hops our own block's accumulator is back
    del kv, kv_bufs
    dkv = _kv_view(dkv_bufs[n_steps % len(dkv_bufs)], hm)
    dk, dv = dkv[0].to(k.dtype), dkv[1].to(v.dtype)
    if hm:  # [B, S, Hkv, D] gradients in their usual memory order (Hkv/Hq of dq's size)
        dk, dv = dk.contiguous(), dv.contiguous()
    return dq.to(q.dtype), dk, dv, dsinks


class _RingAttention(torch.autograd.Function):
    """The one ring Function: ``ring_forward`` / ``ring_backward`` over ``groups`` head groups in turn
    (``head_groups_of``: the ring's accumulators, K/V messages and dK/dV accumulators exist for one
    group at a time; each group's K/V travel as their own messages, so the bytes sent do not grow)."""

    @staticmethod
    def forward(ctx, q, k, v, scale, schedule, kernel, ring, sinks=None, softcap=0.0, groups=1):  # type: ignore[override]
        # q: (B, S, Hq, D); k, v: (B, S, Hkv, D): this rank's shard; sinks: (Hq,), (B, S, Hq) or None.
        # ring None: one step over any key rows k, v: (B, Sk, Hkv, D) (block_attention)
        cap = float(softcap or 0.0)
        ctx.scale, ctx.schedule, ctx.kernel, ctx.ring, ctx.cap, ctx.groups = scale, schedule, kernel, ring, cap, groups
        saved = () if sinks is None else (sinks,)
        if groups == 1:
            out, lse = ring_forward(q, k, v, scale, schedule, kernel, ring, sinks, cap)
            ctx.save_for_backward(q, k, v, out, lse, *saved)
            return out.contiguous()
        out = q.new_empty(q.shape)
        lse = torch.empty(q.shape[:3], dtype=_acc_dtype(q.dtype), device=q.device)
        for qs, ks in head_groups_of(q.shape[2], k.shape[2], groups):
            o_g, l_g = ring_forward(q[:, :, qs], k[:, :, ks], v[:, :, ks], scale, schedule, kernel, ring,
                                    _group_sinks(sinks, qs), cap)  # fmt: skip
            out[:, :, qs], lse[:, :, qs] = o_g, l_g
            del o_g, l_g
        ctx.save_for_backward(q, k, v, out, lse, *saved)
        return out

    @staticmethod
    def backward(ctx, dout):  # type: ignore[override]
        q, k, v, out, lse, *sinks = ctx.saved_tensors
        snk = sinks[0] if sinks else None
        want_sinks = snk is not None and ctx.needs_input_grad[7]
        args = (ctx.scale, ctx.schedule, ctx.kernel, ctx.ring)
        if ctx.groups == 1:
            dq, dk, dv, dsinks = ring_backward(dout, q, k, v, out, lse, *args, snk, ctx.cap, want_sinks)
            return dq, dk, dv, None, None, None, None, dsinks, None, None
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        dsinks = torch.empty_like(snk) if want_sinks else None
        for qs, ks in head_groups_of(q.shape[2], k.shape[2], ctx.groups):
            s_g = _group_sinks(snk, qs)
            dq_g, dk_g, dv_g, ds_g = ring_backward(
                dout[:, :, qs], q[:, :, qs], k[:, :, ks], v[:, :, ks], out[:, :, qs], lse[:, :, qs], *args, s_g,
                ctx.cap, want_sinks,
            )  # fmt: skip
            dq[:, :, qs], dk[:, :, ks], dv[:, :, ks] = dq_g, dk_g, dv_g
            if dsinks is not None:
                if dsinks.dim() == 1:
                    dsinks[qs] = ds_g
                else:
                    dsinks[:, :, qs] = ds_g
            del dq_g, dk_g, dv_g, ds_g
        return dq, dk, dv, None, None, None, None, dsinks, None, None


def _kernel(backend: str | BlockKernel, q: Tensor, cap: float, steps: Schedule, who: str) -> BlockKernel:
    """``backend``, or the kernel ``get_kernel`` picks for ``q``, the cap and the schedule's bands."""
    if isinstance(backend, str):
        band = any(b.window is not None for blocks in steps for b in blocks)
        backend = get_kernel(backend, q.device, q.dtype, softcap=bool(cap), window=band, head_dim=q.shape[3])
    if cap and not getattr(backend, "softcap", False):
        raise ValueError(
            f"{who}: softcap={cap} but the block kernel {backend.name!r} has no logit soft-capping; "
            "pass backend='auto', 'reference' or 'flash_attn'."
        )
    return backend


def block_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    blocks: tuple[Block, ...] | list[Block],
    *,
    softmax_scale: float | None = None,
    backend: str | BlockKernel = "auto",
    softcap: float | None = None,
    sinks: Tensor | None = None,
    head_groups: int = 1,
) -> Tensor:
    """Attention of query rows over given key rows, as a list of kernel calls: one rank, no ring.

    ``q: [B, Sq, Hq, D]``; ``k, v: [B, Sk, Hkv, D]`` with ``Hq % Hkv == 0`` (``Sk`` may differ from
    ``Sq`` when ``B == 1``: e.g. a rank's rows with the rows fetched before them, the border route of
    ``hf_ring.ops.windows``). ``blocks``: the calls, in rows (``Block(..., unit=0)``: query rows of
    ``q`` meet key rows of ``k``, causal, unmasked or banded); a row in several blocks gets their exact
    merge, a row in none gets ``0``. ``softcap``, ``sinks`` (``[Hq]`` or ``[B, Sq, Hq]``) and ``head_groups``
    as for ``ring_attention``. Returns ``[B, Sq, Hq, D]`` in ``q``'s dtype, differentiable in ``q``, ``k``,
    ``v`` and ``sinks``: the ring's autograd Function run for one step.
    """
    check_qkv(q, k, v, "block_attention", same_length=False)
    if q.shape[0] != 1 and q.shape[1] != k.shape[1]:
        raise ValueError(f"block_attention: q {tuple(q.shape)} and k {tuple(k.shape)} differ in length with B > 1")
    for b in blocks:
        if b.unit != 0 or b.q[1] > q.shape[1] or b.kv[1] > k.shape[1] or min(*b.q, *b.kv) < 0:
            raise ValueError(f"block_attention: {b} is not in rows (unit=0) of q {q.shape[1]} and k {k.shape[1]}")
    cap = check_extras(q, softcap, sinks, "block_attention")
    kernel = _kernel(backend, q, cap, [tuple(blocks)], "block_attention")
    head_groups_of(q.shape[2], k.shape[2], head_groups, "block_attention")
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[3])
    return _RingAttention.apply(q, k, v, scale, [tuple(blocks)], kernel, None, sinks, cap, head_groups)


def ring_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    ring: Ring | None = None,
    causal: bool = True,
    softmax_scale: float | None = None,
    backend: str | BlockKernel = "auto",
    order: str = "zigzag",
    validate: bool = False,
    dropout_p: float = 0.0,
    attn_mask: Tensor | None = None,
    schedule: Schedule | None = None,
    softcap: float | None = None,
    sinks: Tensor | None = None,
    head_groups: int = 1,
) -> Tensor:
    """Exact attention over a sequence sharded across the ranks of ``group``.

    Args:
        q: ``[B, S_local, Hq, D]``, this rank's shard (see ``hf_ring.shard``).
        k, v: ``[B, S_local, Hkv, D]`` with ``Hq % Hkv == 0`` (grouped-query attention; K/V travel
            with their own ``Hkv`` heads).
        group: the context-parallel group (``None``: the world group). Without torch.distributed,
            or with a group of one rank, this is plain attention.
        ring: the ring to run on, instead of ``group``: a ``Ring``, or any object with its
            ``size``, ``rank``, ``group`` and ``channel(tag)`` (benchmarks pass one that sends
            nothing). Give ``group`` or ``ring``, not both.
        causal: causal mask over *global* positions.
        softmax_scale: defaults to ``1 / sqrt(D)``.
        backend: block kernel: ``"auto"``, ``"torch"``, ``"flash_attn"``, ``"reference"``, or a
            ``BlockKernel`` object.
        order: how the sequence is dealt to the ranks: ``"zigzag"`` (rank ``r`` holds chunks ``r`` and
            ``2P-1-r`` of ``2P``; balanced) or ``"contiguous"`` (chunk ``r`` of ``P``; for comparison).
        validate: check that every rank passes the same shapes and options before the ring turns
            (one all-gather of 16 integers per call). A mismatch raises ``ValueError`` on every
            rank instead of deadlocking. ``hf_ring.shard`` always makes this check.
        dropout_p, attn_mask: not supported; anything but the defaults raises ``ValueError``.
        schedule: the kernel calls of every ring step, instead of the ``order``'s; for packed
            documents, ``hf_ring.ops.schedule.document_schedule`` (tokens attend only to earlier
            tokens of their own document); for sliding windows and chunked attention,
            ``hf_ring.ops.windows.mask_plan``. Computed once per batch and reused by every layer.
            It may have fewer steps than the ring has ranks (the K/V then stop early).
        softcap: logit soft-capping (Gemma 2): scaled scores become ``softcap * tanh(s / softcap)``
            before the mask and the softmax, inside every block kernel call (forward and backward
            recompute), so the merge stays exact. Needs a kernel that has it (``get_kernel(...,
            softcap=True)``): flash-attn, or the reference kernel where "auto" finds no fused one.
        sinks: attention sinks ``[Hq]`` (GPT-OSS ``s_aux``): one learned logit per query head that
            joins each row's softmax with no value; or ``[B, S_local, Hq]``, one per query row of
            this rank's shard and head (per-token sinks). Applied once to the merged result (``out`` times
            ``sigmoid(lse - sink)``); differentiable. Its gradient is this rank's rows' share, like
            the gradient of every other parameter: summed over the CP group by the gradient
            reduction that already sums those (``RingContext.reduce_loss`` scales, DDP/FSDP average).
        head_groups: the heads in ``G`` groups, computed one group after the other (``G`` divides
            ``Hkv``; a group is ``Hkv / G`` K/V heads and their ``Hq / G`` query heads): the ring's
            float32 accumulators, its K/V messages in flight and, in backward, the dQ and travelling
            dK/dV accumulators exist for one group at a time (``1 / G`` of their size); each group's
            K/V make their own hops, so the bytes sent are the same. Exact for every ``G``.

    Returns:
        ``[B, S_local, Hq, D]`` in the dtype of ``q``: this rank's rows of attention over the whole
        sequence, differentiable in ``q``, ``k`` and ``v``.

    Zigzag picture, ``P = 2``, sequence cut into chunks ``c0 c1 c2 c3``: rank 0 holds
    ``[c0 | c3]``, rank 1 holds ``[c1 | c2]``.
    """
    if ring is None:
        ring = Ring(group)
    elif group is not None:
        raise ValueError("ring_attention: pass group or ring, not both")
    size, rank = ring.size, ring.rank
    try:
        _check_ring_inputs(q, k, v, size, order if schedule is None else "schedule", dropout_p, attn_mask)
        cap = check_extras(q, softcap, sinks)
        head_groups_of(q.shape[2], k.shape[2], head_groups)
        kernel = _kernel(backend, q, cap, schedule or [], "ring_attention")
    except ValueError:
        if validate and size > 1:
            # Join the all-gather anyway: ranks whose inputs are fine wait in it. Every rank then
            # raises the mismatch, or (all ranks failing alike) its own error, re-raised below.
            _validate(q, k, causal, ring.group, bad=True, groups=head_groups)
        raise
    if validate:
        _validate(q, k, causal, ring.group, bad=False, groups=head_groups)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[3])
    if schedule is None:
        schedule = make_schedule(order, causal, rank, size)
    elif max((max(b.q[1], b.kv[1]) for s in schedule for b in s if b.unit == 0), default=0) > q.shape[1]:
        raise ValueError(f"ring_attention: the schedule addresses rows beyond the local length {q.shape[1]}")
    elif not 1 <= len(schedule) <= size or not causal:
        raise ValueError(
            f"ring_attention: a schedule of {len(schedule)} steps for a ring of {size} ranks (causal={causal}); "
            "a document schedule is causal and has at most one step per rank"
        )
    return _RingAttention.apply(q, k, v, scale, schedule, kernel, ring, sinks, cap, head_groups)


def _check_ring_inputs(
    q: Tensor, k: Tensor, v: Tensor, size: int, order: str, dropout_p: float, attn_mask: Tensor | None
) -> None:
    """Raise ``ValueError`` for inputs the ring cannot take (this rank's own view)."""
    if dropout_p:
        raise ValueError(
            f"ring_attention: dropout_p={dropout_p} is not supported (attention dropout would need "
            "the same random mask on every rank); set the model's attention_dropout to 0."
        )
    if attn_mask is not None:
        raise ValueError(
            "ring_attention: an explicit attn_mask is not supported; the ring applies the causal "
            "mask over global positions itself (causal=True). Pad with hf_ring.shard_batch instead "
            "of masking."
        )
    check_qkv(q, k, v, "ring_attention")
    if size > 1 and order == "zigzag" and q.shape[1] % 2:
        raise ValueError(
            f"ring_attention: local sequence length {q.shape[1]} is odd, but the zigzag order gives "
            f"each rank two equal chunks: the full sequence length must be a multiple of 2 * P = "
            f"{2 * size}. Pad the batch with hf_ring.shard_batch (it pads and masks), or pad to a "
            f"multiple of {2 * size} yourself."
        )


_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def _validate(q: Tensor, k: Tensor, causal: bool, group: dist.ProcessGroup | None, bad: bool, groups: int = 1) -> None:
    shape = [*q.shape[:4], *[-1] * (4 - min(q.dim(), 4))]
    hkv = k.shape[2] if k.dim() > 2 else -1
    dtype = _DTYPES.index(q.dtype) if q.dtype in _DTYPES else -2
    meta = [*shape, hkv, int(causal), dtype, int(bad), groups if isinstance(groups, int) else -1]
    check_same_across_ranks(
        meta, group, "ring_attention inputs [B, S, Hq, D, Hkv, causal, dtype, bad input, head groups]"
    )
