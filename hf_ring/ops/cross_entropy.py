"""Causal-LM loss without the ``[tokens, vocab]`` logits: LM head + cross-entropy in chunks.

At 128K tokens per rank and a 128K vocabulary, the logits alone would take 64 GB in float32. Here
the LM head and the cross-entropy run over chunks of at most ``chunk_size`` tokens that hold a
target; each chunk's logits live only while that chunk is computed (forward) and recomputed
(backward). Loss and gradients are those of the full path (``ForCausalLMLoss``): logits in the
head's dtype, upcast to float32, cross-entropy summed in float32 and divided by
``num_items_in_batch`` (or by the number of targets), ``ignore_index`` rows contributing nothing.

Two ways in:

- ``chunked_causal_lm_loss(hidden, head, shift_labels, ...)``: the function itself.
- ``enable_chunked_loss(model)``: hooks a transformers causal LM (plain, PEFT- or DDP-wrapped) so
  that every call carrying a batch from ``hf_ring.shard_batch`` with labels computes its loss this
  way. The model then returns ``logits`` with zero positions (``[B, 0, V]``); calls without labels
  (evaluation, generation) and calls inside ``with full_logits():`` are unchanged.

This module imports only torch.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

__all__ = [
    "chunked_causal_lm_loss",
    "default_chunk_size",
    "enable_chunked_loss",
    "disable_chunked_loss",
    "full_logits",
]

IGNORE_INDEX = -100
LOGITS_CHUNK_BYTES = 256 * 2**20  # float32 logits of one chunk, by default


def default_chunk_size(vocab_size: int, budget_bytes: int = LOGITS_CHUNK_BYTES) -> int:
    """Tokens per chunk such that one chunk's float32 logits take about ``budget_bytes``
    (at least 64, at most 16384 tokens)."""
    return int(min(16384, max(64, budget_bytes // (4 * max(1, vocab_size)))))


# --- the loss --------------------------------------------------------------------------------------


class _ChunkedLinearCE(torch.autograd.Function):
    """``sum_t CE(h_t W^T + b, y_t) * scale`` over rows ``h [T, H]`` that all have a target.

    Saves ``h``, the float32 log-sum-exp of every row and nothing of size ``vocab``; backward
    recomputes each chunk's logits. The head's gradient is accumulated in float32.
    """

    @staticmethod
    def forward(ctx, h, weight, bias, target, scale, chunk):  # type: ignore[override]
        lse = torch.empty(h.shape[0], dtype=torch.float32, device=h.device)
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        for s in range(0, h.shape[0], chunk):
            logits = F.linear(h[s : s + chunk], weight, bias).float()
            picked = logits.gather(1, target[s : s + chunk, None]).squeeze(1)
            # log-sum-exp in place: one [chunk, vocab] buffer (torch.logsumexp would allocate a second)
            top = logits.amax(dim=-1, keepdim=True)
            chunk_lse = logits.sub_(top).exp_().sum(dim=-1).log_().add_(top.squeeze(1))
            lse[s : s + chunk] = chunk_lse
            total += (chunk_lse - picked).sum()
            del logits
        ctx.save_for_backward(h, weight, bias, target, lse)
        ctx.scale, ctx.chunk = scale, chunk
        return total * scale

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        h, weight, bias, target, lse = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        scale = grad.float() * ctx.scale
        dh = torch.empty_like(h) if need_h else None
        dw = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        db = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if need_b else None
        rows = torch.arange(min(ctx.chunk, h.shape[0]), device=h.device)
        for s in range(0, h.shape[0], ctx.chunk):
            hc = h[s : s + ctx.chunk]
            n = hc.shape[0]
            # d/dlogits of (lse - logit[target]) = softmax - onehot, times the loss scale
            p = F.linear(hc, weight, bias).float().sub_(lse[s : s + n, None]).exp_()
            p[rows[:n], target[s : s + n]] -= 1.0
            dlogits = p.mul_(scale).to(h.dtype)
            del p
            if need_h:
                dh[s : s + n] = dlogits @ weight
            if need_w:
                if dw.dtype == dlogits.dtype:
                    dw.addmm_(dlogits.t(), hc)
                else:
                    dw += (dlogits.t() @ hc).float()
            if need_b:
                db += dlogits.sum(0).float()
            del dlogits
        return (
            dh,
            dw.to(weight.dtype) if need_w else None,
            db.to(bias.dtype) if need_b else None,
            None,
            None,
            None,
        )


def _head_ce_sum(head: nn.Module, h: Tensor, target: Tensor) -> Tensor:
    logits = head(h).float()
    return F.cross_entropy(logits, target, reduction="sum")


def chunked_causal_lm_loss(
    hidden: Tensor,
    head: nn.Module,
    shift_labels: Tensor,
    *,
    num_items_in_batch: Tensor | int | None = None,
    ignore_index: int = IGNORE_INDEX,
    chunk_size: int | None = None,
) -> Tensor:
    """Cross-entropy of ``head(hidden)`` against ``shift_labels`` without the full logits.

    Args:
        hidden: ``[..., T, H]``, the last hidden states (after the final norm).
        head: the LM head. An ``nn.Linear`` (the usual case, tied or not) takes a fused path that
            saves only a float32 log-sum-exp per row; any other module (a LoRA-wrapped head, say)
            is run per chunk under activation checkpointing.
        shift_labels: ``[..., T]`` targets already shifted (``shift_labels[t]`` is the token
            after position ``t``), ``ignore_index`` where there is none.
        num_items_in_batch: the divisor of the summed loss (as in transformers); ``None``: the
            number of targets here (a mean).
        chunk_size: tokens per chunk (default: ``default_chunk_size(vocab)``).

    Returns:
        a float32 scalar equal to ``ForCausalLMLoss`` on the full logits, with the same gradients
        for ``hidden`` and the head's parameters.
    """
    h = hidden.reshape(-1, hidden.shape[-1])
    y = shift_labels.reshape(-1).to(h.device)
    if y.shape[0] != h.shape[0]:
        raise ValueError(
            f"chunked_causal_lm_loss: {h.shape[0]} hidden rows but {y.shape[0]} labels; the labels must be "
            "shifted already (shift_labels) and cover the same positions as the hidden states"
        )
    keep = (y != ignore_index).nonzero().squeeze(1)
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
    if type(head) is nn.Linear:
        return _ChunkedLinearCE.apply(h, head.weight, head.bias, y, scale, chunk)
    total = hidden.new_zeros((), dtype=torch.float32)
    for s in range(0, h.shape[0], chunk):
        total = total + checkpoint(_head_ce_sum, head, h[s : s + chunk], y[s : s + chunk], use_reentrant=False)
    return total * scale


# --- hooks on a transformers model --------------------------------------------------------------


@dataclass
class _Pending:
    """What the LM head's pre-hook caught for the loss of one call."""

    key: Any  # the call's CPLoss object (identity)
    hidden: Tensor
    head: nn.Module
    chunk_size: int | None

    def loss(
        self,
        labels: Tensor | None = None,
        shift_labels: Tensor | None = None,
        num_items_in_batch: Tensor | int | None = None,
        ignore_index: int = IGNORE_INDEX,
        **_: Any,
    ) -> Tensor:
        if shift_labels is None:
            if labels is None:
                raise ValueError("chunked loss: the model was called without labels")
            shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
        return chunked_causal_lm_loss(
            self.hidden,
            self.head,
            shift_labels,
            num_items_in_batch=num_items_in_batch,
            ignore_index=ignore_index,
            chunk_size=self.chunk_size,
        )


_local = threading.local()


def _slot() -> list:
    if not hasattr(_local, "slot"):
        _local.slot = [None, 0]  # [pending, full_logits depth]
    return _local.slot


def take_pending(key: Any) -> _Pending | None:
    """The hidden states the LM head's pre-hook set aside for the call that carries ``key``
    (its ``hf_ring_cp``), once; ``None`` when this call computed full logits."""
    slot = _slot()
    pending = slot[0]
    if key is None or pending is None or pending.key is not key:
        return None
    slot[0] = None
    return pending


@contextmanager
def full_logits():
    """Within this block, models hooked by ``enable_chunked_loss`` compute full logits again
    (and their loss from them), e.g. to read the logits of a labelled evaluation batch."""
    slot = _slot()
    slot[1] += 1
    try:
        yield
    finally:
        slot[1] -= 1


# Config fields of models whose logits are not plain ``lm_head(hidden)``: the chunked path would
# give a different loss, so enable_chunked_loss refuses them.
_LOGIT_POSTPROCESSING = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")


def _causal_lm(model: nn.Module) -> nn.Module:
    """The transformers ``...ForCausalLM`` inside ``model`` (plain, PEFT-, DDP- or FSDP-wrapped)."""
    for m in model.modules():
        if type(m).__module__.startswith("transformers.") and hasattr(m, "get_output_embeddings"):
            head = m.get_output_embeddings()
            if isinstance(head, nn.Module) and hasattr(m, "config"):
                return m
    raise TypeError(
        f"enable_chunked_loss: found no transformers causal LM with an output embedding (lm_head) in "
        f"{type(model).__name__}"
    )


class _Hooks:
    def __init__(self, lm: nn.Module, chunk_size: int | None) -> None:
        self.chunk_size = chunk_size
        self.armed: Any = None
        self.head = lm.get_output_embeddings()
        decoder = lm.get_decoder() if hasattr(lm, "get_decoder") else None
        if not isinstance(decoder, nn.Module):
            decoder = getattr(lm, getattr(lm, "base_model_prefix", "model"), None)
        if not isinstance(decoder, nn.Module) or decoder is lm:
            raise TypeError(f"enable_chunked_loss: cannot find the decoder of {type(lm).__name__}")
        self.handles = [
            decoder.register_forward_pre_hook(self._decoder_pre, with_kwargs=True),
            self.head.register_forward_pre_hook(self._head_pre),
        ]

    def _decoder_pre(self, module: nn.Module, args: Any, kwargs: dict) -> None:
        # A call with a labelled batch from shard_batch: it carries hf_ring_cp and shift_labels.
        cp, labels = kwargs.get("hf_ring_cp"), kwargs.get("shift_labels")
        self.armed = cp if cp is not None and labels is not None and not _slot()[1] else None

    def _head_pre(self, module: nn.Module, args: tuple) -> tuple | None:
        if self.armed is None or len(args) != 1:
            return None
        (hidden,) = args
        _slot()[0] = _Pending(self.armed, hidden, self.head, self.chunk_size)
        self.armed = None
        return (hidden[..., :0, :],)  # the model computes logits of zero positions

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def enable_chunked_loss(model: nn.Module, chunk_size: int | None = None) -> nn.Module:
    """Compute the loss of labelled ``shard_batch`` batches without full logits (idempotent).

    ``model``: a transformers causal LM, possibly wrapped by PEFT, DDP or FSDP (call it before or
    after wrapping). On every call that carries ``hf_ring_cp`` and ``shift_labels`` (a batch from
    ``hf_ring.shard_batch`` with labels), the LM head gets zero positions and the loss hook of
    ``attn_implementation="ring"`` computes the loss with ``chunked_causal_lm_loss`` instead, so
    ``out.logits`` is ``[B, 0, V]``. Calls without labels, and calls inside ``full_logits()``,
    return the full logits as before. Returns ``model``.
    """
    lm = _causal_lm(model)
    for name in _LOGIT_POSTPROCESSING:
        value = getattr(lm.config, name, None)
        if value not in (None, 1, 1.0):
            raise ValueError(
                f"enable_chunked_loss: {type(lm).__name__} post-processes its logits ({name}={value}), "
                "which the chunked loss does not reproduce"
            )
    old = getattr(lm, "_hf_ring_chunked", None)
    if old is not None:
        old.remove()
    lm._hf_ring_chunked = _Hooks(lm, chunk_size)
    return model


def disable_chunked_loss(model: nn.Module) -> nn.Module:
    """Undo ``enable_chunked_loss``: the model computes full logits for every call again."""
    lm = _causal_lm(model)
    hooks = getattr(lm, "_hf_ring_chunked", None)
    if hooks is not None:
        hooks.remove()
        del lm._hf_ring_chunked
    return model
