"""``hf-ring eval ruler``: the task generators against RULER's definitions (exact lengths, answers in the
prompt, each task's structure, reproducible seeds), RULER's scoring, and the command end to end in one
process, at CP = 2 and at DP 2 x CP 2 (the same records)."""

from __future__ import annotations

import argparse
import json
import re
import uuid

import pytest
from transformers import AutoTokenizer

from hf_ring.evaluation.ruler import PasskeyTask
from hf_ring.evaluation.ruler_tasks import NOISE, TASKS, TaskGenerator, ruler_score, string_match_all
from hf_ring.evaluation.runtime import EvalError
from testkit.spawn import run_ranks
from testkit.tokenizers import tiny_tokenizer_dir

SYNTHETIC = [t for t in TASKS if not t.startswith("qa")]


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(tiny_tokenizer_dir())


def _context(s) -> str:
    return s.text


@pytest.mark.parametrize("task", SYNTHETIC)
def test_lengths_exact_answers_present_seeds_reproducible(tok, task):
    gen = TaskGenerator(task, tok, seed=3)
    for length in (2048, 3000, 4096):
        for i in range(2):
            s = gen.make(length, i)
            assert len(s.ids) == length - TASKS[task].tokens_to_generate
            assert s.ids[0] == tok.bos_token_id
            assert s.answers and all(a in s.text for a in s.answers), (s.answers, s.text[-300:])
            assert s.ids == TaskGenerator(task, tok, seed=3).make(length, i).ids  # a fresh generator: the same
    assert gen.make(2048, 0).ids != gen.make(2048, 1).ids
    assert gen.make(2048, 0).ids != TaskGenerator(task, tok, seed=4).make(2048, 0).ids


def test_niah_definitions(tok):
    s = TaskGenerator("niah_single_1", tok).make(2048, 0)
    (value,) = s.answers
    assert re.fullmatch(r"\d{7}", value)
    key = re.search(rf"One of the special magic numbers for (\S+) is: {value}\.", s.text).group(1)
    assert s.text.count("One of the special magic numbers") == 1
    assert s.text.startswith("A special magic number is hidden within the following text.")
    assert s.text.endswith(f"The special magic number for {key} mentioned in the provided text is")
    assert NOISE in s.text
    s = TaskGenerator("niah_single_3", tok).make(2048, 0)
    uuid.UUID(s.answers[0])
    s = TaskGenerator("niah_multikey_1", tok).make(2048, 0)
    assert s.text.count("One of the special magic numbers for") == 4 and len(s.answers) == 1
    s = TaskGenerator("niah_multikey_2", tok).make(2048, 0)
    lines = s.text.split("\n")[1:-1]
    assert all(line.startswith("One of the special magic numbers for") for line in lines if line.strip())
    s = TaskGenerator("niah_multikey_3", tok).make(2048, 0)
    uuid.UUID(s.answers[0])
    assert re.search(r"for [0-9a-f-]{36} is: " + s.answers[0], s.text)
    s = TaskGenerator("niah_multivalue", tok).make(2048, 0)
    assert len(s.answers) == 4 and s.text.endswith("mentioned in the provided text are")
    key = re.search(rf"for (\S+) is: {s.answers[0]}\.", s.text).group(1)
    assert all(f"for {key} is: {v}." in s.text for v in s.answers)
    s = TaskGenerator("niah_multiquery", tok).make(2048, 0)
    assert len(s.answers) == 4 and ", and " in s.text.rsplit("\n", 1)[-1]


def test_essay_haystack_file(tok, tmp_path):
    essay = tmp_path / "essay.txt"
    essay.write_text("Rivers carve valleys over long ages. Wind shapes the dunes! Do stones remember? " * 50)
    gen = TaskGenerator("niah_single_2", tok, haystack_file=str(essay))
    s = gen.make(2048, 0)
    assert gen.haystack == "essay" and "Rivers carve valleys" in s.text and NOISE not in s.text.split("\n")[1]
    assert len(s.ids) == 2048 - 128
    assert TaskGenerator("niah_single_2", tok).haystack == "noise (no haystack file)"


def test_vt_definition(tok):
    s = TaskGenerator("vt", tok).make(2048, 0)
    assert len(s.answers) == 5 and all(re.fullmatch(r"[A-Z]{5}", v) for v in s.answers)
    value = re.search(rf"VAR {s.answers[0]} = (\d{{5}})", s.text).group(1)
    for a, b in zip(s.answers, s.answers[1:]):
        assert f"VAR {b} = VAR {a}" in s.text
    assert s.text.endswith(f"5 variables are assigned the value {value}, they are: ")
    assert s.text.count("Memorize and track the chain(s)") == 2  # the worked example, then the task


def test_cwe_definition(tok):
    for length, (common, rare) in ((2048, (6, 1)), (4096, (30, 3))):
        s = TaskGenerator("cwe", tok).make(length, 0)
        listed = s.text.rsplit("Below is a numbered list of words.", 1)[1].split("\nQuestion:")[0]
        words = re.findall(r"\d+\. (\S+)", listed)
        counts = {w: words.count(w) for w in set(words)}
        assert len(s.answers) == 10 and all(counts[a] == common for a in s.answers)
        assert all(c == rare for w, c in counts.items() if w not in s.answers)


def test_fwe_definition(tok):
    s = TaskGenerator("fwe", tok).make(4096, 0)
    coded = s.text.split("coded words. ", 1)[1].split("\nQuestion:")[0].split()
    coded = [w for w in coded if re.fullmatch(r"[a-z]{6}|\.\.\.", w)]
    ranked = sorted(set(coded), key=lambda w: -coded.count(w))
    assert ranked[0] == "..." and ranked[1:4] == s.answers


def test_qa_from_a_local_file_only(tok, tmp_path):
    with pytest.raises(EvalError, match="never fetches"):
        TaskGenerator("qa_1", tok)
    squad = {"data": [{"paragraphs": [
        {"context": f"Paragraph {i} says the colour of box {i} is {c}.", "qas": [
            {"question": f"What colour is box {i}?", "answers": [{"text": c}], "is_impossible": False}]}
        for i, c in enumerate(["red", "blue", "green", "amber", "teal", "plum"])]}]}  # fmt: skip
    path = tmp_path / "squad.json"
    path.write_text(json.dumps(squad))
    s = TaskGenerator("qa_1", tok, qa_file=str(path)).make(1024, 1)
    assert s.metric == "part" and s.answers == ["blue"] and "Document 1:" in s.text
    assert len(s.ids) == 1024 - 32 and s.text.endswith("Question: What colour is box 1? Answer:")


def test_too_short_refused(tok):
    with pytest.raises(EvalError, match="cannot hold"):
        TaskGenerator("cwe", tok).make(256, 0)


def test_scores():
    assert ruler_score("  The numbers are 123 and 456.\x07", ["123", "456", "789"]) == pytest.approx(2 / 3)
    assert ruler_score("ANSWER: Blue", ["blue", "navy"], "part") == 1.0
    assert ruler_score("", ["x"]) == 0.0
    assert string_match_all("abc", ["A", "b", "z", "C"]) == 0.75


def test_passkey_task():
    s = PasskeyTask().make(1024, 2)
    assert len(s.ids) == 1024 - 5 and re.fullmatch(r"\d{5}", s.answers[0])
    assert s.answers[0] in PasskeyTask.decode(s.ids)


def ruler_run(model_dir: str, out: str, tasks: str, cp: int | None = None) -> dict:
    from hf_ring.evaluation.commands import run_ruler

    a = argparse.Namespace(model=model_dir, adapter=None, out=out, tokenizer=None, dtype="float32", cp_size=cp,
                           lengths="1K", tasks=tasks, samples=2, seed=0, haystack=None, qa_file=None,
                           mode="auto")  # fmt: skip
    r = run_ruler(a)
    return {"records": r["records"], "summary": r["summary"]["table"]}


@pytest.mark.timeout(600)
def test_command_one_process_cp2_and_dp2_x_cp2(tmp_path):
    from testkit.ruler_harness import tiny_text_model

    model = tiny_text_model(tmp_path / "model")
    one = ruler_run(model, str(tmp_path / "one"), "vt,fwe")
    saved = json.loads((tmp_path / "one" / "ruler.json").read_text())
    assert set(saved) >= {"settings", "machine", "records", "summary", "kv_cache_bytes_per_rank"}
    assert len(saved["records"]) == 4
    for r in saved["records"]:
        assert {"task", "length", "sample", "output", "answers", "score"} <= set(r) and 0 <= r["score"] <= 1
        assert r["prompt_tokens"] + TASKS[r["task"]].tokens_to_generate == 1024
    two = run_ranks(2, ruler_run, model, str(tmp_path / "two"), "vt,fwe", timeout=500)
    strip = [{k: v for k, v in r.items() if k != "seconds"} for r in one["records"]]
    for rank in two:
        assert [{k: v for k, v in r.items() if k != "seconds"} for r in rank["records"]] == strip
    dp = run_ranks(4, ruler_run, model, str(tmp_path / "dp"), "vt,fwe", 2, timeout=500)  # DP 2 x CP 2
    for rank in dp:
        assert [{k: v for k, v in r.items() if k != "seconds"} for r in rank["records"]] == strip
