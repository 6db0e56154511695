"""Recipes (``hf_ring.recipes``): shipped as package data and found through importlib.resources, read
by path or by name in one place (the training runner uses the same reader), and their stated memory
rewritten from the planner."""

from __future__ import annotations

import json
import shutil
from importlib.resources import files
from pathlib import Path

import pytest
import tomllib
import yaml

from hf_ring.recipes import (
    RECIPES_DIR,
    packaged_recipes,
    read_recipe,
    recipe_model,
    recipe_model_config,
    recipe_path,
    recipe_plan,
    recipe_settings,
    write_recipe_memory,
)
from hf_ring.recipes.recipe import parse_recipe
from hf_ring.transformers.support import RingNotSupported

ROOT = Path(__file__).resolve().parents[1]
NAMES = [
    "gemma-3-27b-128k",
    "gpt-oss-20b-128k",
    "llama-3.1-8b-128k",
    "llama-3.1-8b-1m",
    "llama-3.1-8b-8m-full",
    "llama-3.1-8b-8m-lora",
    "llama-3.1-8b-dpo-128k",
    "qwen2.5-7b-256k",
    "qwen3-8b-grpo-64k",
    "qwen3.5-9b-1m",
    "qwen3.5-9b-video-256k",
    "tiny-cpu-demo",
    "tiny-cpu-demo-pretrain",
    "tiny-cpu-dpo",
    "tiny-cpu-grpo",
    "tiny-cpu-vlm",
]


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


def test_training_runner_reads_recipes_through_the_shared_reader(tmp_path: Path) -> None:
    by_name = parse_recipe(source="llama-3.1-8b-128k")
    by_path = parse_recipe(source=RECIPES_DIR / "llama-3.1-8b-128k.yaml")
    raw = read_recipe("llama-3.1-8b-128k")
    assert by_name.args.to_dict() == by_path.args.to_dict()
    assert (by_name.model, by_name.lora, by_name.data) == (raw["model"], raw["lora"], raw["data"])
    assert by_name.args.learning_rate == raw["learning_rate"] and by_name.args.cp_size == raw["cp_size"]
    assert parse_recipe(["--output_dir", str(tmp_path)], source="tiny-cpu-demo").args.output_dir == str(tmp_path)


# recipe -> what the ring still refuses in its model (strict: delete the entry when that lands)
WAITING: dict[str, str] = {}


def _recipe_param(path: Path):
    why = WAITING.get(path.name)
    marks = [pytest.mark.xfail(strict=True, raises=RingNotSupported, reason=why)] if why else []
    return pytest.param(path, id=path.name, marks=marks)


@pytest.mark.parametrize("path", [_recipe_param(p) for p in packaged_recipes()])
def test_every_recipe_parses_and_builds_its_model_config(path: Path) -> None:
    """Each recipe parses into RingTrainingArguments (its fields, with transformers' own validation)
    and its model section into a transformers config, nothing downloaded: hub models from the
    planner's catalogue, an ``init_from`` run from the recipe that writes it; the model is then
    built on the meta device, which checks the overrides (RoPE scaling, ...) too, and the ring
    would compute it exactly at the recipe's longest sequence (``check_model``)."""
    import torch
    from transformers import AutoConfig

    from hf_ring.recipes.data import stages_of
    from hf_ring.recipes.recipe import auto_class, check_config_fields, model_config
    from hf_ring.trainer import RingTrainingArguments
    from hf_ring.transformers.support import check_model

    cp = read_recipe(path).get("cp_size", 1)
    # RingGRPOConfig checks cp_size against the launched processes (one here): parsed at cp_size 1
    one = ["--cp_size", "1"] if read_recipe(path).get("trainer") == "grpo" else []
    r = parse_recipe(["--output_dir", "runs/parse-test", *one], source=path)
    assert isinstance(r.args, RingTrainingArguments) and r.args.max_steps > 0
    assert r.args.train_batch_size >= 1 and r.args.cp_size >= 1
    for stage in stages_of(r.data, r.trainer):
        assert stage["seq_len"] >= 2 * cp
    fields = recipe_model_config(path)
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    if "config" in r.model and not r.model.get("init_from"):
        assert model_config(r.model).to_dict() == config.to_dict()  # the runner's own builder agrees
    check_config_fields(config, r.model.get("overrides") or {}, "model.overrides")  # no typo in the overrides
    with torch.device("meta"):
        # image / video data (data.processor): the vision-language model, its vision tower included
        model = auto_class(r.data.get("processor") is not None).from_config(config, attn_implementation="ring")
    assert model.config.get_text_config().vocab_size == config.get_text_config().vocab_size
    check_model(model, cp, max(s["seq_len"] for s in stages_of(r.data, r.trainer)))  # the ring computes it exactly
    if r.lora:
        from peft import LoraConfig

        assert set(LoraConfig(**r.lora).target_modules) <= {n.rsplit(".", 1)[-1] for n, _ in model.named_modules()}


def test_recipe_flags_override_fields_and_sections(tmp_path: Path) -> None:
    r = parse_recipe(
        ["--max_steps", "4", "--output_dir", str(tmp_path), "--data.seq_len", "4096", "--lora.r=8"]
        + ["--tiled_mlp", "1024"],
        source="llama-3.1-8b-128k",
    )
    assert (r.args.max_steps, r.args.output_dir, r.args.tiled_mlp) == (4, str(tmp_path), 1024)
    assert r.data["seq_len"] == 4096 and r.lora["r"] == 8 and r.lora["lora_alpha"] == 32
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: {name_or_path: x}\ndata: {seq_len: 64}\nmax_steps: 1\nbatch_size: 4\noutput_dir: o\n")
    with pytest.raises(ValueError, match=r"\['batch_size' \(per_device_train_batch_size\?\)\] are neither "
                                         r"RingTrainingArguments fields"):  # fmt: skip
        parse_recipe(source=bad)


def test_recipe_settings_and_model() -> None:
    s = recipe_settings("llama-3.1-8b-1m")
    assert (s.seq_len, s.gpus, s.cp, s.sharding, s.mode, s.lora_rank) == (2**20, 16, 8, "fsdp", "lora", 16)
    assert s.ulysses_size == recipe_plan("llama-3.1-8b-1m").recommended.ulysses == 1  # the planner's choice
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


def _as_transformers(fields: dict) -> dict:
    from transformers import AutoConfig

    fields = dict(fields)
    return AutoConfig.for_model(fields.pop("model_type"), **fields).to_dict()


def _same(planner_fields: dict, runner_config) -> None:
    bookkeeping = {"_name_or_path", "transformers_version", "architectures", "dtype"}  # the recipe sets dtype
    want = {k: v for k, v in _as_transformers(planner_fields).items() if k not in bookkeeping}
    got = {k: v for k, v in runner_config.to_dict().items() if k not in bookkeeping}
    assert got == want


def test_planner_and_runner_resolve_the_same_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``hf-ring plan`` prices the model ``hf-ring train`` builds: for every packaged recipe the
    planner's config fields and shape (``recipe_model_config``, ``recipe_model``) and the runner's
    transformers config (``model_config``) agree. Hub models come from a local snapshot of their
    config (the catalogue's fields, as a download would give); ``tiny-cpu-demo`` starts from the run
    ``tiny-cpu-demo-pretrain`` writes: before it exists the planner takes that recipe's model and the
    runner says which recipe to run first, after it both read its ``config.json``. A recipe with both
    ``config`` and ``init_from`` resolves to the saved model in both (the planner took the inline
    config before), and one whose ``config`` contradicts the saved model is refused by both."""
    from hf_ring.planner import ModelShape, known_config
    from hf_ring.recipes.recipe import build_model, model_config

    monkeypatch.chdir(tmp_path)
    demo = RECIPES_DIR / "tiny-cpu-demo.yaml"
    with pytest.raises(ValueError, match=r"no saved model there yet; it is written by tiny-cpu-demo-pretrain.yaml "
                                         r"\(hf-ring train tiny-cpu-demo-pretrain\): run that first"):  # fmt: skip
        model_config(read_recipe(demo)["model"], demo)
    before = recipe_model_config(demo)
    pretrain = read_recipe("tiny-cpu-demo-pretrain")
    build_model(pretrain["model"], None).save_pretrained(Path(pretrain["output_dir"]) / "final")
    for path in packaged_recipes():
        section = read_recipe(path)["model"]
        ref = section.get("name_or_path")
        if ref and not (tmp_path / ref).exists():
            (tmp_path / ref).mkdir(parents=True)
            (tmp_path / ref / "config.json").write_text(json.dumps(known_config(ref)))
        planned, runner = recipe_model_config(path), model_config(section, path)
        _same(planned, runner)
        shape = recipe_model(path)
        assert shape == ModelShape.from_config(runner.to_dict(), name=shape.name)
    _same(before, model_config(read_recipe(demo)["model"], demo))  # the same model, now from config.json

    saved = Path(pretrain["output_dir"]) / "final"
    both = tmp_path / "both.yaml"
    inline = pretrain["model"]["config"]
    section = {"config": inline, "init_from": str(saved), "overrides": {"max_position_embeddings": 8192}}
    both.write_text(yaml.safe_dump({"model": section, "data": {"task": "passkey", "seq_len": 64}}))
    _same(recipe_model_config(both), model_config(section, both))
    assert recipe_model_config(both)["max_position_embeddings"] == 8192 != inline["max_position_embeddings"]
    other = {**section, "config": {**section["config"], "hidden_size": 64}}
    both.write_text(yaml.safe_dump({"model": other, "data": {"task": "passkey", "seq_len": 64}}))
    with pytest.raises(ValueError, match=r"model.config disagrees with .*config.json on \['hidden_size'\]"):
        recipe_model(both)
    with pytest.raises(ValueError, match=r"model.config disagrees with .*config.json on \['hidden_size'\]"):
        model_config(other, both)
