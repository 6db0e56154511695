"""Recipes (``hf_ring.recipes``): shipped as package data and found through importlib.resources, read
by path or by name in one place (the trainer's config uses the same reader), and their stated memory
rewritten from the planner."""

from __future__ import annotations

import shutil
from importlib.resources import files
from pathlib import Path

import pytest
import tomllib

from hf_ring.recipes import (
    RECIPES_DIR,
    packaged_recipes,
    read_recipe,
    recipe_model,
    recipe_path,
    recipe_plan,
    recipe_settings,
    write_recipe_memory,
)
from hf_ring.train import TrainConfig

ROOT = Path(__file__).resolve().parents[1]
NAMES = ["llama-3.1-8b-128k", "llama-3.1-8b-1m", "qwen2.5-7b-256k", "tiny-cpu-demo", "tiny-cpu-demo-pretrain"]


def test_recipes_are_package_resources() -> None:
    resources = files("hf_ring.recipes")
    shipped = sorted(r.name for r in resources.iterdir() if r.name.endswith(".yaml"))
    assert shipped == sorted(f"{n}.yaml" for n in NAMES)
    assert [p.name for p in packaged_recipes()] == shipped
    assert RECIPES_DIR == Path(str(resources)) and RECIPES_DIR.parent.name == "hf_ring"
    assert not list((ROOT / "recipes").glob("*.yaml"))  # one copy, inside the package


def test_pyproject_ships_recipes_and_pyyaml() -> None:
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "*.yaml" in meta["tool"]["setuptools"]["package-data"]["hf_ring.recipes"]
    assert any(d.replace(" ", "").lower().startswith("pyyaml") for d in meta["project"]["dependencies"])
    assert "hf_ring*" in meta["tool"]["setuptools"]["packages"]["find"]["include"]


def test_recipe_path_by_name_or_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in NAMES:
        assert recipe_path(name) == recipe_path(f"{name}.yaml") == RECIPES_DIR / f"{name}.yaml"
    assert recipe_path("Llama-3.1-8B") is None and recipe_path("no/such/recipe.yaml") is None
    mine = tmp_path / "tiny-cpu-demo.yaml"
    shutil.copy(RECIPES_DIR / "tiny-cpu-demo-pretrain.yaml", mine)
    assert recipe_path(mine) == mine
    monkeypatch.chdir(tmp_path)
    assert recipe_path("tiny-cpu-demo.yaml") == Path("tiny-cpu-demo.yaml")  # a file here wins over the package
    assert recipe_path("tiny-cpu-demo") == RECIPES_DIR / "tiny-cpu-demo.yaml"
    with pytest.raises(FileNotFoundError, match="llama-3.1-8b-128k"):  # lists the packaged names
        read_recipe("no-such-recipe")
    bad = tmp_path / "list.yaml"
    bad.write_text("- 1\n- 2\n")
    with pytest.raises(ValueError, match="mapping"):
        read_recipe(bad)


def test_train_config_reads_recipes_through_the_shared_reader(tmp_path: Path) -> None:
    by_name = TrainConfig.from_yaml("llama-3.1-8b-128k")
    assert by_name == TrainConfig.from_yaml(RECIPES_DIR / "llama-3.1-8b-128k.yaml")
    assert by_name == TrainConfig(**read_recipe("llama-3.1-8b-128k"))
    assert TrainConfig.from_yaml("tiny-cpu-demo", output_dir=str(tmp_path)).output_dir == str(tmp_path)


def test_recipe_settings_and_model() -> None:
    s = recipe_settings("llama-3.1-8b-1m")
    assert (s.seq_len, s.gpus, s.cp, s.sharding, s.mode, s.lora_rank) == (2**20, 16, 8, "fsdp", "lora", 16)
    assert s.offload and s.checkpointing and s.tiled_mlp == 8192 and s.dtype == "bfloat16" and s.reserve_gib == 0
    assert recipe_model("llama-3.1-8b-1m").name == "Llama-3.1-8B"
    assert recipe_plan("llama-3.1-8b-1m", cp=16).cp == 16  # overrides replace settings
    # init_from a run that does not exist: the model of the recipe that writes that run
    assert recipe_model("tiny-cpu-demo") == recipe_model("tiny-cpu-demo-pretrain")


def test_write_recipe_memory_rewrites_one_line(tmp_path: Path) -> None:
    path = tmp_path / "llama-3.1-8b-128k.yaml"
    original = (RECIPES_DIR / path.name).read_text()
    path.write_text(original.replace("activations: 10.33", "activations: 1.0"))
    line = write_recipe_memory(path)
    assert path.read_text() == original and line in original
    path = tmp_path / "tiny-cpu-demo-pretrain.yaml"  # states no launch inputs but gpus: 1, the default
    original = (RECIPES_DIR / path.name).read_text()
    assert original.splitlines()[-1].startswith("memory_gb: {gpus: 1,")
    path.write_text("".join(original.splitlines(keepends=True)[:-1]))
    write_recipe_memory(path)
    assert path.read_text() == original.replace("{gpus: 1, ", "{")  # appended as the last line, with its comment
