"""Image and video examples for the recipes: read, run through a processor, labelled, packed into rows
of ``seq_len`` tokens as documents, and collated into batches that ``hf_ring.shard_batch`` takes.

A data section with a ``processor`` reads image / video examples (docs/multimodal.md)::

    data:
      path: data/video.jsonl     # one example a line: {"text": ..., "images": [...], "videos": [...]}
      processor: Qwen/Qwen3.5-9B # a hub name or folder (AutoProcessor), or tiny-qwen-vl (built here)
      seq_len: 262144            # tokens per packed row
      visual_fraction: 0.9       # the share of visual tokens, for the planner only

An image or a video is a file path (``.png`` / ``.jpg`` ... read with PIL; ``.npy``: an array; any other
file, a video, is handed to the processor as its path) relative to the data file's folder, or an array
(``[H, W, 3]`` for an image, ``[T, H, W, 3]`` for a video, ``uint8``). The text holds the processor's
placeholders (``<|vision_start|><|image_pad|><|vision_end|>``, ``...<|video_pad|>...``) one per image or
video, in order. Labels are the input ids with every visual token (``mm_token_type_ids`` != 0) and the
vision start / end tokens set to -100. Examples are packed greedily, in order, into rows of ``seq_len``
tokens (``hf_ring.data.multimodal.pack_multimodal``: positions restart at every document; Qwen's
M-RoPE rows from the model's ``get_rope_index``), the rest of a row a padding document with labels
-100. An example longer than ``seq_len`` is refused.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from ..data.multimodal import PER_ITEM, pack_multimodal
from ..errors import RecipeError

__all__ = ["TINY_PROCESSOR", "TinyQwenVLProcessor", "build_processor", "collate_multimodal", "encode",
           "multimodal_dataset", "multimodal_rows"]

TINY_PROCESSOR = "tiny-qwen-vl"
SPECIAL = ("<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>")
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp")


class TinyQwenVLProcessor:
    """A processor in Qwen3-VL's conventions built offline (no hub, no torchvision), for CPU recipes and
    tests: ``tokenizer`` (word-level; the four ``SPECIAL`` tokens are added) and Qwen2-VL's image
    processor (PIL backend); a video ``[T, H, W, 3]`` is cut into ``temporal_patch_size`` frame groups
    laid out as Qwen's video processor lays them out, each group wrapped in its own vision start / end
    (Qwen3-VL's layout, without the timestamp text). Height and width must be multiples of
    ``patch_size * merge_size`` for videos."""

    def __init__(self, tokenizer: Any, patch_size: int = 2, merge_size: int = 2, temporal_patch_size: int = 2):
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        tokenizer.add_special_tokens({"additional_special_tokens": list(SPECIAL)})
        self.tokenizer = tokenizer
        self.image_processor = Qwen2VLImageProcessorPil(
            patch_size=patch_size, merge_size=merge_size, temporal_patch_size=temporal_patch_size,
            min_pixels=(patch_size * merge_size) ** 2, max_pixels=(patch_size * merge_size * 16) ** 2,
        )  # fmt: skip
        self.p, self.m, self.tp = patch_size, merge_size, temporal_patch_size
        ids = tokenizer.convert_tokens_to_ids(list(SPECIAL))
        self.image_token_id, self.video_token_id, self.vision_start_token_id, self.vision_end_token_id = ids

    def _video(self, frames: np.ndarray) -> tuple[np.ndarray, list[int]]:
        """``[T, H, W, 3]`` -> patches ``[t * h * w, 3 * tp * p * p]`` and the grid ``[t, h, w]``."""
        f = np.asarray(frames, dtype=np.float32)
        if f.ndim != 4 or f.shape[-1] != 3 or f.shape[1] % (self.p * self.m) or f.shape[2] % (self.p * self.m):
            raise ValueError(f"a video is [T, H, W, 3] with H and W multiples of {self.p * self.m}, not {f.shape}")
        if len(f) % self.tp:  # the last frame repeated, as Qwen's video processor does
            f = np.concatenate([f, np.repeat(f[-1:], self.tp - len(f) % self.tp, axis=0)])
        ip = self.image_processor
        f = (f / 255.0 - np.asarray(ip.image_mean)) / np.asarray(ip.image_std)
        t, h, w = len(f) // self.tp, f.shape[1] // self.p, f.shape[2] // self.p
        x = f.transpose(0, 3, 1, 2).reshape(t, self.tp, 3, h // self.m, self.m, self.p, w // self.m, self.m, self.p)
        x = x.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8).reshape(t * h * w, 3 * self.tp * self.p * self.p)
        return x.astype(np.float32), [t, h, w]

    def __call__(self, text: str, images: list | None = None, videos: list | None = None, **_: Any) -> dict:
        """One example -> ``input_ids`` / ``mm_token_type_ids`` ``[1, n]`` and its pixel tensors."""
        out: dict[str, Any] = {}
        image_tokens, video_frames = [], []
        if images:
            got = self.image_processor(images=list(images), return_tensors="pt")
            out["pixel_values"], out["image_grid_thw"] = got["pixel_values"], got["image_grid_thw"]
            image_tokens = [int(g.prod()) // self.m**2 for g in got["image_grid_thw"]]
        if videos:
            pieces = [self._video(v) for v in videos]
            out["pixel_values_videos"] = torch.from_numpy(np.concatenate([x for x, _ in pieces]))
            out["video_grid_thw"] = torch.tensor([g for _, g in pieces])
            video_frames = [(g[0], g[1] * g[2] // self.m**2) for _, g in pieces]
        ids, types = [], []
        raw = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        i = 0
        while i < len(raw):
            tok = raw[i]
            if tok == self.image_token_id:
                if not image_tokens:
                    raise ValueError("more image placeholders in the text than images")
                n = image_tokens.pop(0)
                ids += [tok] * n
                types += [1] * n
            elif tok == self.video_token_id:
                if not video_frames:
                    raise ValueError("more video placeholders in the text than videos")
                frames, n = video_frames.pop(0)
                if ids and ids[-1] == self.vision_start_token_id:  # each frame group gets its own start / end
                    ids.pop(), types.pop()
                if i + 1 < len(raw) and raw[i + 1] == self.vision_end_token_id:
                    i += 1
                for _ in range(frames):
                    ids += [self.vision_start_token_id, *[tok] * n, self.vision_end_token_id]
                    types += [0, *[2] * n, 0]
            else:
                ids.append(tok)
                types.append(0)
            i += 1
        if image_tokens or video_frames:
            raise ValueError("fewer placeholders in the text than images and videos")
        out["input_ids"] = torch.tensor([ids])
        out["mm_token_type_ids"] = torch.tensor([types])
        return out


def build_processor(ref: str, tokenizer_ref: str | None = None) -> Any:
    """The processor a data section names: ``tiny-qwen-vl`` (``TinyQwenVLProcessor`` over
    ``data.tokenizer``), else ``AutoProcessor.from_pretrained(ref)``; one that cannot be built is
    refused naming ``data.processor``."""
    try:
        if ref == TINY_PROCESSOR:
            if tokenizer_ref is None:
                raise ValueError("tiny-qwen-vl needs data.tokenizer (a word-level tokenizer folder)")
            from transformers import AutoTokenizer

            return TinyQwenVLProcessor(AutoTokenizer.from_pretrained(tokenizer_ref))
        from transformers import AutoProcessor

        return AutoProcessor.from_pretrained(ref)
    except Exception as e:
        raise RecipeError(f"data.processor {ref!r}: no processor could be built ({type(e).__name__}: {e}); give the "
                          f"model's processor (a hub name or folder) or {TINY_PROCESSOR}") from e  # fmt: skip


def _visual(ref: Any, base: Path, what: str) -> Any:
    """An image or video given as a path (relative to ``base``) or as nested lists."""
    if isinstance(ref, str):
        p = Path(ref).expanduser()
        p = p if p.is_absolute() else base / p
        if not p.exists():
            raise RecipeError(f"{what}: no such file {str(p)!r} (paths are read from the data file's folder)")
        if p.suffix.lower() == ".npy":
            return np.load(p)
        if p.suffix.lower() in IMAGE_SUFFIXES:
            from PIL import Image

            with Image.open(p) as im:
                return np.asarray(im.convert("RGB"))
        return str(p)  # a video file: the processor loads it
    return np.asarray(ref, dtype=np.uint8)


def _labels(ex: dict[str, Any], processor: Any) -> torch.Tensor:
    ids = torch.as_tensor(ex["input_ids"]).reshape(-1)
    labels = ids.clone()
    types = ex.get("mm_token_type_ids")
    if types is not None:
        labels[torch.as_tensor(types).reshape(-1) != 0] = -100
    tok = getattr(processor, "tokenizer", processor)
    for name in ("image_token", "video_token", "vision_start_token", "vision_end_token"):
        special = getattr(processor, f"{name}_id", None) or getattr(tok, f"{name}_id", None)
        text = getattr(processor, name, None) or getattr(tok, name, None)
        if special is None and isinstance(text, str) and hasattr(tok, "convert_tokens_to_ids"):
            special = tok.convert_tokens_to_ids(text)  # a processor that names the token but not its id
        if isinstance(special, int) and special != getattr(tok, "unk_token_id", None):
            labels[ids == special] = -100
    return labels[None]


def encode(row: dict[str, Any], processor: Any, data: dict[str, Any], base: Path, index: int) -> dict[str, Any]:
    """One example through the processor, with its labels (visual tokens -100)."""
    text_field = data.get("text_field", "text")
    if not isinstance(row.get(text_field), str):
        raise RecipeError(f"data.path {data['path']!r}: example {index} has no text in field {text_field!r} "
                          f"(it has {sorted(row)}); set data.text_field")  # fmt: skip
    kinds = {}
    for kind in ("image", "video"):
        field = data.get(f"{kind}_field", f"{kind}s")
        given = row.get(field) or []
        given = given if isinstance(given, list) and (not given or not isinstance(given[0], (int, float))) else [given]
        kinds[kind] = [_visual(g, base, f"data.path example {index} {field}[{k}]") for k, g in enumerate(given)]
    try:
        out = processor(text=row[text_field], images=kinds["image"] or None, videos=kinds["video"] or None,
                        return_tensors="pt", return_mm_token_type_ids=True)  # fmt: skip
    except Exception as e:
        raise RecipeError(f"data.path {data['path']!r}: example {index}: the processor refused it "
                          f"({type(e).__name__}: {e})") from e  # fmt: skip
    ex = {k: v for k, v in dict(out).items() if k in ("input_ids", "mm_token_type_ids", *PER_ITEM)}
    ex["labels"] = _labels(ex, processor)
    return ex


def _pad_document(n: int, pad_id: int) -> dict[str, torch.Tensor]:
    return {"input_ids": torch.full((1, n), pad_id), "labels": torch.full((1, n), -100),
            "mm_token_type_ids": torch.zeros(1, n, dtype=torch.long)}  # fmt: skip


def multimodal_rows(examples: list[dict[str, Any]], seq_len: int, pad_id: int = 0, rope_model: Any = None
                    ) -> list[dict[str, torch.Tensor]]:  # fmt: skip
    """Encoded examples (``encode``) packed greedily, in order, into rows of exactly ``seq_len`` tokens
    (``pack_multimodal``; a padding document fills each row). An example longer than ``seq_len`` is
    refused."""
    rows, current, used = [], [], 0
    for i, ex in enumerate(examples):
        n = ex["input_ids"].shape[-1]
        if n > seq_len:
            raise RecipeError(f"data: example {i} has {n} tokens (its images and videos included), more than "
                              f"data.seq_len={seq_len}; raise data.seq_len, or give fewer or smaller "
                              "frames")  # fmt: skip
        if used + n > seq_len:
            rows.append(current)
            current, used = [], 0
        current.append(ex)
        used += n
    rows.append(current)
    out = []
    for docs in rows:
        free = seq_len - sum(d["input_ids"].shape[-1] for d in docs)
        if free:
            docs = [*docs, _pad_document(free, pad_id)]
        out.append(pack_multimodal(docs, rope_model=rope_model))
    return out


class _Rows(Dataset):
    def __init__(self, rows: list[dict[str, torch.Tensor]]) -> None:
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return self.rows[i]


def multimodal_dataset(ds: Any, data: dict[str, Any], processor: Any, seq_len: int, rope_model: Any = None) -> Dataset:
    """The packed rows of a data section's examples (``ds``: a ``datasets.Dataset``), in memory."""
    base = Path(data["path"]).parent if Path(data["path"]).exists() else Path.cwd()
    examples = [encode(row, processor, data, base, i) for i, row in enumerate(ds)]
    tok = getattr(processor, "tokenizer", processor)
    pad = data.get("pad_id", getattr(tok, "pad_token_id", None) or 0)
    return _Rows(multimodal_rows(examples, seq_len, pad, rope_model))


def collate_multimodal(samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Packed rows (each ``[1, seq_len]`` per token) -> one batch ``[B, seq_len]``: images and videos
    concatenated in row order (the order the model merges them in), ``position_ids`` ``[B, N]`` or
    ``[4, B, N]``."""
    out: dict[str, torch.Tensor] = {}
    keys = dict.fromkeys(k for s in samples for k in s)  # a row may hold images and no video, or none
    for key in keys:
        if key in PER_ITEM:
            out[key] = torch.cat([s[key] for s in samples if key in s])
            continue
        if any(key not in s for s in samples):
            raise ValueError(f"collate_multimodal: {key!r} is in some rows and not in others")
        parts = [s[key] for s in samples]
        out[key] = torch.cat(parts, dim=1) if key == "position_ids" and parts[0].dim() == 3 else torch.cat(parts)
    return out
