"""A ring step's blocks as variable-length kernel calls (flash-attn's ``varlen`` functions).

Packed documents and windowed layers make many small blocks per ring step. A kernel with varlen
entry points (``kernel.varlen``) takes them as a few calls over rows gathered into ``[total, H, D]``:
one per mask kind, each sequence aligned to its own bottom-right corner (``VarlenCall``). Built
once per batch (cached: every layer has the same schedule). This module imports only torch.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import Tensor

from .kernels import BlockKernel
from .schedule import Block

__all__ = ["VarlenCall", "step_calls", "varlen_calls"]


@dataclass(frozen=True, eq=False)
class VarlenCall:
    """Several blocks of one ring step as one variable-length kernel call.

    Sequence ``i`` is query rows ``q_idx[cu_q[i]:cu_q[i+1]]`` against key rows
    ``k_idx[cu_k[i]:cu_k[i+1]]``, both indices into the ``B * S_local`` rows of a flattened
    ``[B, S_local, H, D]`` tensor; no query row belongs to two sequences. ``causal`` and ``window`` apply
    to every sequence (aligned to its own bottom-right corner); ``blocks``: the blocks it computes.
    """

    causal: bool
    window: tuple[int, int] | None
    q_idx: Tensor  # int64 [Tq]
    k_idx: Tensor  # int64 [Tk]
    cu_q: Tensor  # int32 [n + 1]
    cu_k: Tensor  # int32 [n + 1]
    max_q: int
    max_k: int
    blocks: tuple[Block, ...]


def _kinds(blocks: tuple[Block, ...], n: int) -> list[tuple[bool, tuple[int, int] | None]]:
    """The mask each block goes to a varlen call with: its own (causal, band), except that blocks a band
    ``(L, 0)`` of the step computes exactly join it -- square causal blocks of at most ``L + 1`` rows, and
    one-row unmasked blocks of at most ``L + 1`` keys (the diagonal of a sliding window)."""
    bands = [b.window[0] for b in blocks if b.window is not None and b.window[1] == 0]
    if not bands:
        return [(b.causal, b.window) for b in blocks]
    left = max(bands)
    out = []
    for b in blocks:
        qs, ks = b.rows(b.q, n), b.rows(b.kv, n)
        sq, sk = qs.stop - qs.start, ks.stop - ks.start
        fits = sk <= left + 1 and b.window is None and (sq == sk if b.causal else sq == 1)
        out.append((False, (left, 0)) if fits else (b.causal, b.window))
    return out


@functools.lru_cache(maxsize=32)  # a batch's P steps, for a few batches
def varlen_calls(blocks: tuple[Block, ...], n: int, batch: int, device: torch.device) -> tuple[Block | VarlenCall, ...]:
    """A step's blocks as few ``VarlenCall``: one per mask kind (causal on the diagonal, unmasked, each
    band; ``_kinds``), more only where sequences of one kind would share query rows. Unmasked blocks with the same
    query rows share one sequence (their key rows end to end); causal and banded ones are a sequence each
    (their masks align to each one's own corner). A causal block that is not square stays a block.
    Cached: a batch's schedule is the same for every layer."""
    seqs: dict[tuple[bool, tuple[int, int] | None], dict[tuple[int, ...], list[Block]]] = {}
    loose: list[Block] = []
    for b, kind in zip(blocks, _kinds(blocks, n)):
        qs, ks = b.rows(b.q, n), b.rows(b.kv, n)
        if qs.stop <= qs.start or ks.stop <= ks.start:
            continue
        if kind[0] and qs.stop - qs.start != ks.stop - ks.start:
            loose.append(b)
            continue
        group = seqs.setdefault(kind, {})
        for row in range(*b.batch) if b.batch else range(batch):
            key = (row, qs.start, qs.stop) if kind == (False, None) else (row, qs.start, qs.stop, len(group))
            group.setdefault(key, []).append(b)
    calls: list[Block | VarlenCall] = list(loose)
    for (causal, window), group in seqs.items():
        for part in _disjoint(sorted(group)):
            calls.append(_varlen_call(causal, window, [(key, group[key]) for key in part], n, device))
    return tuple(calls)


def _disjoint(spans: list[tuple[int, ...]]) -> list[list[tuple[int, ...]]]:
    """Sorted ``(row, start, stop, ...)`` query spans in as few lists as keep each list's spans apart."""
    parts: list[list[tuple[int, ...]]] = []
    for span in spans:
        for part in parts:
            last = part[-1]
            if last[0] != span[0] or last[2] <= span[1]:
                part.append(span)
                break
        else:
            parts.append([span])
    return parts


def _varlen_call(
    causal: bool, window: tuple[int, int] | None, seqs: list[tuple[tuple[int, ...], list[Block]]], n: int,
    device: torch.device,
) -> VarlenCall:  # fmt: skip
    q_idx, k_idx, cu_q, cu_k = [], [], [0], [0]
    for (row, q0, q1, *_), bs in seqs:
        q_idx.append(torch.arange(row * n + q0, row * n + q1))
        kv = [b.rows(b.kv, n) for b in bs]
        k_idx.extend(torch.arange(row * n + ks.start, row * n + ks.stop) for ks in kv)
        cu_q.append(cu_q[-1] + q1 - q0)
        cu_k.append(cu_k[-1] + sum(ks.stop - ks.start for ks in kv))
    lens_q = [b - a for a, b in zip(cu_q, cu_q[1:])]
    lens_k = [b - a for a, b in zip(cu_k, cu_k[1:])]
    return VarlenCall(
        causal,
        window,
        torch.cat(q_idx).to(device),
        torch.cat(k_idx).to(device),
        torch.tensor(cu_q, dtype=torch.int32, device=device),
        torch.tensor(cu_k, dtype=torch.int32, device=device),
        max(lens_q),
        max(lens_k),
        tuple(dict.fromkeys(b for _, bs in seqs for b in bs)),
    )


def step_calls(
    blocks: tuple[Block, ...], kernel: BlockKernel, n: int, batch: int, device: torch.device
) -> tuple[Block | VarlenCall, ...]:
    """The kernel calls of one step: its blocks, or ``VarlenCall``s for a varlen kernel."""
    if len(blocks) < 2 or not getattr(kernel, "varlen", False) or kernel.heads_major:
        return blocks
    return varlen_calls(blocks, n, batch, device)
