"""hf_ring's RULER against lm-evaluation-harness's (a harness no one here wrote), at a length that fits one
process: on the same tiny model and lm-eval's own samples, hf_ring's greedy decoding under CP = 2 gives
the same outputs as lm-eval's ``model.generate``, and hf_ring's scorer the same scores; and the scorer
agrees with lm-eval's ``process_results`` on outputs that hold all, some or none of the answers.

Needs the ``ruler`` extra (``pip install -e .[ruler]``: lm-eval with wonderwords and nltk); skipped
without it. Runs offline: lm-eval builds its samples with a local tokenizer (``max_seq_lengths``
metadata); the tasks that need a download (the essay haystack, QA) are left out."""

from __future__ import annotations

import os

import pytest

lm_eval = pytest.importorskip("lm_eval")
pytest.importorskip("wonderwords")

from hf_ring.evaluation.ruler_tasks import ruler_score  # noqa: E402
from testkit.ruler_harness import OFFLINE_TASKS, hf_ring_outputs, lm_eval_samples, tiny_text_model  # noqa: E402
from testkit.spawn import run_ranks  # noqa: E402

LENGTH, LIMIT = 2048, 2


def test_scores_equal_lm_eval_process_results():
    from lm_eval.tasks.ruler import common_utils

    cases = [
        (" The numbers are 1234567 and 7654321.", ["1234567", "7654321"]),
        ("  one 1234567\x1b\n", ["1234567", "7654321", "1111111"]),
        ("nothing here", ["1234567"]),
        ("ANSWER: Mild-Apple", ["mild-apple"]),
        ("", ["x"]),
    ]
    for output, answers in cases:
        theirs = common_utils.process_results({"max_length": 4096, "outputs": answers}, [output])["4096"]
        assert ruler_score(output, answers) == pytest.approx(theirs)


@pytest.fixture(scope="module")
def compared(tmp_path_factory):
    model = tiny_text_model(tmp_path_factory.mktemp("model"))
    rows = lm_eval_samples(model, list(OFFLINE_TASKS), LENGTH, LIMIT)
    ours = run_ranks(2, hf_ring_outputs, model, rows, timeout=500)
    return rows, ours


@pytest.mark.timeout(900)
def test_cp_decoding_and_scores_equal_lm_eval(compared):
    rows, ours = compared
    assert {r["task"] for r in rows} == set(OFFLINE_TASKS) and len(rows) == LIMIT * len(OFFLINE_TASKS)
    for rank in ours:
        assert rank == ours[0]  # every rank of the CP group decodes the same text
    for r, o in zip(rows, ours[0]):
        assert o["prompt_tokens"] + r["max_gen"] <= LENGTH + 1, r["task"]
        assert o["output"] == r["output"], (r["task"], r["index"], o["output"], r["output"])
        assert o["score"] == pytest.approx(r["score"]), (r["task"], r["index"])
    if os.environ.get("HF_RING_RULER_RESULTS"):  # the results file of docs/evaluation.md's table
        import json
        from importlib.metadata import version

        from hf_ring.evaluation.runtime import machine_info

        data = {"lm_eval": version("lm_eval"), "length": LENGTH, "cp_size": 2, "machine": machine_info(),
                "samples": [{**r, "hf_ring_output": o["output"], "hf_ring_score": o["score"]}
                            for r, o in zip(rows, ours[0])]}  # fmt: skip
        with open(os.environ["HF_RING_RULER_RESULTS"], "w") as f:
            json.dump(data, f, indent=1)
