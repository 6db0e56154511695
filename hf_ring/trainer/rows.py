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

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["pack_rows", "plant_row_sums"]


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
