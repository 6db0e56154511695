"""Re-runs of ``hf-ring train`` say what they do, and a recipe's relative paths have one documented base.

- an ``output_dir`` with checkpoints is resumed from the newest, and the run says from which step;
- one that holds an earlier run but no checkpoint (or checkpoints, with ``--resume_from_checkpoint
  no``) is refused unless ``overwrite_output_dir``, which removes its checkpoints and says so;
- a loss plot that cannot be drawn (no matplotlib) is reported in one line;
- relative paths written in a recipe are read from the recipe's folder, else from the working
  directory; flags from the working directory; the demo's second stage starts from the run of the
  first wherever the two are run from.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import yaml

from hf_ring.data.passkey import VOCAB
from hf_ring.errors import RecipeError
from hf_ring.recipes import RECIPES_DIR, read_recipe, recipe_model
from hf_ring.recipes.run import prepare_output_dir

ROOT = Path(__file__).resolve().parent.parent
TINY = {"model_type": "llama", "vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512}  # fmt: skip


def _args(out: Path, resume: str | None = None, overwrite: bool = False) -> SimpleNamespace:
    return SimpleNamespace(output_dir=str(out), resume_from_checkpoint=resume, overwrite_output_dir=overwrite,
                           should_save=True)  # fmt: skip


def _earlier(out: Path, checkpoints: tuple[int, ...] = (), files: tuple[str, ...] = ("summary.json",)) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for step in checkpoints:
        (out / f"checkpoint-{step}").mkdir()
    for name in files:
        (out / name).write_text("{}")


def test_output_dir_decisions(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    prepare_output_dir(_args(tmp_path / "new"))  # nothing there: a fresh run
    empty = tmp_path / "empty"
    _earlier(empty, files=(".hf_ring-shared-probe",))  # hidden files are no earlier run
    prepare_output_dir(_args(empty))

    done = tmp_path / "done"
    _earlier(done, files=("summary.json", "metrics.jsonl"))
    with pytest.raises(RecipeError, match=rf"^output_dir '{done}' holds an earlier run \(metrics.jsonl, summary.json; "
                                          r"no checkpoint\) and this run would start over: add --overwrite_output_dir "
                                          r"true to replace it, or give another --output_dir$"):  # fmt: skip
        prepare_output_dir(_args(done))
    prepare_output_dir(_args(done, overwrite=True))
    assert capsys.readouterr().out == (f"hf-ring train: output_dir {done} holds an earlier run (metrics.jsonl, "
                                       "summary.json): starting over (overwrite_output_dir)\n")  # fmt: skip

    saved = tmp_path / "saved"
    _earlier(saved, checkpoints=(2, 4))
    prepare_output_dir(_args(saved))  # resumed: _resume says from which step
    prepare_output_dir(_args(saved, resume=str(saved / "checkpoint-2")))  # a checkpoint named by its path
    with pytest.raises(RecipeError, match=r"\(checkpoint-4, checkpoint-2, summary.json; checkpoints\).*or drop "
                                          r"--resume_from_checkpoint no to resume$"):  # fmt: skip
        prepare_output_dir(_args(saved, resume="no"))
    prepare_output_dir(_args(saved, resume="no", overwrite=True))
    assert "its 2 checkpoint(s) removed" in capsys.readouterr().out
    assert not list(saved.glob("checkpoint-*")) and (saved / "summary.json").exists()


def _recipe(tmp_path: Path, **fields: Any) -> Path:
    body = {"model": {"config": TINY}, "data": {"task": "passkey", "seq_len": 48}, "max_steps": 2,
            "save_strategy": "steps", "save_steps": 2, "report_to": "none", "disable_tqdm": True,
            "logging_steps": 1, "output_dir": str(tmp_path / "out"), **fields}  # fmt: skip
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(body))
    return path


def _train(*argv: str) -> None:
    from hf_ring.cli import main

    assert main(["train", *argv]) == 0


def test_rerun_resumes_and_says_from_which_step(tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch) -> None:
    """Run 1 (no matplotlib: the plot is skipped with one line) saves checkpoint-2; the same command
    with --max_steps 3 resumes from it and says so; starting over there is refused. A run that saved
    no checkpoint, run again, is refused unless --overwrite_output_dir true."""
    recipe = _recipe(tmp_path)
    with monkeypatch.context() as m:
        m.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
        _train(str(recipe))
    out = capsys.readouterr().out
    assert (f"hf-ring train: {tmp_path / 'out' / 'loss.png'} not drawn: matplotlib is not installed (pip install "
            "'hf-ring[plots]'); the losses are in metrics.jsonl") in out  # fmt: skip
    assert (tmp_path / "out" / "checkpoint-2").is_dir() and not (tmp_path / "out" / "loss.png").exists()
    _train(str(recipe), "--max_steps", "3")
    out = capsys.readouterr().out
    assert (f"hf-ring train: resuming from {tmp_path / 'out' / 'checkpoint-2'} (step 2 of 3); "
            "--resume_from_checkpoint no --overwrite_output_dir true starts over") in out  # fmt: skip
    with pytest.raises(SystemExit, match=r"holds an earlier run \(checkpoint-3, checkpoint-2, final, "):
        _train(str(recipe), "--resume_from_checkpoint", "no")
    nothing_saved = str(_recipe(tmp_path, save_strategy="no", output_dir=str(tmp_path / "out2")))
    _train(nothing_saved)
    refused = r"holds an earlier run \(final, loss.png, metrics.jsonl, summary.json; no checkpoint\) and this run"
    with pytest.raises(SystemExit, match=refused + r" would start over: add --overwrite_output_dir true"):
        _train(nothing_saved)
    _train(nothing_saved, "--overwrite_output_dir", "true")
    assert "starting over (overwrite_output_dir)" in capsys.readouterr().out


# --- relative paths -------------------------------------------------------------------------------


def _docs_recipe(folder: Path, data_path: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "r.yaml"
    path.write_text(yaml.safe_dump({"model": {"config": TINY}, "data": {"path": data_path, "seq_len": 48},
                                    "max_steps": 1, "output_dir": "out"}))  # fmt: skip
    return path


def test_recipe_paths_read_from_the_recipe_folder_then_the_working_directory(tmp_path: Path, monkeypatch) -> None:
    from hf_ring.recipes.recipe import parse_recipe

    project, elsewhere = tmp_path / "project", tmp_path / "elsewhere"
    recipe = _docs_recipe(project, "data/train.jsonl")
    (project / "data").mkdir()
    (project / "data" / "train.jsonl").write_text('{"input_ids": [1, 2, 3]}\n')
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert read_recipe(recipe)["data"]["path"] == str(project / "data" / "train.jsonl")  # next to the recipe
    r = parse_recipe(source=recipe)
    assert r.data["path"] == str(project / "data" / "train.jsonl") and r.args.output_dir == "out"  # outputs: cwd
    (elsewhere / "mine.jsonl").write_text('{"input_ids": [1, 2, 3]}\n')
    assert parse_recipe(["--data.path", "mine.jsonl"], source=recipe).data["path"] == str(elsewhere / "mine.jsonl")
    # only in the working directory: read from there; in both: the recipe's folder wins
    only_here = _docs_recipe(tmp_path / "other", "mine.jsonl")
    assert read_recipe(only_here)["data"]["path"] == str(elsewhere / "mine.jsonl")
    (tmp_path / "other" / "mine.jsonl").write_text('{"input_ids": [4]}\n')
    assert read_recipe(only_here)["data"]["path"] == str(tmp_path / "other" / "mine.jsonl")
    # nowhere: left as written (refused by name when the data is loaded), a hub name stays a hub name
    assert read_recipe(_docs_recipe(tmp_path / "x", "data/none.jsonl"))["data"]["path"] == "data/none.jsonl"
    assert read_recipe(_docs_recipe(tmp_path / "y", "org/name"))["data"]["path"] == "org/name"


def test_demo_second_stage_from_another_directory(tmp_path: Path, monkeypatch) -> None:
    """``tiny-cpu-demo`` starts from ``runs/tiny-cpu-demo-pretrain/final``, the run of the first stage,
    which is written in the working directory: planned before it exists (the first stage's model),
    read from it afterwards, from whatever directory both stages run in."""
    from hf_ring.recipes.recipe import build_model, model_config

    monkeypatch.chdir(tmp_path)
    demo = RECIPES_DIR / "tiny-cpu-demo.yaml"
    final = tmp_path / "runs" / "tiny-cpu-demo-pretrain" / "final"
    assert read_recipe(demo)["model"]["init_from"] == str(final)
    assert recipe_model("tiny-cpu-demo") == recipe_model("tiny-cpu-demo-pretrain")
    with pytest.raises(RecipeError, match=r"no saved model there yet; it is written by tiny-cpu-demo-pretrain.yaml"):
        model_config(read_recipe(demo)["model"], demo)
    build_model(read_recipe("tiny-cpu-demo-pretrain")["model"], None).save_pretrained(final)
    assert model_config(read_recipe(demo)["model"], demo).hidden_size == 128
    out = subprocess.run([sys.executable, "-m", "hf_ring.cli", "plan", "tiny-cpu-demo"], capture_output=True,
                         text=True, timeout=120, cwd=tmp_path, env={"PYTHONPATH": str(ROOT), "PATH": ""})  # fmt: skip
    assert out.returncode == 0 and "CP=4" in out.stdout, out.stderr


def test_demo_script_runs_from_any_directory() -> None:
    """scripts/demo.sh moves to the repository first and names its recipes by path from there; the
    demo recipes set overwrite_output_dir, so running it again starts over (and says so)."""
    script = (ROOT / "scripts" / "demo.sh").read_text()
    assert 'cd "$(dirname "$0")/.."' in script.split("SEED=")[0]
    for name in ("tiny-cpu-demo-pretrain", "tiny-cpu-demo"):
        assert f"hf_ring/recipes/{name}.yaml" in script
        assert read_recipe(name)["overwrite_output_dir"] is True
