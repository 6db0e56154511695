"""Greedy decoding over a KV cache sharded across a context-parallel group.

After a context-parallel prefill every rank of the CP group keeps the keys and values of the prompt
tokens it held (its shard: ``1/P`` of the prompt, in any order). The tokens that follow -- the last
few prompt tokens and every generated one -- are the same on every rank: each rank runs them
(replicated) and keeps their keys and values in a small ``tail``. A query of such a token attends to
every key before it, split the way the ring splits a row, and merged exactly through the log-sum-exp
of each part (``merge.merge_``)::

    rank r:   shard partial (its 1/P of the prompt's keys)  -> (out_r, lse_r)
              all-gathered over the group, merged in rank order
    every rank: tail partial (the same on every rank)        -> (out_t, lse_t), merged last

so every rank ends with the same bits, and generating at 1M tokens needs ``1/P`` of the cache per
rank. Masks are functions of global positions (causal; a sliding ``window``: keys ``q - W < k <= q``;
a ``chunk``: ``k // C == q // C``), so a shard may hold its keys in any order. ``softcap`` caps the
scores as ``cap * tanh(s / cap)``; ``sinks`` join each row's softmax after the merge
(``merge.add_sinks``).

``gather_rows`` collects rows by global position from the ranks that hold them (one all-reduce): the
last rows of a prompt that a short causal convolution needs to go on decoding.

This module imports only torch; the group is passed in.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from .merge import add_sinks, merge_

__all__ = ["decode_attention", "gather_rows", "partial_attention"]

KEY_BLOCK = 16384  # keys per score block: [B, Hq, M, KEY_BLOCK] float32 scores at a time


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _visible(q_pos: Tensor, k_pos: Tensor, window: int | None, chunk: int | None) -> Tensor:
    """``[M, S]`` bool: key ``k_pos[j]`` is visible to query ``q_pos[i]``."""
    q, k = q_pos[:, None], k_pos[None, :]
    ok = k <= q
    if window is not None:
        ok = ok & (k > q - window)
    if chunk is not None:
        ok = ok & (torch.div(k, chunk, rounding_mode="floor") == torch.div(q, chunk, rounding_mode="floor"))
    return ok


def partial_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    q_pos: Tensor,
    k_pos: Tensor,
    *,
    scale: float,
    window: int | None = None,
    chunk: int | None = None,
    softcap: float = 0.0,
) -> tuple[Tensor, Tensor]:
    """Attention of queries to some of their keys, with the log-sum-exp of the scores.

    Args:
        q: ``[B, Hq, M, D]``; k: ``[B, Hkv, S, D]``; v: ``[B, Hkv, S, Dv]`` (``Hq`` a multiple of
            ``Hkv``: query head ``h`` reads key head ``h // (Hq / Hkv)``).
        q_pos: ``[M]`` and k_pos: ``[S]`` long, global positions (the same for every batch row).
        scale, window, chunk, softcap: as the layer applies them (see the module docstring).

    Returns ``out [B, M, Hq, Dv]`` and ``lse [B, M, Hq]`` in float32 (float64 for float64 inputs);
    a row that sees no key gets ``0`` and ``-inf``. Keys are taken ``KEY_BLOCK`` at a time.
    """
    b, hq, m, d = q.shape
    hkv, s, dv = k.shape[1], k.shape[2], v.shape[-1]
    if hq % hkv:
        raise ValueError(f"partial_attention: {hq} query heads are not a multiple of {hkv} key heads")
    g, acc = hq // hkv, _acc(q.dtype)
    qg = q.to(acc).reshape(b, hkv, g * m, d)  # query head h = kv head * g + i: rows (i, m) of kv head
    out = torch.zeros(b, hkv, g * m, dv, dtype=acc, device=q.device)
    lse = torch.full((b, hkv, g * m), float("-inf"), dtype=acc, device=q.device)
    for s0 in range(0, s, KEY_BLOCK):
        kb, vb = k[:, :, s0 : s0 + KEY_BLOCK].to(acc), v[:, :, s0 : s0 + KEY_BLOCK].to(acc)
        scores = (qg @ kb.transpose(-1, -2)) * scale  # (B, Hkv, g*M, s)
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        seen = _visible(q_pos, k_pos[s0 : s0 + KEY_BLOCK], window, chunk).repeat(g, 1)  # (g*M, s)
        scores = scores.masked_fill(~seen, float("-inf"))
        blk_lse = scores.logsumexp(-1)
        p = torch.exp(scores - blk_lse.unsqueeze(-1)).nan_to_num_(0.0)  # rows with no key: 0
        merge_(out, lse, p @ vb, blk_lse)
        del scores, p
    out = out.view(b, hkv, g, m, dv).permute(0, 3, 1, 2, 4).reshape(b, m, hq, dv)
    return out, lse.view(b, hkv, g, m).permute(0, 3, 1, 2).reshape(b, m, hq)


def decode_attention(
    q: Tensor,
    shard: tuple[Tensor, Tensor, Tensor],
    tail: tuple[Tensor, Tensor, Tensor],
    q_pos: Tensor,
    *,
    group: dist.ProcessGroup | None,
    scale: float,
    window: int | None = None,
    chunk: int | None = None,
    softcap: float = 0.0,
    sinks: Tensor | None = None,
) -> Tensor:
    """Attention of the replicated new tokens to the whole sequence: this rank's shard of the prompt's
    keys, every other rank's (through one all-gather of the partial results), and the replicated tail.

    Args:
        q: ``[B, Hq, M, D]``, the same on every rank of ``group``.
        shard: ``(k [B, Hkv, S_r, D], v [B, Hkv, S_r, Dv], pos [S_r])``, this rank's keys and
            values of the prompt and their global positions (``S_r`` may differ between ranks, or
            be 0).
        tail: ``(k [B, Hkv, T, D], v [B, Hkv, T, Dv], pos [T])``: the keys every rank holds (the
            new tokens' among them), the same on every rank.
        q_pos: ``[M]`` global positions of the queries.
        group: the CP group (``None``: the default group; one process: no communication).
        scale, window, chunk, softcap: the layer's; sinks: ``[Hq]`` attention sinks, or ``None``.

    Returns ``[B, M, Hq, Dv]`` in ``q``'s dtype, the same bits on every rank. Collective over ``group``.
    """
    opts = {"scale": scale, "window": window, "chunk": chunk, "softcap": softcap}
    out, lse = partial_attention(q, shard[0], shard[1], q_pos, shard[2], **opts)
    size = dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1
    if size > 1:  # one message: [B, M, Hq, Dv + 1] (outputs, then the log-sum-exp)
        mine = torch.cat((out, lse.unsqueeze(-1)), dim=-1).contiguous()
        parts = mine.new_empty((size, *mine.shape))
        dist.all_gather(list(parts.unbind(0)), mine, group=group)  # views of one buffer
        out = torch.zeros_like(out)
        lse = torch.full_like(lse, float("-inf"))
        for part in parts.unbind(0):  # rank order: every rank merges the same numbers the same way
            merge_(out, lse, part[..., :-1], part[..., -1])
    t_out, t_lse = partial_attention(q, tail[0], tail[1], q_pos, tail[2], **opts)
    merge_(out, lse, t_out, t_lse)
    if sinks is not None:
        out, lse = add_sinks(out, lse, sinks)
    return out.to(q.dtype)


def gather_rows(
    x: Tensor, positions: Tensor, start: int, count: int, group: dist.ProcessGroup | None, dim: int = 1
) -> Tensor:
    """The rows of global positions ``start .. start + count - 1`` of a sharded sequence, on every rank.

    ``x``: this rank's rows along ``dim``; ``positions``: ``[S_local]`` their global positions (each
    global position held by one rank of ``group``). Returns ``x``'s shape with ``count`` rows along
    ``dim``; rows of negative positions, or that no rank holds, are zero. One all-reduce."""
    x = x.movedim(dim, 0)
    out = x.new_zeros((count, *x.shape[1:]))
    at = positions - start
    mine = ((at >= 0) & (at < count)).nonzero().squeeze(1)
    out.index_copy_(0, at[mine], x.index_select(0, mine))
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(out, group=group)
    return out.movedim(0, dim)
