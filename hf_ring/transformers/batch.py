"""Turn a full batch into this rank's model inputs: pad, shift labels, shard, count targets.

Every rank of a CP group passes the same full batch; each gets back the keyword arguments for its
zigzag shard, with one ``RingContext`` (keyword ``ring_context``) that carries what the attention
function and the loss need for this batch. This module imports only torch (it follows
transformers' batch conventions, which is why it lives with the glue).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from ..ops.comm import check_same_across_ranks, group_size_rank
from ..ops.cross_entropy import IGNORE_INDEX
from ..ops.zigzag import zigzag
from ..parallel import default_group
from .context import KEY, RingContext

__all__ = ["shard_batch", "next_token_targets"]
_SEQ_KEYS = ("input_ids", "inputs_embeds", "labels", "attention_mask", "position_ids")
_PASS_KEYS = ("num_items_in_batch", "use_cache", "return_dict", "output_hidden_states", "output_attentions")


def _zigzag(x: Tensor, size: int, rank: int) -> Tensor:
    return zigzag(x, 1, size, rank).contiguous()  # the batch shape was checked once, above


def _check_right_padding(mask: Tensor) -> None:
    m = mask.bool()
    if (m[:, 1:] & ~m[:, :-1]).any():
        raise ValueError(
            "shard_batch: attention_mask has a 0 before a 1 (left padding, or holes inside a "
            "sequence). hf_ring handles right padding exactly (padding after the last token of each "
            "sequence); re-tokenize with tokenizer.padding_side='right', or drop the padding by "
            "packing sequences to equal length."
        )
    if not m[:, 0].all():
        raise ValueError("shard_batch: a sequence of the batch is empty (its attention_mask is all 0)")


def _check_one_document(positions: Tensor, mask: Tensor | None) -> None:
    """Refuse ``position_ids`` that restart inside a sequence (packed documents): the ring does not
    honour document boundaries yet, and attending across them would be silently wrong."""
    bad = positions[:, 1:] != positions[:, :-1] + 1
    if mask is not None:
        bad &= mask[:, 1:].bool()  # positions inside the right padding do not matter
    if bad.any():
        row, t = (int(i) for i in bad.nonzero()[0])
        raise ValueError(
            f"shard_batch: position_ids restart inside sequence {row} of the batch (at token {t + 1}: "
            f"{int(positions[row, t])} -> {int(positions[row, t + 1])}), the transformers convention for packed "
            "documents. Ring attention does not honour document boundaries yet, so every token would attend "
            "across them. Pad each document into its own sequence instead (hf_ring recipes: data.boundaries: "
            "pad), or wait for packed-document support; position_ids must count up by one within a sequence."
        )


def next_token_targets(labels: Tensor, attention_mask: Tensor | None = None) -> Tensor:
    """``[B, N]`` Hugging Face labels (unshifted, ``-100`` where there is no target) -> the target
    of each position, ``[B, N]``: ``labels[:, t + 1]``, ``-100`` at the end and wherever the
    right-padding ``attention_mask`` is 0."""
    if attention_mask is not None:
        labels = labels.masked_fill(~attention_mask.bool(), IGNORE_INDEX)
    return torch.cat((labels[:, 1:], labels.new_full((labels.shape[0], 1), IGNORE_INDEX)), dim=1)


def shard_batch(
    batch: dict[str, Any],
    *,
    group: dist.ProcessGroup | None = None,
    pad_token_id: int = 0,
    dp_size: int = 1,
    full_logits: bool = False,
) -> dict[str, Any]:
    """This rank's keyword arguments for ``model(**...)`` from a full batch.

    Args:
        batch: ``input_ids [B, N]`` (or ``inputs_embeds [B, N, H]``); optional ``labels [B, N]``
            (Hugging Face convention: unshifted, ``-100`` where there is no target),
            ``attention_mask [B, N]`` (right padding only), ``position_ids [B, N]`` (counting up
            by one within each sequence: packed documents, whose positions restart, are refused),
            ``num_items_in_batch`` (valid targets of the whole step, e.g. over gradient
            accumulation and DP replicas; counted here otherwise).
        group: the CP group (default: that of ``setup_context_parallel``, else the world).
        pad_token_id: id used to pad the sequence to a multiple of ``2P`` (its targets are masked).
        dp_size: number of data-parallel replicas that ``num_items_in_batch`` spans (it then
            counts the targets of all of them, and the backward is scaled to match DP averaging).
        full_logits: return full logits even from a model with ``enable_chunked_loss`` (whose
            labelled batches otherwise return ``[B, 0, V]`` logits).

    Returns:
        ``input_ids`` (or ``inputs_embeds``) and ``position_ids`` of shape ``[B, N_pad / P]``
        (global positions, zigzag order); when labels are given, ``labels`` and ``shift_labels``
        ``[B, N_pad / P]`` (shifted on the full sequence before sharding, so no target is lost at
        chunk boundaries) and ``num_items_in_batch``; ``use_cache=False``; and ``ring_context``
        (a ``RingContext``: the CP group and loss policy of this batch, read by the ring attention
        function and the model's loss, which it sums over the CP group). ``N_pad`` is ``N`` rounded up to a
        multiple of ``2P``. Right padding is handled exactly: causal attention never lets a real
        token see the padding after it, and padded positions have no targets.
    """
    unknown = [k for k, v in batch.items() if isinstance(v, Tensor) and k not in (*_SEQ_KEYS, *_PASS_KEYS)]
    if unknown:
        raise ValueError(
            f"shard_batch: does not know how to shard {unknown}; it handles {list(_SEQ_KEYS)}. Remove "
            "these keys or shard them yourself with hf_ring.shard."
        )
    if group is None:
        group = default_group()
    size, rank = group_size_rank(group)
    key = "input_ids" if "input_ids" in batch else "inputs_embeds"
    if key not in batch:
        raise ValueError("shard_batch: the batch needs input_ids [B, N] or inputs_embeds [B, N, H]")
    x: Tensor = batch[key]
    b, n = x.shape[:2]
    check_same_across_ranks([b, n], group, "the batch shape [B, N] (every rank of a CP group needs the same batch)")
    for k in ("labels", "attention_mask", "position_ids"):
        v = batch.get(k)
        if v is not None and (v.dim() != 2 or v.shape[1] != n or v.shape[0] not in (1, b)):
            raise ValueError(f"shard_batch: {k} has shape {tuple(v.shape)}, expected [{b}, {n}]")
    if n < 2 * size:
        raise ValueError(
            f"shard_batch: a sequence of {n} tokens is shorter than 2 * P = {2 * size} zigzag chunks; "
            "context parallelism is for long sequences: use a smaller cp_size or longer sequences."
        )
    n_pad = -(-n // (2 * size)) * 2 * size
    pad = n_pad - n

    def padded(t: Tensor, value: float) -> Tensor:
        if pad == 0:
            return t
        shape = (*t.shape[:1], pad, *t.shape[2:])
        return torch.cat((t, t.new_full(shape, value)), dim=1)

    labels = batch.get("labels")
    mask = batch.get("attention_mask")
    if mask is not None:
        _check_right_padding(mask)
    positions = batch.get("position_ids")
    if positions is None:
        positions = torch.arange(n, device=x.device).expand(b, n)
    positions = positions.expand(b, n)
    _check_one_document(positions, mask)
    step = torch.arange(1, pad + 1, device=x.device)
    positions = torch.cat((positions, positions[:, -1:] + step), dim=1) if pad else positions

    out: dict[str, Any] = {k: batch[k] for k in _PASS_KEYS if k in batch}
    out[key] = _zigzag(padded(x, pad_token_id if key == "input_ids" else 0.0), size, rank)
    out["position_ids"] = _zigzag(positions, size, rank)
    out.setdefault("use_cache", False)
    if labels is not None:
        shifted = padded(next_token_targets(labels.expand(b, n), mask), IGNORE_INDEX)
        if "num_items_in_batch" not in out:
            out["num_items_in_batch"] = (shifted != IGNORE_INDEX).sum()
        local = _zigzag(shifted, size, rank)
        # ``labels`` only switches the model's loss on; ``shift_labels`` are the targets it uses.
        out["labels"] = local
        out["shift_labels"] = local
    out[KEY] = RingContext(
        group, size, rank, grad_scale=float(size * dp_size), labelled=labels is not None, full_logits=full_logits
    )
    return out
