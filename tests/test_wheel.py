"""The README's commands from an installed wheel, outside the source tree: ``hf-ring train --list``,
``hf-ring train --config NAME`` (the accelerate configs are package data), ``hf-ring plan RECIPE``
and ``hf-ring train RECIPE`` itself. The wheel is built with ``pip wheel --no-deps``, installed
with ``--no-deps`` into a fresh virtual environment that borrows this environment's packages
(torch, transformers, ...) through a ``.pth`` line, and run from an empty directory."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _sh(*cmd: str | Path, cwd: Path, timeout: float = 300) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["OMP_NUM_THREADS"] = "1"
    out = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, f"{' '.join(map(str, cmd))}:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out.stdout


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """``(bin directory of a fresh venv with the hf_ring wheel installed, an empty working directory)``."""
    tmp = tmp_path_factory.mktemp("wheel")
    # built from a copy: setuptools writes build/ next to the sources, whose stale files a later build would ship
    skip = shutil.ignore_patterns(".git", ".venv", "build", "dist", "runs", "*.egg-info", "__pycache__", ".*_cache")
    shutil.copytree(ROOT, tmp / "src", ignore=skip)
    _sh(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", tmp / "dist",
        tmp / "src", cwd=tmp)  # fmt: skip
    (wheel,) = (tmp / "dist").glob("hf_ring-*.whl")
    _sh(sys.executable, "-m", "venv", "--without-pip", tmp / "venv", cwd=tmp)
    venv_python = tmp / "venv" / "bin" / "python"
    site = Path(_sh(venv_python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])", cwd=tmp).strip())
    # this environment's packages, after the venv's own (its .pth files, the editable hf_ring, stay inactive)
    (site / "borrowed.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    _sh(sys.executable, "-m", "pip", "--python", venv_python, "install", "--no-deps", "-q", wheel, cwd=tmp)
    work = tmp / "work"
    work.mkdir()
    return tmp / "venv" / "bin", work


def test_the_wheel_is_what_runs(installed: tuple[Path, Path]) -> None:
    bin_dir, work = installed
    where = _sh(bin_dir / "python", "-c", "import hf_ring; print(hf_ring.__file__)", cwd=work)
    assert str(bin_dir.parent) in where and str(ROOT) not in where


def test_train_list_and_launch_configs(installed: tuple[Path, Path]) -> None:
    bin_dir, work = installed
    listing = _sh(bin_dir / "hf-ring", "train", "--list", cwd=work)
    for name in ("tiny-cpu-demo", "tiny-cpu-demo-pretrain", "llama-3.1-8b-128k", "cpu-4proc", "fsdp2-8gpu"):
        assert name in listing
    assert "accelerate launch --config_file $(hf-ring train --config cpu-4proc) -m hf_ring.cli train tiny-cpu-demo" in (
        listing
    )
    path = Path(_sh(bin_dir / "hf-ring", "train", "--config", "cpu-4proc", cwd=work).strip())
    assert path.is_file() and str(bin_dir.parent) in str(path) and "num_processes: 4" in path.read_text()


def test_plan_a_packaged_recipe(installed: tuple[Path, Path]) -> None:
    bin_dir, work = installed
    plan = json.loads(_sh(bin_dir / "hf-ring", "plan", "llama-3.1-8b-128k", "--json", cwd=work))
    assert plan["cp"] == 8 and plan["model"]["name"] == "Llama-3.1-8B"


def test_train_a_packaged_recipe(installed: tuple[Path, Path]) -> None:
    """``hf-ring train tiny-cpu-demo-pretrain`` (shortened by flags) trains and writes its outputs."""
    bin_dir, work = installed
    flags = ["--max_steps", "2", "--output_dir", "out", "--data.stages", "[{seq_len: 24, steps: 2}]"]
    flags += ["--data.eval", "null"]
    _sh(bin_dir / "hf-ring", "train", "tiny-cpu-demo-pretrain", *flags, "--logging_steps", "1", cwd=work)
    summary = json.loads((work / "out" / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["final_loss"] > 0
    assert (work / "out" / "final" / "model.safetensors").is_file()


def test_train_under_torchrun(installed: tuple[Path, Path]) -> None:
    """Two processes, CP = 2, each running the installed ``hf-ring train`` as the module ``hf_ring.cli``."""
    bin_dir, work = installed
    recipe = {
        "model": {"config": {"model_type": "llama", "vocab_size": 84, "hidden_size": 32, "intermediate_size": 64,
                             "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2}},
        "data": {"task": "passkey", "stages": [{"seq_len": 48, "steps": 2}]},
        "cp_size": 2, "per_device_train_batch_size": 2, "save_strategy": "no", "report_to": "none",
        "disable_tqdm": True, "output_dir": "cp2",
    }  # fmt: skip
    (work / "cp2.yaml").write_text(json.dumps(recipe))  # JSON is YAML
    torchrun = [bin_dir / "python", "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    _sh(*torchrun, "-m", "hf_ring.cli", "train", "cp2.yaml", cwd=work)
    summary = json.loads((work / "cp2" / "summary.json").read_text())
    assert (summary["cp_size"], summary["dp_size"], summary["steps"]) == (2, 1, 2)


def test_tiny_dpo_recipe_runs_from_the_wheel(installed: tuple[Path, Path]) -> None:
    """``tiny-cpu-dpo`` from the installed wheel: its pairs and tokenizer are package data (``tiny/``)."""
    bin_dir, work = installed
    torchrun = [bin_dir / "python", "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    _sh(*torchrun, "-m", "hf_ring.cli", "train", "tiny-cpu-dpo", "--max_steps", "1", "--output_dir", "dpo", cwd=work)
    summary = json.loads((work / "dpo" / "summary.json").read_text())
    assert (summary["trainer"], summary["cp_size"], summary["steps"]) == ("dpo", 2, 1)
    assert (work / "dpo" / "final" / "adapter_model.safetensors").is_file()
