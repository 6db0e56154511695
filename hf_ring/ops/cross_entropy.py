"""Causal-LM loss without the ``[tokens, vocab]`` logits: LM head + cross-entropy in chunks.

At 128K tokens per rank and a 128K vocabulary, the logits alone would take 64 GB in float32. Here
the LM head and the cross-entropy run over chunks of at most ``chunk_size`` tokens that hold a
target; each chunk's logits live only while that chunk is computed (forward) and recomputed
(backward). Loss and gradients are those of the full path (``ForCausalLMLoss``): logits in the
head's dtype (under autocast: the autocast dtype, in forward and in backward's recompute alike),
upcast to float32, cross-entropy summed in float32 and divided by ``num_items_in_batch`` (or by the
number of targets), ``ignore_index`` rows contributing nothing. What a model does between its head
and its logits (a soft-cap, a scale, a cast: ``logits_transform``) runs on every chunk.

``chunked_causal_lm_loss(hidden, head, shift_labels, ...)`` is the op;
``hf_ring.enable_chunked_loss(model)`` (``hf_ring.transformers.patches``) wires it into a
transformers causal LM. This module imports only torch.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

__all__ = ["IGNORE_INDEX", "TOKEN_STATS", "chunked_causal_lm_loss", "chunked_token_logprobs", "default_chunk_size"]

IGNORE_INDEX = -100  # the label of a position without a target (transformers' convention)
LOGITS_CHUNK_BYTES = 256 * 2**20  # float32 logits of one chunk, by default
PRODUCT_BLOCK_BYTES = 64 * 2**20  # the head gradient's blocked product, where no fused kernel takes it


def default_chunk_size(vocab_size: int, budget_bytes: int = LOGITS_CHUNK_BYTES) -> int:
    """Tokens per chunk such that one chunk's float32 logits take about ``budget_bytes``
    (at least 64, at most 16384 tokens)."""
    return int(min(16384, max(64, budget_bytes // (4 * max(1, vocab_size)))))


# --- the loss --------------------------------------------------------------------------------------


def _autocast_dtype(x: Tensor) -> torch.dtype | None:
    """The dtype that autocast gives a GEMM on ``x``'s device now (``None``: autocast is off there, or
    ``x`` is float64, which autocast leaves alone)."""
    device = x.device.type
    if x.dtype == torch.float64 or not torch.is_autocast_enabled(device):
        return None
    return torch.get_autocast_dtype(device)


Transform = Callable[[Tensor], Tensor]  # the head's output [T, V] -> the model's logits [T, V']


def _logits(z: Tensor, transform: Transform | None, dtype: torch.dtype | None) -> Tensor:
    """The float32 logits of the head's output ``z``: ``transform(z)`` under the forward's autocast."""
    if transform is None:
        return z.float()
    with torch.autocast(z.device.type, dtype=dtype, enabled=dtype is not None):
        return transform(z).float()


def _cast(tensors: tuple[Tensor | None, ...], dtype: torch.dtype | None) -> tuple[Tensor | None, ...]:
    return tensors if dtype is None else tuple(t if t is None else t.to(dtype) for t in tensors)


def _add_product(acc: Tensor, a: Tensor, b: Tensor, budget: int | None = None) -> None:
    """``acc += a @ b`` accumulated in ``acc`` (float32) with no ``[M, N]`` temporary of the whole
    product: float32 operands by ``addmm_``; 16-bit operands on CUDA by one GEMM that accumulates and
    writes float32 into ``acc`` (``torch.addmm(..., out_dtype=torch.float32, out=acc)``); elsewhere (the
    CPU, or a torch whose kernel wants ``acc`` in the operands' dtype) in blocks of rows whose 16-bit
    product and its float32 copy take at most ``budget`` bytes."""
    if a.dtype == acc.dtype:
        acc.addmm_(a, b)
        return
    if acc.is_cuda:
        try:
            torch.addmm(acc, a, b, out_dtype=acc.dtype, out=acc)
            return
        except (RuntimeError, TypeError, NotImplementedError):
            pass  # refused before any work: the blocked product below
    budget = PRODUCT_BLOCK_BYTES if budget is None else budget
    rows = max(1, budget // max(1, b.shape[1] * (a.element_size() + acc.element_size())))
    for lo in range(0, a.shape[0], rows):
        acc[lo : lo + rows] += (a[lo : lo + rows] @ b).float()


TOKEN_STATS = ("entropy", "log_sum_sq_probs", "mean_logits", "is_top1")  # per-row, no gradient


def _row_stats(logits: Tensor, target: Tensor, wanted: object) -> dict[str, Tensor]:
    """The float32 statistics ``wanted`` (names of ``TOKEN_STATS``) of each row of ``logits [n, V]``:
    the entropy of its softmax, ``log sum_v p_v^2``, the mean logit, whether the target is the
    (first) largest logit (1.0 or 0.0)."""
    if not wanted:
        return {}
    out: dict[str, Tensor] = {}
    with torch.no_grad():
        if "entropy" in wanted or "log_sum_sq_probs" in wanted:
            logp = torch.log_softmax(logits, dim=-1)
            if "entropy" in wanted:
                out["entropy"] = -(logp.exp() * logp).sum(-1)
            if "log_sum_sq_probs" in wanted:
                out["log_sum_sq_probs"] = torch.logsumexp(2 * logp, dim=-1)
            del logp
        if "mean_logits" in wanted:
            out["mean_logits"] = logits.mean(-1)
        if "is_top1" in wanted:
            out["is_top1"] = (logits.argmax(-1) == target).float()
    return {k: out[k] for k in wanted}  # type: ignore[attr-defined]


class _ChunkedLinearCE(torch.autograd.Function):
    """``sum_t CE(f(h_t W^T + b), y_t) * scale`` over rows ``h [T, H]`` that all have a target (``f``:
    the model's logits transform, ``None`` for none).

    Saves ``h``, the float32 log-sum-exp of every row and nothing of size ``vocab``; backward
    recomputes each chunk's logits exactly as forward computed them. Under autocast, forward records
    the autocast dtype and both passes run the head in it, as ``F.linear`` runs in transformers' loss
    under the same autocast: the same GEMMs (the backward's three per chunk included), the same logits,
    upcast to float32 for the softmax. The head's gradient is accumulated in one float32 ``[V, H]``
    buffer (``_add_product``: no per-chunk ``[V, H]`` product in the head's dtype nor its float32 copy).
    """

    @staticmethod
    def forward(ctx, h, weight, bias, target, scale, chunk, transform=None, stats=None):  # type: ignore[override]
        ctx.dtype, ctx.scale, ctx.chunk, ctx.transform = _autocast_dtype(h), scale, chunk, transform
        lse = torch.empty(h.shape[0], dtype=torch.float32, device=h.device)
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        rows = None if stats is None else torch.empty(h.shape[0], dtype=torch.float32, device=h.device)
        extra = {k: torch.empty(h.shape[0], dtype=torch.float32, device=h.device) for k in stats or ()}
        with torch.autocast(h.device.type, enabled=False):  # cast here, the same way in backward
            wc, bc = _cast((weight, bias), ctx.dtype)
            for s in range(0, h.shape[0], chunk):
                (x,) = _cast((h[s : s + chunk],), ctx.dtype)
                logits = _logits(F.linear(x, wc, bc), transform, ctx.dtype)
                picked = logits.gather(1, target[s : s + chunk, None]).squeeze(1)
                for k, v in _row_stats(logits, target[s : s + chunk], extra).items():
                    extra[k][s : s + chunk] = v
                # log-sum-exp in place: one [chunk, vocab] buffer (torch.logsumexp would allocate a second)
                top = logits.amax(dim=-1, keepdim=True)
                chunk_lse = logits.sub_(top).exp_().sum(dim=-1).log_().add_(top.squeeze(1))
                lse[s : s + chunk] = chunk_lse
                if rows is None:
                    total += (chunk_lse - picked).sum()
                else:
                    rows[s : s + chunk] = chunk_lse - picked
                del logits
        ctx.save_for_backward(h, weight, bias, target, lse)
        if rows is None:
            return total * scale
        for v in extra.values():
            ctx.mark_non_differentiable(v)
        return (rows, *extra.values())

    @staticmethod
    def backward(ctx, grad, *_):  # type: ignore[override]
        h, weight, bias, target, lse = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        scale = grad.float() * ctx.scale  # a scalar, or [T] (the per-row form)
        dh = torch.empty_like(h) if need_h else None
        dw = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        db = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if need_b else None
        rows = torch.arange(min(ctx.chunk, h.shape[0]), device=h.device)
        with torch.autocast(h.device.type, enabled=False):
            wc, bc = _cast((weight, bias), ctx.dtype)
            for s in range(0, h.shape[0], ctx.chunk):
                (x,) = _cast((h[s : s + ctx.chunk],), ctx.dtype)
                n = x.shape[0]
                # d/dlogits of (lse - logit[target]) = softmax - onehot, times the loss scale; the
                # logits are those of forward (same inputs, dtype and op), so the softmax sums to 1
                z = F.linear(x, wc, bc)
                if ctx.transform is None:
                    p = z.float().sub_(lse[s : s + n, None]).exp_()
                    del z  # one [chunk, vocab] buffer of the head's dtype fewer while the gradient is formed
                else:
                    z.requires_grad_()
                    with torch.enable_grad():
                        logits = _logits(z, ctx.transform, ctx.dtype)
                    p = logits.detach().sub(lse[s : s + n, None]).exp_()
                p[rows[:n], target[s : s + n]] -= 1.0
                p.mul_(scale if scale.dim() == 0 else scale[s : s + n, None])
                if ctx.transform is not None:  # through the transform: d logits / d z
                    p = torch.autograd.grad(logits, z, p)[0]
                    del logits
                if need_b:
                    db += p.float().sum(0)
                dlogits = p.to(x.dtype)
                del p
                if need_h:
                    dh[s : s + n] = dlogits @ wc
                if need_w:
                    _add_product(dw, dlogits.t(), x)
                del dlogits
        return (
            dh,
            dw.to(weight.dtype) if need_w else None,
            db.to(bias.dtype) if need_b else None,
            None,
            None,
            None,
            None,
            None,
        )


def _plain_linear(head: nn.Module) -> bool:
    """``head`` computes ``F.linear(x, head.weight, head.bias)``: an ``nn.Linear`` (or a subclass such
    as FSDP2's ``FSDPLinear``) whose forward is ``nn.Linear.forward``, not replaced on the instance."""
    return isinstance(head, nn.Linear) and type(head).forward is nn.Linear.forward and "forward" not in vars(head)


def _head_ce_sum(head: nn.Module, h: Tensor, target: Tensor, transform: Transform | None = None) -> Tensor:
    logits = head(h)
    logits = (transform(logits) if transform is not None else logits).float()
    return F.cross_entropy(logits, target, reduction="sum")


def _head_ce_rows(
    head: nn.Module, h: Tensor, target: Tensor, transform: Transform | None, stats: tuple[str, ...]
) -> tuple[Tensor, ...]:
    logits = head(h)
    logits = (transform(logits) if transform is not None else logits).float()
    return (F.cross_entropy(logits, target, reduction="none"), *_row_stats(logits.detach(), target, stats).values())


def _rows(hidden: Tensor, shift_labels: Tensor, ignore_index: int, caller: str) -> tuple[Tensor, Tensor, Tensor]:
    """``hidden [..., T, H]`` and ``shift_labels [..., T]`` as rows ``[T', H]``, targets ``[T']``, and the
    indices of the rows that have a target."""
    h = hidden.reshape(-1, hidden.shape[-1])
    y = shift_labels.reshape(-1).to(h.device)
    if y.shape[0] != h.shape[0]:
        raise ValueError(
            f"{caller}: {h.shape[0]} hidden rows but {y.shape[0]} labels; the labels must be "
            "shifted already (shift_labels) and cover the same positions as the hidden states"
        )
    return h, y, (y != ignore_index).nonzero().squeeze(1)


def chunked_causal_lm_loss(
    hidden: Tensor,
    head: nn.Module,
    shift_labels: Tensor,
    *,
    num_items_in_batch: Tensor | int | None = None,
    ignore_index: int = IGNORE_INDEX,
    chunk_size: int | None = None,
    logits_transform: Transform | None = None,
) -> Tensor:
    """Cross-entropy of ``logits_transform(head(hidden))`` against ``shift_labels`` without the full logits.

    Args:
        hidden: ``[..., T, H]``, the last hidden states (after the final norm).
        head: the LM head. An ``nn.Linear`` with the stock forward (the usual case, tied or not;
            also an FSDP2-sharded one, whose weight is unsharded while the model runs) takes a fused
            path that reads its weight directly and saves only a float32 log-sum-exp per row; any
            other module (a LoRA-wrapped head, say) is run per chunk under activation checkpointing.
        shift_labels: ``[..., T]`` targets already shifted (``shift_labels[t]`` is the token
            after position ``t``), ``ignore_index`` where there is none.
        num_items_in_batch: the divisor of the summed loss (as in transformers); ``None``: the
            number of targets here (a mean).
        chunk_size: tokens per chunk (default: ``default_chunk_size(vocab)``).
        logits_transform: what the model does between its head and its logits, as a function of a
            chunk of the head's output ``[T, V]`` (elementwise per row: a soft-cap, a scale, a
            cast; ``hf_ring.transformers.logits`` finds it); it runs on every chunk, in forward
            and in backward's recompute, under the forward's autocast. ``None``: the head's output.

    Returns:
        a float32 scalar equal to ``ForCausalLMLoss`` on the full logits, with the same gradients
        for ``hidden`` and the head's parameters. It is connected to ``hidden`` and the head even
        when no row has a target (zero loss, zero gradients), so that every rank of a DDP or FSDP
        world runs the same backward.
    """
    h, y, keep = _rows(hidden, shift_labels, ignore_index, "chunked_causal_lm_loss")
    if num_items_in_batch is None:
        divisor = float(keep.numel())  # the mean of the full path (NaN when there is no target)
    elif torch.is_tensor(num_items_in_batch):
        divisor = float(num_items_in_batch.item())
    else:
        divisor = float(num_items_in_batch)
    scale = 1.0 / divisor if divisor else float("nan")
    if keep.numel() < y.numel():  # rows without a target take no part in loss or gradients
        h, y = h.index_select(0, keep), y.index_select(0, keep)
    vocab = getattr(head, "out_features", None) or getattr(getattr(head, "weight", None), "shape", [0])[0]
    chunk = int(chunk_size or default_chunk_size(int(vocab)))
    if _plain_linear(head):
        extra = () if logits_transform is None else (logits_transform,)  # older Functions take 6 arguments
        return _ChunkedLinearCE.apply(h, head.weight, head.bias, y, scale, chunk, *extra)
    if h.shape[0] == 0:  # no target here: a zero that keeps the head and the hidden states in the graph
        return head(h).float().sum() * 0.0
    total = hidden.new_zeros((), dtype=torch.float32)
    for s in range(0, h.shape[0], chunk):
        rows, targets = h[s : s + chunk], y[s : s + chunk]
        total = total + checkpoint(_head_ce_sum, head, rows, targets, logits_transform, use_reentrant=False)
    return total * scale


def chunked_token_logprobs(
    hidden: Tensor,
    head: nn.Module,
    shift_labels: Tensor,
    *,
    ignore_index: int = IGNORE_INDEX,
    chunk_size: int | None = None,
    logits_transform: Transform | None = None,
    stats: tuple[str, ...] = (),
) -> dict[str, Tensor]:
    """Per-token log-probabilities of ``shift_labels`` under ``logits_transform(head(hidden))``,
    without the full logits (the chunks of ``chunked_causal_lm_loss``, one float32 value per row
    saved for backward).

    Args:
        hidden: ``[..., T, H]``, the last hidden states; head, chunk_size, logits_transform: as in
            ``chunked_causal_lm_loss`` (a temperature is a transform: ``lambda z: z / t``).
        shift_labels: ``[..., T]`` targets already shifted, ``ignore_index`` where there is none.
        stats: names from ``TOKEN_STATS`` to compute as well, per token, without gradient:
            ``entropy`` (of the softmax), ``log_sum_sq_probs`` (``log sum_v p_v^2``),
            ``mean_logits`` (over the vocabulary), ``is_top1`` (1.0 where the target is the first
            largest logit).

    Returns:
        ``{"log_probs": [..., T], **{name: [..., T]}}`` float32, 0 where ``shift_labels`` is
        ``ignore_index``. ``log_probs`` is differentiable with respect to ``hidden`` and the head's
        parameters (the gradient of ``log_softmax`` at the target), also when no row has a target.
    """
    unknown = [k for k in stats if k not in TOKEN_STATS]
    if unknown:
        raise ValueError(f"chunked_token_logprobs: unknown stats {unknown}; choose from {list(TOKEN_STATS)}")
    h, y, keep = _rows(hidden, shift_labels, ignore_index, "chunked_token_logprobs")
    h, y = h.index_select(0, keep), y.index_select(0, keep)
    vocab = getattr(head, "out_features", None) or getattr(getattr(head, "weight", None), "shape", [0])[0]
    chunk = int(chunk_size or default_chunk_size(int(vocab)))
    stats = tuple(stats)
    if _plain_linear(head):
        rows = _ChunkedLinearCE.apply(h, head.weight, head.bias, y, 1.0, chunk, logits_transform, stats)
    elif h.shape[0] == 0:  # no target here: zeros that keep the head and the hidden states in the graph
        zero = head(h).float().sum(-1) * 0.0
        rows = (zero, *(zero.detach() for _ in stats))
    else:
        parts = [
            checkpoint(_head_ce_rows, head, h[s : s + chunk], y[s : s + chunk], logits_transform, stats,
                       use_reentrant=False)
            for s in range(0, h.shape[0], chunk)
        ]  # fmt: skip
        rows = tuple(torch.cat(col) for col in zip(*parts))
    shape = shift_labels.shape
    out: dict[str, Tensor] = {}
    for name, v in zip(("log_probs", *stats), rows):
        v = -v if name == "log_probs" else v
        out[name] = v.new_zeros(shape.numel()).index_copy(0, keep, v).view(shape)
    return out
