"""Recipe data through the ``datasets`` library (``hf_ring.recipes.data``): local files, folders and
``save_to_disk`` datasets; text tokenised with ``map`` (cached) or pre-tokenised ids; packing into
``seq_len`` windows with document boundaries padded, concatenated, or kept as restarting
``position_ids`` (packed documents, which ``shard_batch`` keeps apart); everything in
memory-mapped Arrow files built once; a length curriculum laid out along the optimizer steps."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import hf_ring
from hf_ring.data.passkey import PasskeyDataset
from hf_ring.recipes.data import StagedDataset, collate, load_documents, pack, stages_of, tokenize

DOCS = [list(range(10, 15)), list(range(20, 29)), [30, 31, 32], list(range(40, 60))]  # 5, 9, 3, 20 tokens


def _col(ds, name: str) -> list:
    """A column as lists (datasets 5 returns lazy columns; the torch format gives tensors)."""
    values = ds[:][name]
    return values.tolist() if torch.is_tensor(values) else [list(v) for v in values]


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture
def docs(tmp_path: Path):
    src = _jsonl(tmp_path / "docs.jsonl", [{"input_ids": d} for d in DOCS])
    return tokenize(load_documents({"path": str(src)}), {})


def test_concatenate_joins_documents_into_windows(docs) -> None:
    ds = pack(docs, 8, "concatenate")
    flat = [t for d in DOCS for t in d]
    assert len(ds) == len(flat) // 8 and ds.column_names == ["input_ids"]
    assert ds.features["input_ids"].feature.dtype == "int32"
    assert [t for row in _col(ds, "input_ids") for t in row] == flat[: len(ds) * 8]
    assert ds.cache_files, "the packed windows live in a memory-mapped Arrow file"


def test_pad_keeps_each_document_alone(docs) -> None:
    ds = pack(docs, 8, "pad", pad_id=0)
    ids, mask = _col(ds, "input_ids"), _col(ds, "attention_mask")
    # 5 -> one window; 9 -> 8 (+1 token: no target, dropped); 3 -> one; 20 -> 8, 8, 4
    assert [sum(m) for m in mask] == [5, 8, 3, 8, 8, 4]
    assert ids[0] == DOCS[0] + [0, 0, 0] and ids[5] == DOCS[3][16:] + [0] * 4
    batch = collate([ds[0], ds[5]])
    assert batch["labels"].tolist() == batch["input_ids"].tolist() and batch["attention_mask"].dtype == torch.long
    kw = hf_ring.shard_batch(batch)  # exact: the padding has no targets
    assert kw["num_items_in_batch"].item() == 4 + 3


def test_documents_keeps_boundaries_for_shard_batch(docs) -> None:
    ds = pack(docs, 8, "documents")
    pos = _col(ds, "position_ids")
    assert pos[0] == [0, 1, 2, 3, 4, 0, 1, 2]  # doc 0, then doc 1 starts
    assert pos[1] == [0, 1, 2, 3, 4, 5, 0, 1]  # doc 1 goes on (positions restart at the window), doc 2 starts
    assert hf_ring.shard_batch(collate([ds[0]]))["ring_context"].schedule is not None  # packed documents
    with pytest.raises(ValueError, match="one of"):
        pack(docs, 8, "ignore")


def test_text_is_tokenised_with_map_and_cached(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2, **{f"w{i}": i + 3 for i in range(60)}}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="</s>", pad_token="<pad>", unk_token="<unk>")
    fast.save_pretrained(tmp_path / "tok")
    tok = AutoTokenizer.from_pretrained(tmp_path / "tok")
    src = _jsonl(tmp_path / "text.jsonl", [{"text": "w1 w2 w3", "meta": 1}, {"text": "w7 w8", "meta": 2}])
    spec = {"path": str(src), "text_field": "text", "num_proc": 2}
    first = tokenize(load_documents(spec), spec, tok)
    assert _col(first, "input_ids") == [[4, 5, 6, 1], [10, 11, 1]] and first.column_names == ["input_ids"]
    again = tokenize(load_documents(spec), spec, tok)
    assert again.cache_files == first.cache_files  # tokenised once: the second map reads the cache
    no_eos = tokenize(load_documents(spec), {**spec, "add_eos": False}, tok)
    assert _col(no_eos, "input_ids") == [[4, 5, 6], [10, 11]]
    with pytest.raises(ValueError, match="tokenizer"):
        tokenize(load_documents(spec), spec, None)


def test_sources_files_folders_and_save_to_disk(tmp_path: Path) -> None:
    import datasets

    rows = [{"input_ids": d} for d in DOCS]
    want = [d for d in DOCS]
    folder = tmp_path / "parts"
    folder.mkdir()
    _jsonl(folder / "a.jsonl", rows[:2])
    _jsonl(folder / "b.jsonl", rows[2:])
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "docs.parquet"))
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))
    for path in (folder, folder / "*.jsonl", tmp_path / "docs.parquet", tmp_path / "saved"):
        got = _col(tokenize(load_documents({"path": str(path)}), {}), "input_ids")
        assert got == want, path
    with pytest.raises(ValueError, match="one kind"):
        (folder / "c.parquet").write_bytes((tmp_path / "docs.parquet").read_bytes())
        load_documents({"path": str(folder)})


def test_staged_dataset_lays_stages_along_the_steps() -> None:
    per_step = 4
    parts = [(PasskeyDataset(seq_len=24, seed=0), 2), (PasskeyDataset(seq_len=40, seed=1), 2)]
    ds = StagedDataset(parts, per_step, total_steps=5, shuffle_seed=None)
    assert len(ds) == 5 * per_step
    lengths = [ds[i]["input_ids"].shape[0] for i in range(len(ds))]
    assert lengths == [24] * 8 + [40] * 12  # step 5 stays in the last stage
    assert torch.equal(ds[8]["input_ids"], parts[1][0][0]["input_ids"])  # stage 2 starts at its own sample 0
    shuffled = StagedDataset(parts, per_step, total_steps=4, shuffle_seed=3)
    again = StagedDataset(parts, per_step, total_steps=4, shuffle_seed=3)
    assert all(torch.equal(shuffled[i]["input_ids"], again[i]["input_ids"]) for i in range(16))  # a pure function of i
    assert stages_of({"task": "passkey", "seq_len": 128}) == [{"seq_len": 128, "steps": 0}]
    with pytest.raises(ValueError, match="seq_len"):
        stages_of({"path": "x"})
