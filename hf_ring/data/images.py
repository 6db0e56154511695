"""Image and video examples packed into one row of documents, for ``shard_batch`` (docs/multimodal.md).

``pack_multimodal(examples)``: each example is one document as a processor returns it, with its
labels -- per-token ``input_ids``, ``labels``, ``mm_token_type_ids`` / ``token_type_ids`` (``[n]`` or
``[1, n]``), and its images and videos (``pixel_values``, ``image_grid_thw``, ``pixel_values_videos``,
``video_grid_thw``, ... concatenated along their first dimension, in document order, which is the order
in which the model merges them). The row's ``position_ids`` restart at 0 at every document, so that
``shard_batch`` keeps every token to its own document; with ``rope_model`` (a Qwen VL model) they are
``[4, 1, N]``: the text row, then each document's own M-RoPE rows from the model's ``get_rope_index``.
Torch only.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

__all__ = ["pack_multimodal"]

PER_TOKEN = ("input_ids", "labels", "mm_token_type_ids", "token_type_ids")
PER_ITEM = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw", "image_sizes")


def pack_multimodal(examples: list[dict[str, Any]], rope_model: Any = None) -> dict[str, Tensor]:
    """One packed row ``[1, N]`` of the documents ``examples`` (see the module docstring).

    Raises ``ValueError`` for an example without ``input_ids`` and ``labels``, or with a key this does not
    know how to pack (say, an ``attention_mask`` with padding: pack unpadded documents)."""
    if not examples:
        raise ValueError("pack_multimodal: no examples")
    tokens: dict[str, list[Tensor]] = {}
    items: dict[str, list[Tensor]] = {}
    positions, rope = [], []
    for i, ex in enumerate(examples):
        if "input_ids" not in ex or "labels" not in ex:
            raise ValueError(f"pack_multimodal: example {i} needs input_ids and labels")
        mask = ex.get("attention_mask")
        if mask is not None and not bool(torch.as_tensor(mask).all()):
            raise ValueError(f"pack_multimodal: example {i} has padding; pack unpadded documents")
        unknown = set(ex) - {*PER_TOKEN, *PER_ITEM, "attention_mask"}
        if unknown:
            raise ValueError(f"pack_multimodal: example {i} has {sorted(unknown)}, which it does not know how to pack")
        row = {k: torch.as_tensor(ex[k]).reshape(-1) for k in PER_TOKEN if k in ex}
        n = row["input_ids"].numel()
        for k, v in row.items():
            tokens.setdefault(k, []).append(v)
        for k in PER_ITEM:
            if ex.get(k) is not None:
                items.setdefault(k, []).append(torch.as_tensor(ex[k]))
        positions.append(torch.arange(n))
        if rope_model is not None:
            rope.append(_rope(rope_model, row, ex))
    if any(len(v) != len(examples) for v in tokens.values()):
        raise ValueError("pack_multimodal: every example needs the same per-token keys")
    out = {k: torch.cat(v)[None] for k, v in tokens.items()}
    out |= {k: torch.cat(v) for k, v in items.items()}
    text = torch.cat(positions)[None]
    out["position_ids"] = torch.cat((text[None], torch.cat(rope, dim=2)), dim=0) if rope else text
    return out


def _rope(model: Any, row: dict[str, Tensor], ex: dict[str, Any]) -> Tensor:
    """``[3, 1, n]``: one document's M-RoPE positions from the model's ``get_rope_index``."""
    index = getattr(model, "get_rope_index", None) or model.model.get_rope_index
    types = row.get("mm_token_type_ids")
    if types is None:
        raise ValueError("pack_multimodal: M-RoPE positions need mm_token_type_ids")
    grids = {k: ex.get(k) for k in ("image_grid_thw", "video_grid_thw")}
    return index(row["input_ids"][None], mm_token_type_ids=types[None], **grids)[0]
