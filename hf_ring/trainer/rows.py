"""TRL's padded rows and the ring: rows packed as the documents of one row, and per-row sums put
back where TRL's loss code reads them.

TRL's ``DPOTrainer`` hands its fused LM head ``R = 2B`` right-padded rows (the chosen, then the
rejected completions) and reads the per-token outputs ``[R, N - 1]`` only through sums over each
row's completion tokens (``trl/trainer/dpo_trainer.py``, ``_compute_loss`` and
``compute_ref_log_probs``, TRL 1.16: ``log_probs.sum(1)``, the masked sums of ``entropy``,
``mean_logits``, ``log_sum_sq_probs``, the masked count of ``is_top1``; with ``ld_alpha`` the
log-probabilities' sums over two parts of each row: the tokens within the shorter completion of the
pair, and the rest). ``pack_rows`` moves rows into one packed row (its documents);
``plant_row_sums`` builds ``[R, N - 1]`` tensors whose masked row sums are given per-row sums, so
no per-token value has to be gathered over the CP group.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["pack_image_rows", "pack_rows", "plant_row_sums"]


def pack_rows(batch: dict[str, Tensor]) -> tuple[dict[str, Tensor], Tensor]:
    """The right-padded rows of ``batch`` (``input_ids``, ``labels``, ``attention_mask [R, N]``) as
    the packed documents of one row: ``input_ids``/``labels [1, T]`` (``T``: the real tokens) with
    ``position_ids [1, T]`` restarting at 0 at each row's first token, so that every token sees its
    own row only and the RoPE positions are the padded rows' own; and ``keep [R, N]``, where the
    tokens came from. Raises ``NotImplementedError`` for left padding, given ``position_ids`` or an
    empty row."""
    ids = batch["input_ids"]
    mask = batch.get("attention_mask")
    keep = torch.ones_like(ids, dtype=torch.bool) if mask is None else mask.bool()
    lengths = keep.sum(1)
    right = torch.arange(ids.shape[1], device=ids.device)[None] < lengths[:, None]
    if batch.get("position_ids") is not None or not bool(right.eq(keep).all()):
        raise NotImplementedError(
            "hf_ring: padding_free=True packs right-padded rows without position_ids; this batch has "
            f"{'position_ids' if batch.get('position_ids') is not None else 'padding that is not on the right'}. "
            "Set padding_free=False."
        )
    if not bool((lengths > 0).all()):
        raise NotImplementedError("hf_ring: padding_free=True with an empty row; set padding_free=False.")
    pos = torch.cat([torch.arange(int(n), device=ids.device) for n in lengths.tolist()])
    packed = {k: batch[k][keep][None] for k in ("input_ids", "labels") if batch.get(k) is not None}
    return {**packed, "position_ids": pos[None]}, keep


def pack_image_rows(batch: dict[str, Tensor], rope_model: Any) -> tuple[dict[str, Tensor], Tensor]:
    """``pack_rows`` for rows with Qwen-style images (``pixel_values [patches, C]``, ``image_grid_thw``,
    ``mm_token_type_ids``; videos alike): each right-padded row becomes one document with its own
    images (given in row order, as TRL's vision collator and the model's merge take them), packed by
    ``hf_ring.data.images.pack_multimodal`` with ``[4, 1, T]`` positions (the text row, then each
    document's M-RoPE rows from ``rope_model``'s ``get_rope_index``: the padded row's own). Returns the
    packed batch and ``keep [R, N]``. Raises ``NotImplementedError`` for images without grids (Gemma 3,
    Llama 4), given ``position_ids``, or padding that is not on the right."""
    from ..data.images import pack_multimodal

    text, keep = pack_rows(batch)  # the checks (right padding, no position_ids, no empty row)
    del text
    if batch.get("mm_token_type_ids") is None or not any(batch.get(g) is not None for _, g in _GRIDS.values()):
        raise NotImplementedError(
            "hf_ring: padding_free=True with images packs Qwen-style batches (pixel_values with image_grid_thw, "
            "mm_token_type_ids) only; set padding_free=False."
        )
    merge = int(rope_model.config.vision_config.spatial_merge_size) ** 2
    docs: list[dict[str, Any]] = []
    taken = {k: [0, 0] for k in _GRIDS}  # per kind: items and pixel rows used so far
    for r in range(keep.shape[0]):
        doc: dict[str, Any] = {k: batch[k][r : r + 1, keep[r]] for k in ("input_ids", "labels", "mm_token_type_ids")}
        for kind, (pixels, grids) in _GRIDS.items():
            tokens = int((doc["mm_token_type_ids"] == kind).sum())
            grid = batch.get(grids)
            if grid is None:
                continue
            item, row = taken[kind]
            sizes = grid.prod(-1).tolist()
            end, count = item, 0
            while count < tokens and end < len(sizes):
                count, end = count + sizes[end] // merge, end + 1
            if count != tokens:
                raise ValueError(f"hf_ring: row {r} has {tokens} {grids} tokens, its images give {count}")
            n = sum(sizes[item:end])
            doc[pixels], doc[grids] = batch[pixels][row : row + n], grid[item:end]
            taken[kind] = [end, row + n]
        docs.append(doc)
    return pack_multimodal(docs, rope_model=rope_model), keep


_GRIDS = {1: ("pixel_values", "image_grid_thw"), 2: ("pixel_values_videos", "video_grid_thw")}  # mm_token_type_ids


def _first(mask: Tensor) -> Tensor:
    """``[R, N]`` float: 1 at each row's first ``True`` of ``mask``, 0 elsewhere (and on rows without one)."""
    return (F.one_hot(mask.float().argmax(1), mask.shape[1]) * mask.any(1, keepdim=True)).float()


def plant_row_sums(sums: dict[str, Tensor], label_mask: Tensor, tail: Tensor | None = None) -> dict[str, Tensor]:
    """``[R, N - 1]`` tensors whose sums over each row's ``label_mask`` are the given per-row
    ``sums[k] [R]``: the sum sits at the row's first labelled position (differentiable), and for
    ``is_top1`` (a count) the row's first ``sums["is_top1"]`` labelled positions are ``True``. Zero
    (``False``) everywhere else, and on rows without labels. With ``tail [R, N - 1]`` (positions
    whose log-probabilities TRL sums apart: DPO's ``ld_alpha``), ``sums["log_probs"]`` is the sum
    over the labelled positions outside ``tail``, planted at the first of them, and
    ``sums["log_probs_tail"]`` the sum over the labelled ``tail``, planted at its first position."""
    mask = label_mask.bool()
    first = _first(mask)
    out = {k: v[:, None] * first.to(v.dtype) for k, v in sums.items() if k not in ("is_top1", "log_probs_tail")}
    if tail is not None:
        tail = tail.bool() & mask
        lp, lp_tail = sums["log_probs"], sums["log_probs_tail"]
        out["log_probs"] = lp[:, None] * _first(mask & ~tail).to(lp.dtype) + lp_tail[:, None] * _first(tail).to(
            lp.dtype
        )
    if "is_top1" in sums:
        count = sums["is_top1"].detach().round().long()
        out["is_top1"] = mask & (mask.long().cumsum(1) <= count[:, None])
    return out
