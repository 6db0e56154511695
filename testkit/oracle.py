"""The float64 attention oracle every test compares against, written from the definitions.

``attention(q, k, v, causal, ...)`` is softmax attention over the whole (unsharded) sequence, with the
masks and options hf_ring computes: causal, a sliding window, packed documents, attention chunks,
logit soft-capping, attention sinks and grouped-query heads. It is differentiable in every tensor
input and returns the output and, on request, the log-sum-exp. ``visible`` is its mask; ``reference``
the output, log-sum-exp and gradients of one call. Stand-ins of GPU libraries (``testkit/*_standin*``)
keep the arithmetic of the library they mirror; what they are judged by is this.

Positions: query ``i`` and key ``j`` count from 0 in their own tensors (for a full sequence, its
global positions; for a block with fewer queries than keys, causal is aligned to the top left, key
``j`` hidden from query ``i < j``, as the block kernels' contract).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = ["attention", "reference", "rel_err", "visible"]


def visible(
    n_q: int,
    n_k: int | None = None,
    *,
    causal: bool = True,
    window: int | None = None,
    starts: Sequence[Sequence[int]] | None = None,
    chunk: int | None = None,
    spans: Sequence[Sequence[tuple[int, int]]] | None = None,
) -> Tensor:
    """``[B, Nq, Nk]`` bool, True where query ``i`` sees key ``j`` (``B = len(starts)`` or ``len(spans)``,
    else 1):

    - ``causal``: ``j <= i``;
    - ``spans``: each batch row's bidirectional spans ``[s, e)``: two positions of one span also see
      each other (transformers' ``blockwise_overlay``, OR-ed with the causal mask);
    - ``window``: a sliding window of ``W`` keys, ``i - W < j`` (transformers' sliding window, AND-ed
      after the spans, as ``create_masks_for_vision_model``);
    - ``starts``: each batch row's documents' first positions (sorted, from 0): same document only;
    - ``chunk``: the same chunk of ``C`` positions, counted from the document's start (Llama 4).
    """
    n_k = n_q if n_k is None else n_k
    i, j = torch.arange(n_q)[:, None], torch.arange(n_k)[None, :]
    rows = []
    count = len(starts) if starts is not None else len(spans) if spans is not None else 1
    for r in range(count):
        row = starts[r] if starts is not None else [0]
        n = max(n_q, n_k)
        m = j <= i if causal else torch.ones(n_q, n_k, dtype=torch.bool)
        if spans is not None:
            span = torch.full((n,), -1, dtype=torch.long)
            for k, (a, z) in enumerate(spans[r]):
                span[a:z] = k
            m = m | ((span[:n_q, None] == span[None, :n_k]) & (span[:n_q, None] >= 0))
        if window is not None:
            m = m & (j > i - window)
        doc = torch.zeros(n, dtype=torch.long)
        for s in list(row)[1:]:
            doc[s:] += 1
        m = m & (doc[:n_q, None] == doc[None, :n_k])
        if chunk is not None:
            first = torch.tensor(list(row), dtype=torch.long)[doc]  # each position's document start
            m &= (i - first[:n_q, None]) // chunk == (j - first[None, :n_k]) // chunk
        rows.append(m)
    return torch.stack(rows)


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    causal: bool = True,
    scale: float | None = None,
    *,
    mask: Tensor | None = None,
    window: int | None = None,
    starts: Sequence[Sequence[int]] | None = None,
    chunk: int | None = None,
    softcap: float | None = None,
    sinks: Tensor | None = None,
    with_lse: bool = False,
    dtype: torch.dtype = torch.float64,
) -> Tensor | tuple[Tensor, Tensor]:
    """Softmax attention computed in ``dtype`` (float64; another dtype only as a same-dtype yardstick).

    ``q: [B, Nq, Hq, D]``, ``k, v: [B, Nk, Hkv, D]`` with ``Hq % Hkv == 0`` (query head ``h`` reads K/V
    head ``h // (Hq / Hkv)``). Mask: ``mask`` (bool, True = visible; ``[Nq, Nk]``, ``[B, Nq, Nk]`` or
    ``[B, 1, Nq, Nk]``), else ``visible(Nq, Nk, causal=, window=, starts=, chunk=)``. ``scale``:
    ``1 / sqrt(D)`` by default. ``softcap``: scaled scores become ``softcap * tanh(s / softcap)``
    before the mask. ``sinks``: ``[Hq]`` or ``[B, Nq, Hq]``, one more logit per row that joins the
    softmax with no value. A row that sees no key (and has no sink) gets ``0`` and log-sum-exp
    ``-inf``, with zero gradients.

    Returns ``out [B, Nq, Hq, D]`` (in ``dtype``), and with ``with_lse`` also ``lse [B, Nq, Hq]``
    (of the scores it saw, sinks included).
    """
    rep = q.shape[2] // k.shape[2]
    qt, kt, vt = (t.to(dtype).transpose(1, 2) for t in (q, k, v))  # [B, H, N, D]
    kt, vt = kt.repeat_interleave(rep, 1), vt.repeat_interleave(rep, 1)
    s = (qt @ kt.transpose(-1, -2)) * (q.shape[-1] ** -0.5 if scale is None else scale)  # [B, Hq, Nq, Nk]
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    if mask is None:
        mask = visible(q.shape[1], k.shape[1], causal=causal, window=window, starts=starts, chunk=chunk)
    mask = mask.to(s.device)
    mask = mask[None, None] if mask.dim() == 2 else mask[:, None] if mask.dim() == 3 else mask
    s = s.masked_fill(~mask, float("-inf"))
    if sinks is not None:
        col = sinks.to(dtype).view(1, -1, 1) if sinks.dim() == 1 else sinks.to(dtype).transpose(1, 2)
        s = torch.cat((s, col.expand(*s.shape[:3])[..., None]), -1)
    seen = ~torch.isneginf(s).all(-1, keepdim=True)  # rows with at least one logit
    s = s.masked_fill(~seen, 0.0)  # empty rows: finite scores, zeroed below (no NaN, no gradient)
    p = s.softmax(-1) * seen
    lse = torch.logsumexp(s, -1).masked_fill(~seen[..., 0], float("-inf"))
    if sinks is not None:
        p = p[..., :-1]
    out = (p @ vt).transpose(1, 2)
    return (out, lse.transpose(1, 2)) if with_lse else out


def reference(
    q: Tensor, k: Tensor, v: Tensor, dout: Tensor, causal: bool, scale: float | None = None, **options: object
) -> list[Tensor]:
    """``[out, lse, dq, dk, dv]`` of ``attention(q, k, v, causal, scale, **options)`` in float64 on the
    CPU, for the gradient ``dout`` of its output (``lse [B, Nq, Hq]``)."""
    xs = [x.detach().double().cpu().requires_grad_() for x in (q, k, v)]
    out, lse = attention(*xs, causal, scale, with_lse=True, **options)  # type: ignore[arg-type, misc]
    return [out.detach(), lse.detach(), *torch.autograd.grad(out, xs, dout.detach().double().cpu())]


def rel_err(x: Tensor, ref: Tensor) -> float:
    """``|x - ref| / |ref|`` in float64 (Frobenius norms)."""
    x, ref = x.detach().double().cpu(), ref.detach().double().cpu()
    return float((x - ref).norm() / ref.norm())
