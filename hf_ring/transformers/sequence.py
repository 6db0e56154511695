"""Per-sequence (and per-document) sums of per-token quantities over the CP group.

Preference and policy losses (DPO, GRPO, ...) are functions of per-sequence sums: the summed
log-probability of a completion, its token count, a weighted sum of per-token terms. Under context
parallelism each rank holds a zigzag shard of every sequence; ``sequence_sums`` adds each rank's
share (its local rows, by the batch's ``ShardLayout``) and all-reduces the ``[B]`` or ``[B, D]``
result over the CP group. Its backward hands every rank the gradient of the sums unchanged (the
identity on each rank's share), times ``grad_scale``; nothing of size ``[tokens, vocab]`` and no
gathered sequence is ever built. ``sequence_logprobs`` runs a model on a ``shard_batch`` batch and
returns the per-token log-probabilities of its labels, from the LM head's input in chunks
(``ops.cross_entropy.chunked_token_logprobs``)::

    kwargs = hf_ring.shard_batch({"input_ids": ids, "labels": labels})   # labels: -100 off the completion
    tok = sequence_logprobs(model, kwargs)                                # {"log_probs": [B, S_local]}
    logps = sequence_sums(kwargs["ring_context"], tok["log_probs"])       # [B], the same on every rank

This module imports only torch (and hf_ring's own glue).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ..ops.cross_entropy import IGNORE_INDEX, chunked_token_logprobs
from ..ops.reduce import sum_over_group
from .context import CONTEXT_KEY, RingContext

__all__ = ["document_ids", "gather_tokens", "sequence_logprobs", "sequence_sums"]


def document_ids(ctx: RingContext, batch: int) -> Tensor:
    """``[B, S_local]`` int64: the document (0, 1, ... within its batch row) of every local row of
    this rank, ``-1`` for padding rows (``ctx.real`` false). One sequence per row: document 0."""

    def make() -> Tensor:
        out = torch.full((batch, ctx.layout.local), -1, dtype=torch.long)
        for b in range(batch):
            for seg in ctx.layout.segments(ctx.rank, b):
                out[b, seg.local : seg.local + seg.stop - seg.start] = seg.doc
        if ctx.real is not None:
            out = out.masked_fill(~ctx.real.cpu().expand_as(out), -1)
        return out

    return ctx.cached(("document_ids", batch), make)


def sequence_sums(ctx: RingContext, values: Tensor, *, per_document: bool = False, grad_scale: float = 1.0) -> Tensor:
    """Sums of per-token ``values`` over each sequence (or each packed document) across the CP group.

    Args:
        ctx: the batch's ``RingContext`` (``shard_batch(...)["ring_context"]``).
        values: ``[B, S_local]`` or ``[B, S_local, K]``, this rank's rows in the batch's layout (0
            where a token should not count; rows of padding are left out).
        per_document: one sum per packed document of each row (documents begin where the batch's
            ``position_ids`` restart at 0), ``[B, D]`` with ``D`` the most documents of a row
            (0 for the documents a row lacks); else one per row, ``[B]``.
        grad_scale: the backward's factor. 1 gives every rank the exact gradient of its share; a
            trainer whose DDP/FSDP averages gradients over the ``P`` ranks of the CP group passes
            ``P`` (``ctx.size``) so that the average is the gradient of one device.

    Returns:
        ``[B]``, ``[B, K]``, ``[B, D]`` or ``[B, D, K]`` in ``values``' dtype, the same on every rank
        of the CP group (one all-reduce), differentiable with respect to ``values``.
    """
    b = values.shape[0]
    if values.shape[1] != ctx.layout.local:
        raise ValueError(
            f"sequence_sums: values have {values.shape[1]} rows per sequence, but this rank holds "
            f"{ctx.layout.local}; pass per-token values of the shard_batch batch of this context"
        )
    docs = document_ids(ctx, b).to(values.device)
    n_docs = max(len(ctx.layout.starts[min(i, len(ctx.layout.starts) - 1)]) for i in range(b)) if per_document else 1
    if not per_document:
        docs = docs.clamp(max=0)
    keep = docs >= 0
    slot = torch.where(keep, docs + torch.arange(b, device=values.device)[:, None] * n_docs, b * n_docs)
    flat = values.reshape(b * values.shape[1], *values.shape[2:])
    sums = flat.new_zeros((b * n_docs + 1, *values.shape[2:])).index_add(0, slot.reshape(-1), flat)
    sums = sums[:-1].view(b, n_docs, *values.shape[2:])
    if not per_document:
        sums = sums[:, 0]
    return sum_over_group(sums, ctx.group, grad_scale)


class _GatherTokens(torch.autograd.Function):
    @staticmethod
    def forward(fctx, local, ctx, grad_scale):  # type: ignore[override]
        b = local.shape[0]
        index = ctx.cached(("index", b), lambda: ctx.layout.index(b)).to(local.device)  # [P, B, S_local]
        fctx.index, fctx.rank, fctx.grad_scale = index[ctx.rank], ctx.rank, grad_scale
        local = local.contiguous()
        parts = [local]
        if ctx.size > 1:
            parts = [torch.empty_like(local) for _ in range(ctx.size)]
            dist.all_gather(parts, local, group=ctx.group)
        out = local.new_zeros((b, ctx.layout.n + 1, *local.shape[2:]))  # slot n collects the padding rows
        for r, part in enumerate(parts):
            out.scatter_(1, index[r].view(b, -1, *([1] * (local.dim() - 2))).expand_as(part), part)
        return out[:, : ctx.layout.n]

    @staticmethod
    def backward(fctx, grad):  # type: ignore[override]
        grad = torch.cat((grad, grad.new_zeros((grad.shape[0], 1, *grad.shape[2:]))), dim=1)
        idx = fctx.index.view(grad.shape[0], -1, *([1] * (grad.dim() - 2)))
        local = grad.gather(1, idx.expand(-1, -1, *grad.shape[2:]))
        return local * fctx.grad_scale, None, None


def gather_tokens(ctx: RingContext, values: Tensor, *, grad_scale: float = 1.0) -> Tensor:
    """This batch's per-token ``values [B, S_local, ...]`` from every rank of the CP group, in global
    order: ``[B, N_layout, ...]`` (``N_layout``: the padded length ``shard_batch`` laid out, or
    ``N`` for packed documents; padding rows are 0). Differentiable: the backward gives every rank
    the gradient of its own rows, times ``grad_scale``, so a loss computed alike on every rank from
    the gathered values has exact gradients (pass ``ctx.size`` where DDP/FSDP average them over the
    CP group). It moves one value per token (4 bytes in float32), never hidden states or logits:
    the route for losses written per token, such as TRL's (``sequence_sums`` is the one for losses
    of per-sequence sums)."""
    return _GatherTokens.apply(values, ctx, grad_scale)


def _ring_context(kwargs: dict[str, Any]) -> RingContext:
    ctx = kwargs.get(CONTEXT_KEY)
    if not isinstance(ctx, RingContext):
        raise ValueError("sequence_logprobs: kwargs must come from hf_ring.shard_batch (they carry ring_context)")
    return ctx


def _divided(transform: Any, temperature: float) -> Any:
    def divided(z: Tensor) -> Tensor:
        return (transform(z) if transform is not None else z) / temperature

    return divided


def sequence_logprobs(
    model: nn.Module,
    kwargs: dict[str, Any],
    *,
    stats: tuple[str, ...] = (),
    temperature: float = 1.0,
    chunk_size: int | None = None,
    forward: Any = None,
) -> dict[str, Tensor]:
    """Run ``model`` on a labelled ``shard_batch`` batch and return this rank's per-token
    log-probabilities of the labels, computed from the LM head's input in chunks (never the
    ``[tokens, vocab]`` logits).

    Args:
        model: a causal LM loaded with ``attn_implementation="ring"`` (possibly wrapped by PEFT,
            DDP or FSDP). Its chunked loss keeps the LM head's input (``hf_ring.enable_chunked_loss``;
            a model without one gets one for this call only, removed after it): what the model does
            between its head and its logits, soft-caps and scales, is applied to every chunk.
        kwargs: ``shard_batch(...)`` of a batch with ``labels`` (``-100`` where a token has no
            target: the prompt, padding).
        stats: per-token statistics to return as well, without gradient (``entropy``,
            ``log_sum_sq_probs``, ``mean_logits``, ``is_top1``; see ``chunked_token_logprobs``).
        temperature: the logits are divided by it (GRPO's sampling temperature).
        chunk_size: tokens per chunk of the LM head (default: by the vocabulary size).
        forward: what to call with the batch's keyword arguments (default: ``model``; a wrapper's
            inner forward, say).

    Returns:
        ``{"log_probs": [B, S_local], **stats}`` float32, in the batch's layout, 0 where there is no
        target; ``log_probs`` differentiable. ``sequence_sums(kwargs["ring_context"], ...)`` turns
        them into per-sequence (or per-document) sums.
    """
    from .patches import chunked_loss

    ctx = _ring_context(kwargs)
    targets = kwargs.get("shift_labels")
    if targets is None or not ctx.labelled:
        raise ValueError("sequence_logprobs: the shard_batch batch needs labels (-100 where there is no target)")
    call = {k: v for k, v in kwargs.items() if k not in ("labels", "shift_labels", "num_items_in_batch")}
    with chunked_loss(model, "sequence_logprobs") as chunked:  # the model's own, or one for this call only
        (forward or model)(**call)  # the decoder runs; the chunked loss keeps the LM head's input for this context
        kept = chunked.take(ctx)
    if kept is None:
        raise RuntimeError("sequence_logprobs: the model's LM head did not run on this batch (full_logits batch?)")
    transform = kept.transform if temperature == 1.0 else _divided(kept.transform, temperature)
    return chunked_token_logprobs(
        kept.hidden,
        kept.head,
        targets.to(kept.hidden.device),
        ignore_index=IGNORE_INDEX,
        chunk_size=chunk_size or kept.chunk_size,
        logits_transform=transform,
        stats=stats,
    )
