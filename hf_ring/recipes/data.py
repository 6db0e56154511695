"""Training data for the recipes: documents through the ``datasets`` library, packed into windows of
``seq_len`` tokens; the passkey task; a length curriculum.

A recipe's ``data`` section is either the passkey task::

    data: {task: passkey, stages: [{seq_len: 2048, steps: 40}, {seq_len: 8192, steps: 40}],
           eval: {seq_len: 8192, samples: 32}}

or documents::

    data:
      path: data/long.jsonl   # json/jsonl/parquet/arrow/csv/txt file, glob or folder of them, a folder
                              # written by Dataset.save_to_disk, or a dataset name on the hub
      split: train
      text_field: text        # tokenised with `tokenizer` (default: the model's) through map(num_proc),
                              # cached by datasets; or pre-tokenised ids in `ids_field` (input_ids)
      seq_len: 131072         # or stages: [{seq_len, steps}, ...]
      boundaries: pad         # pad | concatenate | documents (see pack)

Everything is built once, before training, into memory-mapped Arrow files (datasets' cache), and
read row by row while training. ``StagedDataset`` lays the stages out along the optimizer steps: it
is read in order (the runner sets ``train_sampling_strategy="sequential"``), each stage draws its own
seeded permutation of its windows, and sample ``i`` is a pure function of ``i``, so a resumed run
sees exactly the batches of an uninterrupted one.
"""

from __future__ import annotations

import glob
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from ..data.passkey import PasskeyDataset
from ..errors import RecipeError
from .sections import BOUNDARIES, PATH_RULE, looks_local, resolve_data

__all__ = ["BOUNDARIES", "StagedDataset", "collate", "load_documents", "pack", "stages_of", "tokenize"]

_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".arrow": "arrow", ".csv": "csv",
             ".txt": "text", ".text": "text"}  # fmt: skip


def stages_of(data: dict[str, Any], trainer: str = "sft") -> list[dict[str, int]]:
    """The ``[{seq_len, steps}]`` stages of a data section (``seq_len`` alone: one stage, steps 0 =
    as many as ``max_steps``), the section checked by ``sections.resolve_data`` (for ``trainer``)."""
    return resolve_data(data, trainer)["stages"]


# --- documents -----------------------------------------------------------------------------------


def load_documents(data: dict[str, Any]) -> Any:
    """The documents a data section names, as a ``datasets.Dataset`` (memory-mapped): ``path`` is a
    ``save_to_disk`` folder (``split`` picks from a ``DatasetDict``), a file, a glob or a folder of
    json/jsonl/parquet/arrow/csv/txt files (cached as Arrow by ``load_dataset``), or else a hub
    dataset (``name``: its configuration, ``split``)."""
    import datasets

    source = data.get("path")
    if source is None:
        raise RecipeError("data: give path (local files, a save_to_disk folder, or a hub dataset name)")
    split = data.get("split", "train")
    p = Path(source)
    if p.is_dir() and ((p / "dataset_info.json").exists() or (p / "dataset_dict.json").exists()):
        ds = datasets.load_from_disk(str(p))
        return ds[split] if isinstance(ds, datasets.DatasetDict) else ds
    if any(c in str(source) for c in "*?["):  # a glob: data/part-*.jsonl
        files = sorted(Path(f) for f in glob.glob(str(source)))
        if not files:
            raise RecipeError(f"data.path {source!r}: no file matches this pattern; fix the pattern or the folder")
    else:
        files = sorted(f for f in p.iterdir() if f.suffix in _BUILDERS) if p.is_dir() else [p]
    if p.exists() or files != [p]:
        kinds = {_BUILDERS.get(f.suffix) for f in files}
        if not files or len(kinds) != 1 or None in kinds:
            raise RecipeError(f"data.path {source!r}: expected files ending in {sorted(_BUILDERS)} (one kind)")
        empty = [str(f) for f in files if f.stat().st_size == 0]
        if empty:
            raise RecipeError(f"data.path {source!r}: {empty} empty: give files with documents, or leave them out")
        try:
            ds = datasets.load_dataset(kinds.pop(), data_files=[str(f) for f in files], split="train")
        except Exception as e:  # datasets' own errors name neither the recipe field nor, often, the file
            cause = e.__cause__ or e
            raise RecipeError(
                f"data.path {source!r}: could not read {[f.name for f in files][:5]} "
                f"({type(cause).__name__}: {cause}); check that the files are well-formed"
            ) from e
        if len(ds) == 0:
            raise RecipeError(f"data.path {source!r}: no documents in {[f.name for f in files][:5]}")
        return ds
    if looks_local(str(source)):  # a path, never a hub name: no hub lookup
        raise RecipeError(f"data.path {source!r}: no such file or folder ({PATH_RULE}: {Path.cwd()}); fix the path")
    try:
        return datasets.load_dataset(str(source), data.get("name"), split=split)  # a hub dataset
    except Exception as e:  # not found, unreachable, ...: name the field whatever datasets says
        raise RecipeError(
            f"data.path {source!r}: not a file or folder here ({p.absolute()}) and no hub dataset that loads "
            f"({type(e).__name__}: {e}); fix the path, or give a hub dataset name (org/name) with network access"
        ) from e


def _tokenize_batch(batch: dict[str, list], *, tokenizer: Any, field: str, eos: int | None) -> dict[str, list]:
    ids = tokenizer(batch[field], add_special_tokens=True)["input_ids"]
    return {"input_ids": [x + [eos] if eos is not None else x for x in ids]}


def tokenize(ds: Any, data: dict[str, Any], tokenizer: Any = None) -> Any:
    """Documents -> a dataset with one ``input_ids`` column: the ids of ``ids_field`` (default
    ``input_ids``) as they are, else ``text_field`` (default ``text``) through ``tokenizer`` with
    ``map(batched, num_proc)`` (cached), an EOS token appended unless ``add_eos: false``."""
    ids_field = data.get("ids_field", "input_ids")
    if ids_field in ds.column_names:
        ds = ds.select_columns([ids_field])
        return ds.rename_column(ids_field, "input_ids") if ids_field != "input_ids" else ds
    field = data.get("text_field", "text")
    if field not in ds.column_names:
        raise RecipeError(f"data: no column {ids_field!r} or {field!r} in {ds.column_names}: set ids_field/text_field")
    if tokenizer is None:
        raise RecipeError("data: a text column needs a tokenizer (data.tokenizer, or a model with name_or_path)")
    eos = tokenizer.eos_token_id if data.get("add_eos", True) else None
    fn = partial(_tokenize_batch, tokenizer=tokenizer, field=field, eos=eos)
    return ds.map(fn, batched=True, num_proc=data.get("num_proc"), remove_columns=ds.column_names, desc="tokenize")


def _check_ids(docs: list[np.ndarray], indices: list[int], vocab_size: int | None) -> None:
    """Refuse token ids outside ``[0, vocab_size)``, naming the first document that holds one."""
    if vocab_size is None:
        return
    for d, i in zip(docs, indices):
        if len(d) and (d.min() < 0 or d.max() >= vocab_size):
            bad = int(d[(d < 0) | (d >= vocab_size)][0])
            raise RecipeError(
                f"data: document {i} holds token id {bad}, outside the model's vocabulary [0, {vocab_size}) "
                "(vocab_size of its config): tokenise with the model's tokenizer (data.tokenizer), or give a "
                "model whose vocab_size covers the ids (model.overrides.vocab_size)"
            )


def _pack_batch(
    batch: dict[str, list], indices: list[int], *, seq_len: int, boundaries: str, pad_id: int, vocab_size: int | None
) -> dict[str, Any]:
    docs = [np.asarray(d, dtype=np.int64) for d in batch["input_ids"]]
    _check_ids(docs, indices, vocab_size)
    if boundaries == "pad":  # each document alone: cut into windows, the last one right-padded
        ids, mask = [], []
        for d in docs:
            for s in range(0, len(d), seq_len):
                piece = d[s : s + seq_len]
                if len(piece) < 2:  # no next-token target
                    continue
                ids.append(np.pad(piece, (0, seq_len - len(piece)), constant_values=pad_id))
                mask.append((np.arange(seq_len) < len(piece)).astype(np.int8))
        return {"input_ids": ids, "attention_mask": mask}
    flat = np.concatenate(docs) if docs else np.zeros(0, np.int64)
    n = len(flat) // seq_len  # the tail of this map batch is dropped (less than one window)
    out: dict[str, Any] = {"input_ids": flat[: n * seq_len].reshape(n, seq_len)}
    if boundaries == "documents" and n == 0:
        out["position_ids"] = out["input_ids"]
    elif boundaries == "documents":  # positions restart at every document and every window
        starts = np.zeros(len(flat), dtype=bool)
        starts[np.cumsum([0] + [len(d) for d in docs[:-1]])] = True
        starts[::seq_len] = True
        idx = np.arange(len(flat))
        out["position_ids"] = (idx - np.maximum.accumulate(np.where(starts, idx, 0)))[: n * seq_len].reshape(n, seq_len)
    return out


def pack(
    ds: Any,
    seq_len: int,
    boundaries: str = "pad",
    *,
    pad_id: int = 0,
    num_proc: int | None = None,
    vocab_size: int | None = None,
) -> Any:
    """Tokenised documents -> windows of ``seq_len`` tokens (``int32`` Arrow columns, cached).

    ``boundaries``:
      * ``pad``: every document on its own (cut into windows when longer), the last window
        right-padded with ``pad_id`` and an ``attention_mask``: exact, costs the padding;
      * ``concatenate``: documents joined into one stream and cut into windows, positions
        ``0..seq_len-1``: tokens attend across document boundaries (add EOS between documents);
      * ``documents``: the same windows with ``position_ids`` restarting at every document
        (transformers' convention for packed documents): exact, no padding, each token attends
        only within its document (``hf_ring.shard_batch`` keeps them apart).

    ``vocab_size`` (the model config's): a token id outside ``[0, vocab_size)`` is refused while the
    windows are built (and cached: a cached pack was checked when it was built).
    """
    from datasets import Features, Sequence, Value

    if boundaries not in BOUNDARIES:
        raise RecipeError(f"data.boundaries: one of {BOUNDARIES}, not {boundaries!r}")
    if vocab_size is not None and not 0 <= pad_id < vocab_size:
        raise RecipeError(f"data.pad_id {pad_id} is outside the model's vocabulary [0, {vocab_size}): set data.pad_id")
    cols = {"input_ids": Sequence(Value("int32"), length=seq_len)}
    if boundaries == "pad":
        cols["attention_mask"] = Sequence(Value("int8"), length=seq_len)
    if boundaries == "documents":
        cols["position_ids"] = Sequence(Value("int32"), length=seq_len)
    fn = partial(_pack_batch, seq_len=seq_len, boundaries=boundaries, pad_id=pad_id, vocab_size=vocab_size)
    packed = ds.map(fn, with_indices=True, batched=True, batch_size=1000, num_proc=num_proc,
                    remove_columns=ds.column_names, features=Features(cols), desc=f"pack {seq_len}")  # fmt: skip
    if len(packed) == 0:
        raise RecipeError(f"data: no window of {seq_len} tokens could be made (documents too short for concatenate?)")
    return packed.with_format("torch")


# --- curriculum ----------------------------------------------------------------------------------


class StagedDataset(Dataset):
    """Stages laid out along the optimizer steps, read in order.

    ``parts``: ``[(dataset, steps)]``; ``samples_per_step``: sequences of one optimizer step over all
    DP replicas (``per_device_train_batch_size * gradient_accumulation_steps * dp_size``);
    ``total_steps``: the run's ``max_steps`` (steps past the last stage stay in it). Sample ``i``
    belongs to step ``i // samples_per_step`` and so to one stage; within a stage, a seeded
    permutation of its dataset (``shuffle_seed``; ``None`` keeps its order).
    """

    def __init__(
        self, parts: list[tuple[Any, int]], samples_per_step: int, total_steps: int, shuffle_seed: int | None = 0
    ) -> None:
        self.parts = parts
        self.per_step = samples_per_step
        self.total = total_steps
        self.first_step = np.cumsum([0] + [steps for _, steps in parts[:-1]]).tolist()
        self.order = [
            None
            if shuffle_seed is None
            else torch.randperm(len(ds), generator=torch.Generator().manual_seed(shuffle_seed * 1000 + k))
            for k, (ds, _) in enumerate(parts)
        ]

    def __len__(self) -> int:
        return self.total * self.per_step

    def stage(self, step: int) -> int:
        """The stage of optimizer step ``step`` (from 0)."""
        k = 0
        while k + 1 < len(self.parts) and step >= self.first_step[k + 1]:
            k += 1
        return k

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        k = self.stage(i // self.per_step)
        ds, order = self.parts[k][0], self.order[k]
        j = (i - self.first_step[k] * self.per_step) % len(ds)
        return ds[int(order[j]) if order is not None else j]


def collate(samples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """Stack samples; integer columns as int64; ``labels`` = ``input_ids`` when the samples have none
    (the loss shifts them once, on the full sequence; padding is masked by ``attention_mask``)."""
    out: dict[str, torch.Tensor] = {}
    for key in samples[0]:
        t = torch.stack([torch.as_tensor(s[key]) for s in samples])
        out[key] = t.long() if not t.is_floating_point() else t
    if "labels" not in out:
        out["labels"] = out["input_ids"].clone()
    return out


def passkey_stage(seq_len: int, seed: int, stage: int) -> PasskeyDataset:
    """The passkey data of one stage (a fresh seed per stage; evaluation uses stage 50)."""
    return PasskeyDataset(seq_len=seq_len, seed=seed * 100 + stage)
