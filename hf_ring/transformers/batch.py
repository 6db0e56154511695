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
from ..ops.schedule import balanced_layout, layout_schedule
from ..ops.zigzag import hybrid, hybrid_multiple
from ..parallel import ContextParallel, context_parallel_state, default_group
from .context import KEY, RingContext

__all__ = ["shard_batch", "next_token_targets"]
_SEQ_KEYS = ("input_ids", "inputs_embeds", "labels", "attention_mask", "position_ids")
_PACKED_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")  # consumed here
_PASS_KEYS = ("num_items_in_batch", "use_cache", "return_dict", "output_hidden_states", "output_attentions")


def _zigzag(x: Tensor, size: int, rank: int, ulysses_size: int) -> Tensor:
    return hybrid(x, 1, size, rank, ulysses_size).contiguous()  # the batch shape was checked once, above


def _ulysses(group: dist.ProcessGroup | None) -> ContextParallel | None:
    """The state of ``setup_context_parallel`` when ``group`` is its CP group and it uses Ulysses."""
    cp = context_parallel_state() if dist.is_available() and dist.is_initialized() else None
    if cp is None or cp.ulysses_size == 1 or not (group is None or group is cp.cp_group):
        return None
    return cp


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


def next_token_targets(
    labels: Tensor, attention_mask: Tensor | None = None, position_ids: Tensor | None = None
) -> Tensor:
    """``[B, N]`` Hugging Face labels (unshifted, ``-100`` where there is no target) -> the target
    of each position, ``[B, N]``: ``labels[:, t + 1]``, ``-100`` at the end, wherever the
    right-padding ``attention_mask`` is 0, and before each packed document's first token (where
    ``position_ids`` restart at 0: the next token belongs to another document)."""
    if attention_mask is not None:
        labels = labels.masked_fill(~attention_mask.bool(), IGNORE_INDEX)
    if position_ids is not None:
        labels = labels.masked_fill((position_ids == 0).expand_as(labels), IGNORE_INDEX)  # labels[:, 0] go unused
    return torch.cat((labels[:, 1:], labels.new_full((labels.shape[0], 1), IGNORE_INDEX)), dim=1)


def document_starts(position_ids: Tensor) -> list[list[int]] | None:
    """Start offsets of the packed documents of each row of ``position_ids [B, N]`` (documents begin
    where positions restart at 0), or ``None`` when no row restarts (one sequence per row).

    Raises ``ValueError`` for positions that jump anywhere but back to 0 (they would give RoPE
    positions no document has)."""
    step = position_ids[:, 1:] - position_ids[:, :-1]
    restart = position_ids[:, 1:] == 0
    if not bool(((step == 1) | restart).all()):
        raise ValueError(
            "shard_batch: position_ids must count up by 1 within a document and restart at 0 where a "
            "packed document begins (transformers' DataCollatorWithFlattening convention); these jump "
            "elsewhere. Pass positions 0, 1, 2, ... per document, or no position_ids."
        )
    if not bool(restart.any()):
        return None
    return [[0, *(restart[i].nonzero().flatten() + 1).tolist()] for i in range(position_ids.shape[0])]


def _positions_from_cu_seq_lens(batch: dict[str, Any], n: int, device: torch.device) -> Tensor:
    cu_q, cu_k = batch.get("cu_seq_lens_q"), batch.get("cu_seq_lens_k")
    cu = cu_q if cu_q is not None else cu_k
    if cu_k is not None and not torch.equal(cu, cu_k):
        raise ValueError("shard_batch: cu_seq_lens_q and cu_seq_lens_k differ; packed causal LM training uses one")
    cu = cu.flatten().long().tolist()
    if cu[0] != 0 or cu[-1] != n or any(b <= a for a, b in zip(cu, cu[1:])):
        raise ValueError(f"shard_batch: cu_seq_lens {cu} must rise from 0 to the sequence length {n}")
    return torch.cat([torch.arange(b - a, device=device) for a, b in zip(cu, cu[1:])])[None]


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
            ``attention_mask [B, N]`` (right padding only), ``position_ids [B, N]`` (restarting at 0
            where a packed document begins, or ``cu_seq_lens_q/k [D + 1]`` for ``B = 1``),
            ``num_items_in_batch`` (valid targets of the whole step, e.g. over gradient
            accumulation and DP replicas; counted here otherwise).
        group: the CP group (default: that of ``setup_context_parallel``, else the world). The
            CP group of ``setup_context_parallel(..., ulysses_size=U)`` (by default or by name) is
            sharded in its Ulysses x ring layout: the zigzag over the ``R = P / U`` ring positions,
            each ring position's shard cut into ``U`` contiguous pieces (``hf_ring.ops.zigzag.hybrid``).
        pad_token_id: id used to pad the sequence to a multiple of ``2P`` (of ``R * lcm(2, U)`` with
            Ulysses; its targets are masked).
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
        function and the model's loss, which it sums over the CP group). ``N_pad`` is ``N`` rounded up
        to a multiple of ``2P`` (``hf_ring.ops.zigzag.hybrid_multiple(P, U)`` with Ulysses). Right
        padding is handled exactly: causal attention never lets a real token see the padding after
        it, and padded positions have no targets. Packed documents
        are exact: every token attends only to earlier tokens of its own document (the context
        carries the ring schedule cut along document boundaries, computed once per batch), RoPE sees
        each document's own positions, and no target crosses a document boundary (with Ulysses, the
        schedule is the ring's over its ``R`` positions).
    """
    unknown = [
        k for k, v in batch.items() if isinstance(v, Tensor) and k not in (*_SEQ_KEYS, *_PASS_KEYS, *_PACKED_KEYS)
    ]
    if unknown:
        raise ValueError(
            f"shard_batch: does not know how to shard {unknown}; it handles {list(_SEQ_KEYS)}. Remove "
            "these keys or shard them yourself with hf_ring.shard."
        )
    cp = _ulysses(group)
    if group is None:
        group = default_group()
    size, rank = group_size_rank(group)
    ulysses_size = cp.ulysses_size if cp is not None else 1
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
    multiple = hybrid_multiple(size, ulysses_size)
    if n < multiple:
        pieces = f"2 * P = {multiple} zigzag chunks" if ulysses_size == 1 else f"the {multiple} pieces of its layout"
        raise ValueError(
            f"shard_batch: a sequence of {n} tokens is shorter than {pieces}; "
            "context parallelism is for long sequences: use a smaller cp_size or longer sequences."
        )
    n_pad = -(-n // multiple) * multiple
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
    positions_given = positions is not None or any(batch.get(k) is not None for k in _PACKED_KEYS[:2])
    if positions is None and any(batch.get(k) is not None for k in ("cu_seq_lens_q", "cu_seq_lens_k")):
        if b != 1:
            raise ValueError("shard_batch: cu_seq_lens describe one packed row; pass position_ids for B > 1")
        positions = _positions_from_cu_seq_lens(batch, n, x.device)
    if positions is None:
        positions = torch.arange(n, device=x.device).expand(b, n)
    positions = positions.expand(b, n)
    if mask is not None and batch.get("position_ids") is not None:
        # whatever positions the right padding carries, it continues the last document
        idx = torch.arange(n, device=x.device)
        real = mask.bool().sum(1, keepdim=True)
        last = positions.gather(1, real - 1)
        positions = torch.where(idx >= real, last + idx - real + 1, positions)
    starts = document_starts(positions)
    if starts is not None:
        return _shard_packed(batch, key, x, positions, starts, labels, mask, group, size, rank, dp_size, full_logits,
                             pad_token_id, cp)  # fmt: skip  (packed positions are always given)
    if pad:
        step = torch.arange(1, pad + 1, device=x.device)
        positions = torch.cat((positions, positions[:, -1:] + step), dim=1)

    out: dict[str, Any] = {k: batch[k] for k in _PASS_KEYS if k in batch}
    out[key] = _zigzag(padded(x, pad_token_id if key == "input_ids" else 0.0), size, rank, ulysses_size)
    out["position_ids"] = _zigzag(positions, size, rank, ulysses_size)
    out.setdefault("use_cache", False)
    if labels is not None:
        shifted = padded(next_token_targets(labels.expand(b, n), mask), IGNORE_INDEX)
        if "num_items_in_batch" not in out:
            out["num_items_in_batch"] = (shifted != IGNORE_INDEX).sum()
        local = _zigzag(shifted, size, rank, ulysses_size)
        # ``labels`` only switches the model's loss on; ``shift_labels`` are the targets it uses.
        out["labels"] = local
        out["shift_labels"] = local
    out[KEY] = RingContext(
        group, size, rank, grad_scale=float(size * dp_size), labelled=labels is not None, full_logits=full_logits,
        positions_given=positions_given, ulysses_size=ulysses_size,
        ulysses_group=None if cp is None else cp.ulysses_group, ring_group=None if cp is None else cp.ring_group,
    )  # fmt: skip
    return out


def _shard_packed(
    batch: dict[str, Any], key: str, x: Tensor, positions: Tensor, starts: list[list[int]], labels: Tensor | None,
    mask: Tensor | None, group: dist.ProcessGroup | None, size: int, rank: int, dp_size: int, full_logits: bool,
    pad_token_id: int, cp: ContextParallel | None,
) -> dict[str, Any]:
    """``shard_batch`` for packed documents: the zigzag applied to every document
    (``balanced_layout``: each rank holds ``1/P`` of every document's work, no padding but at most
    ``P - 1`` rows), the ring schedule cut along the documents, computed once for the batch.

    With Ulysses (``cp``: ``U > 1``) the layout and schedule are those of the ``R = P / U`` ring
    positions, and each ring position's rows (padded to a multiple of ``U``) are cut into ``U``
    contiguous pieces, one per rank of its Ulysses group (the all-to-all puts them back together)."""
    b, n = x.shape[:2]
    u_size = cp.ulysses_size if cp is not None else 1
    ring, ring_pos = size // u_size, rank // u_size
    layouts = [balanced_layout(s, n, ring) for s in starts]
    local = -(-max(length for _, length in layouts) // u_size) * u_size
    # global index of every row of every ring position, [R, B, local]; n (a pad slot) where it has fewer rows
    index = torch.full((ring, b, local), n, dtype=torch.long)
    for i, (layout, _) in enumerate(layouts):
        for r, segs in enumerate(layout):
            if segs:
                rows = torch.cat([torch.arange(seg.start, seg.stop) for seg in segs])
                index[r, i, : rows.numel()] = rows
    if len({tuple(s) for s in starts}) == 1:
        schedule = layout_schedule(layouts[0][0], ring_pos)
    else:
        per_row = [layout_schedule(layout, ring_pos, (i, i + 1)) for i, (layout, _) in enumerate(layouts)]
        schedule = [tuple(blk for row in per_row for blk in row[step]) for step in range(ring)]
    # rank r * U + u holds piece u of ring position r's rows: [P, B, local / U]
    index = index.view(ring, b, u_size, local // u_size).transpose(1, 2).reshape(size, b, local // u_size)
    local //= u_size
    mine = index[rank].to(x.device)

    def take(t: Tensor, fill: float) -> Tensor:
        full = torch.cat((t, t.new_full((t.shape[0], 1, *t.shape[2:]), fill)), dim=1)  # the pad slot at n
        idx = mine.view(b, local, *([1] * (t.dim() - 2))).expand(b, local, *t.shape[2:])
        return full.gather(1, idx)

    out: dict[str, Any] = {k: batch[k] for k in _PASS_KEYS if k in batch}
    out[key] = take(x.expand(b, *x.shape[1:]), pad_token_id if key == "input_ids" else 0.0)
    out["position_ids"] = take(positions, 0)
    out.setdefault("use_cache", False)
    if labels is not None:
        shifted = next_token_targets(labels.expand(b, n), mask, positions)
        if "num_items_in_batch" not in out:
            out["num_items_in_batch"] = (shifted != IGNORE_INDEX).sum()
        out["labels"] = out["shift_labels"] = take(shifted, IGNORE_INDEX)
    out[KEY] = RingContext(
        group, size, rank, grad_scale=float(size * dp_size), labelled=labels is not None, full_logits=full_logits,
        schedule=schedule, index=index, length=n, ulysses_size=u_size,
        ulysses_group=None if cp is None else cp.ulysses_group, ring_group=None if cp is None else cp.ring_group,
    )  # fmt: skip
    return out
