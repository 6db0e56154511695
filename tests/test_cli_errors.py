"""A user's mistake ends ``hf-ring`` with one line naming the field, the value and the fix, from one
process, and exit status 1; ``HF_RING_DEBUG=1`` shows the traceback instead (``hf_ring.errors``).

The commands that import no torch run in a fresh interpreter (``python -m hf_ring.cli``); the
training ones are called in this process (``main``, which raises the ``SystemExit`` it would exit
with), and one runs under ``torchrun`` on two processes: one line, from rank 0, and no hang.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import yaml

from hf_ring.cli import main
from hf_ring.data.passkey import VOCAB
from hf_ring.errors import USER_ERRORS, RecipeNotFound, UserError, closest, exit_for, is_user_error, one_line

ROOT = Path(__file__).resolve().parent.parent
TINY = {"model_type": "llama", "vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512}  # fmt: skip


def _cli(*argv: str, env: dict[str, str] | None = None, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hf_ring.cli", *argv], capture_output=True, text=True, timeout=240,
                          cwd=cwd, env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})})  # fmt: skip


def _one_line(out: subprocess.CompletedProcess, command: str) -> str:
    """The only line the command wrote to stderr (exit status 1, no traceback, no usage)."""
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert out.returncode == 1 and len(lines) == 1, out.stderr[-3000:]
    assert lines[0].startswith(f"{command}: ") and out.stdout == "", (out.stdout, out.stderr)
    return lines[0]


@pytest.mark.parametrize(
    ("argv", "command", "message"),
    [
        (["plan", "llama-3.1-8b-128"], "hf-ring plan", "MODEL 'llama-3.1-8b-128': no recipe, known model or "
         "config.json of that name (did you mean 'llama-3.1-8b-128k'?)"),
        (["plan", "Lama-3.1-8B", "--seq-len", "1M"], "hf-ring plan", "(did you mean 'Llama-3.1-8B'?)"),
        (["plan", "Llama-3.1-8B"], "hf-ring plan", "--seq-len: give the tokens per sequence to plan Llama-3.1-8B "
         "with (--seq-len 128K); only a recipe states its own"),
        (["plan", "Llama-3.1-8B", "--seq-len", "0"], "hf-ring plan", "argument --seq-len: 0: give a number >= 2"),
        (["plan", "Llama-3.1-8B", "--seq-len", "1M", "--gpus", "0"], "hf-ring plan", "--gpus: 0: give a number >= 1"),
        (["plan", "Llama-3.1-8B", "--seq-len", "1M", "--cp", "0"], "hf-ring plan", "--cp: 0: give a number >= 1"),
        (["plan", "Llama-3.1-8B", "--seq-len", "1M", "--gpus", "12", "--cp", "8"], "hf-ring plan",
         "cp=8 must divide the number of GPUs (12)"),
        (["plan", "Llama-3.1-8B", "--seq-lenn", "1M"], "hf-ring plan", "unrecognized arguments: --seq-lenn 1M (did "
         "you mean '--seq-len'?)"),
        (["plan", "Llama-3.1-8B", "--seq-len", "1M", "--mode", "ful"], "hf-ring plan", "(did you mean 'full'?)"),
        (["plann", "x"], "hf-ring", "invalid choice: 'plann' (choose from 'train', 'plan', 'eval') (did you mean "
         "'plan'?)"),
        (["train", "--config", "cpu4"], "hf-ring train", "no launch config 'cpu4' (did you mean 'cpu-4proc'?)"),
        (["plan", "tiny-cpu-demo", "--write", "--seq-len", "1K"], "hf-ring plan", None),  # a recipe: allowed
        (["plan", "Llama-3.1-8B", "--write", "--seq-len", "1K"], "hf-ring plan", "--write: MODEL 'Llama-3.1-8B' is "
         "not a recipe"),
    ],  # fmt: skip
    ids=["plan-recipe-typo", "plan-model-typo", "plan-no-seq-len", "seq-len-0", "gpus-0", "cp-0", "cp-not-dividing",
         "flag-typo", "choice-typo", "command-typo", "config-typo", "write-recipe", "write-model"],  # fmt: skip
)
def test_commands_without_torch_say_one_line(argv: list[str], command: str, message: str | None,
                                             tmp_path: Path) -> None:  # fmt: skip
    if message is None:  # --write on a copy of a recipe, which then plans: no error
        recipe = tmp_path / "tiny-cpu-demo-pretrain.yaml"
        recipe.write_text((ROOT / "hf_ring" / "recipes" / recipe.name).read_text())
        out = _cli("plan", str(recipe), "--write", cwd=tmp_path)
        assert out.returncode == 0 and "memory_gb: {gpus: 1" in out.stdout, out.stderr
        return
    assert message in _one_line(_cli(*argv), command)


def test_debug_shows_the_traceback() -> None:
    out = _cli("plan", "llama-3.1-8b-128", env={"HF_RING_DEBUG": "1"})
    assert out.returncode == 1 and "Traceback" in out.stderr and "hf_ring.errors.UserError: MODEL" in out.stderr


# --- hf-ring train -----------------------------------------------------------------------------------


def _recipe(tmp_path: Path, **fields: Any) -> Path:
    body = {"model": {"config": TINY}, "data": {"task": "passkey", "seq_len": 48}, "max_steps": 1,
            "save_strategy": "no", "report_to": "none", "disable_tqdm": True, "output_dir": str(tmp_path / "out"),
            **fields}  # fmt: skip
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(body))
    return path


def _train_fails(*argv: str) -> str:
    """``hf-ring train ...`` in this process: the one line it exits with."""
    with pytest.raises(SystemExit) as e:
        main(["train", *argv])
    assert isinstance(e.value.code, str) and "\n" not in e.value.code, e.value.code
    assert e.value.code.startswith("hf-ring train: ")
    return e.value.code


def test_missing_relative_data_path_is_named_before_any_hub_lookup(tmp_path: Path, monkeypatch) -> None:
    """The issue's newcomer: ``data.path: data/train.jsonl`` that does not exist was taken for a hub
    dataset (retries, then a ConnectionError); now the path is refused by name, no hub call made."""
    import datasets

    def no_hub(*args: Any, **kwargs: Any) -> None:
        raise AssertionError(f"a hub lookup was made: load_dataset{args}")

    monkeypatch.setattr(datasets, "load_dataset", no_hub)
    recipe = _recipe(tmp_path, data={"path": "data/train.jsonl", "seq_len": 48})
    monkeypatch.chdir(tmp_path)
    line = _train_fails(str(recipe))
    assert "data.path 'data/train.jsonl': no such file or folder (a relative path written in a recipe is read from " \
           f"the recipe's folder, else from the working directory; one given as a flag, from the working directory: " \
           f"{tmp_path}); fix the path" in line, line  # fmt: skip


def test_hub_failure_names_the_data_path(tmp_path: Path, monkeypatch) -> None:
    import datasets

    def unreachable(*args: Any, **kwargs: Any) -> None:
        raise ConnectionError("Couldn't reach 'someorg/nodata' on the Hub (LocalEntryNotFoundError)")

    monkeypatch.setattr(datasets, "load_dataset", unreachable)
    line = _train_fails(str(_recipe(tmp_path, data={"path": "someorg/nodata", "seq_len": 48})))
    assert "data.path 'someorg/nodata': not a file or folder here" in line and "ConnectionError: Couldn't" in line


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--cp_size", "0"], "cp_size=0: processes that share one sequence (1: no context parallelism); give a whole "
         "number >= 1 (e.g. --cp_size 1)"),
        (["--max_steps", "-1"], "max_steps=-1: a recipe trains a set number of optimizer steps; give --max_steps N "
         "(e.g. --max_steps 100), or steps to every data stage"),
        (["--max_steps", "0"], "max_steps=0: optimizer steps to train"),
        (["--save_steps", "0"], "save_steps=0: optimizer steps between checkpoints"),
        (["--logging_steps", "-5"], "logging_steps=-5"),
        (["--learning_rate=-1e-4"], "learning_rate=-0.0001: the peak learning rate; give a number >= 0"),
        (["--gradient_accumulation_steps", "0"], "gradient_accumulation_steps=0: micro-steps per optimizer step"),
        (["--ulysses_size", "3"], "ulysses_size=3 does not divide cp_size=1"),
        (["--cp_size", "4"], "cp_size=4: needs 4 processes (or a multiple), but this is one process; launch with "
         "torchrun --nproc_per_node 4"),
        (["--max_steps", "abc"], "argument --max_steps/--max-steps: invalid int value: 'abc'; hf-ring train RECIPE "
         "--help lists"),
        (["--lerning_rate", "0.1"], "unknown flag --lerning_rate (did you mean '--learning_rate'?)"),
        (["--data.seq_lenn", "64"], "data: unknown keys ['seq_lenn' (seq_len?)]"),
        (["--data.seq_len", "1"], "data.seq_len: a whole number >= 2, not 1"),
        (["--data.seq_len"], "--data.seq_len: give it a value"),
        (["--model.init_from", "./no/such/model"], "model.init_from"),
    ],  # fmt: skip
    ids=lambda v: " ".join(v) if isinstance(v, list) else None,
)
def test_flag_mistakes(flags: list[str], message: str, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr("hf_ring.recipes.run.build_model", lambda *a, **k: pytest.fail("the model was built"))
    line = _train_fails(str(_recipe(tmp_path)), *flags)
    assert message in line, line
    if flags[0] == "--model.init_from":
        assert "model.init_from './no/such/model': no such file or folder" in line, line


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"learning_rat": 1e-3}, "['learning_rat' (learning_rate?)] are neither RingTrainingArguments fields"),
        ({"batch_size": 4}, "['batch_size' (per_device_train_batch_size?)]"),
        ({"learning_rate": "fast"}, "learning_rate"),
        ({"per_device_train_batch_size": 0}, "per_device_train_batch_size=0"),
        ({"model": {"config": TINY, "dtyp": "float32"}}, "model: unknown keys ['dtyp' (dtype?)]"),
        ({"model": {"config": TINY}, "lora": {"r": 4, "lora_alpa": 8}}, "['lora_alpa' (lora_alpha?)]"),
    ],  # fmt: skip
    ids=["key-typo", "other-trainer-name", "not-a-number", "batch-0", "model-key", "lora-key"],
)
def test_recipe_mistakes(fields: dict[str, Any], message: str, tmp_path: Path) -> None:
    assert message in _train_fails(str(_recipe(tmp_path, **fields)))


def test_recipe_name_typo_and_no_recipe() -> None:
    assert "no recipe 'tiny-cpu-dem' (did you mean 'tiny-cpu-demo'?)" in _train_fails("tiny-cpu-dem")
    assert "give a recipe first: hf-ring train RECIPE" in _train_fails("--max_steps", "4")
    with pytest.raises(FileNotFoundError):  # RecipeNotFound is both
        raise RecipeNotFound("x")


def test_model_refusal_is_one_line(tmp_path: Path, monkeypatch) -> None:
    """``RingNotSupported`` (a model the ring does not compute exactly) is a user error: one line."""
    from hf_ring.transformers.support import RingNotSupported

    def refuse(recipe: Any) -> None:
        raise RingNotSupported('attn_implementation="ring": rope_type=\'dynamic\' rescales RoPE ...;\nuse \'yarn\'')

    monkeypatch.setattr("hf_ring.recipes.run.run", refuse)
    line = _train_fails(str(_recipe(tmp_path)))
    assert line == "hf-ring train: attn_implementation=\"ring\": rope_type='dynamic' rescales RoPE ...; use 'yarn'"
    monkeypatch.setenv("HF_RING_DEBUG", "1")
    with pytest.raises(RingNotSupported):
        main(["train", str(_recipe(tmp_path))])


def test_ulysses_size_must_divide_the_heads() -> None:
    from transformers import LlamaConfig

    from hf_ring.recipes.run import check_ulysses

    config = LlamaConfig(hidden_size=96, num_attention_heads=6, num_key_value_heads=2)
    with pytest.raises(UserError, match=r"ulysses_size=4 does not divide the model's 6 query heads"):
        check_ulysses(SimpleNamespace(ulysses_size=4, cp_size=8), config)
    check_ulysses(SimpleNamespace(ulysses_size=2, cp_size=8), config)
    check_ulysses(SimpleNamespace(ulysses_size="auto", cp_size=8), config)


def test_every_numeric_field_is_checked() -> None:
    """Each field of ``arguments.NUMBERS`` below its range is refused naming the field and the value."""
    from hf_ring.trainer.arguments import NUMBERS, check_numbers

    for name, (least, inclusive, whole, _) in NUMBERS.items():
        bad = least - 1 if inclusive else least
        if name == "max_steps":
            bad = 0  # -1 is TrainingArguments' "use num_train_epochs"
        with pytest.raises(UserError, match=rf"^{name}={bad!r}: .*; give a (whole )?number >?=? ?{least:g}"):
            check_numbers(SimpleNamespace(**{name: bad}))
        check_numbers(SimpleNamespace(**{name: least if inclusive else least + 0.5 if not whole else least + 1}))
    with pytest.raises(UserError, match=r"cp_size=2.5: .*whole number"):
        check_numbers(SimpleNamespace(cp_size=2.5))
    with pytest.raises(UserError, match=r"cp_size=True"):
        check_numbers(SimpleNamespace(cp_size=True))


def test_eval_counts_are_checked(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match=r"^hf-ring eval needle: --cp-size 0: give at least 1$"):
        main(["eval", "needle", "m", "--lengths", "64", "--out", str(tmp_path), "--cp-size", "0"])
    with pytest.raises(SystemExit, match=r"^hf-ring eval ppl: --buckets 0: give at least 1$"):
        main(["eval", "ppl", "m", "--data", "d.jsonl", "--seq-len", "64", "--buckets", "0", "--out", str(tmp_path)])


# --- what a user error is, and who says it -------------------------------------------------------


def test_user_errors_are_the_named_classes() -> None:
    for qualified in USER_ERRORS:
        module, _, name = qualified.rpartition(".")
        cls = getattr(importlib.import_module(module), name)  # the names stay in step with the code
        assert is_user_error(cls("x"))
    assert is_user_error(UserError("x")) and is_user_error(RecipeNotFound("x"))
    assert not is_user_error(ValueError("x")) and not is_user_error(ZeroDivisionError())
    assert one_line(ValueError("a\n  b\tc ")) == "a b c"
    assert closest("plann", ["train", "plan", "eval"]) == "plan" and closest("zzz", ["train"]) is None
    assert closest("LLAMA-3.1-8b", ["Llama-3.1-8B", "Qwen3-8B"]) == "Llama-3.1-8B"


def test_only_rank_zero_says_it(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "error.json"))
    assert exit_for(UserError("bad"), "hf-ring train").code == 1
    assert json.loads((tmp_path / "error.json").read_text())["message"]["message"] == "hf-ring train: bad"
    monkeypatch.delenv("TORCHELASTIC_ERROR_FILE")
    monkeypatch.setenv("RANK", "0")
    assert exit_for(UserError("bad"), "hf-ring train").code == "hf-ring train: bad"
    monkeypatch.delenv("RANK")
    assert exit_for(UserError("bad"), "hf-ring train").code == "hf-ring train: bad"


def test_a_subprocess_run_says_one_line(tmp_path: Path) -> None:
    """``hf-ring train`` in its own process: the issue's ``--cp_size 0`` (a ZeroDivisionError before)."""
    out = _cli("train", "tiny-cpu-demo-pretrain", "--cp_size", "0", "--output_dir", str(tmp_path / "o"))
    assert "cp_size=0" in _one_line(out, "hf-ring train")


@pytest.mark.timeout(300)
def test_under_torchrun_one_rank_says_it_and_none_hangs(tmp_path: Path) -> None:
    """Two ranks hit the same mistake after their process group is up: rank 0 prints the line once,
    both exit with status 1 (torchrun adds its own report of the failed ranks)."""
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "-m", "hf_ring.cli"]
    out = subprocess.run([*torchrun, "train", "tiny-cpu-demo-pretrain", "--cp_size", "3", "--output_dir",
                          str(tmp_path / "o")], capture_output=True, text=True, timeout=280, cwd=tmp_path,
                         env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})  # fmt: skip
    text = out.stdout + out.stderr
    ours = [line for line in text.splitlines() if line.startswith("hf-ring train: ")]
    line = ("hf-ring train: cp_size=3 does not divide the 2 launched processes: launch a multiple of 3 processes, "
            "or set --cp_size to a divisor of 2")  # fmt: skip
    assert out.returncode != 0 and ours == [line], text[-3000:]
    assert "hf_ring/" not in text, text[-3000:]  # no traceback through hf_ring's code
    # torchrun's own report of the failed ranks shows the line (their error files), not a link
    assert f"traceback : {line}" in text, text[-3000:]
