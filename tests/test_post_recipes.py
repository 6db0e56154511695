"""DPO and GRPO recipes (``trainer: dpo | grpo``; ``hf_ring.recipes.post``, ``hf_ring.recipes.rewards``):
the packaged ones parse into ``RingDPOConfig`` / ``RingGRPOConfig`` and are priced by the planner (pairs as
micro-batch 2, the LoRA reference free, generation memory left out and said so); the tiny CPU recipes
train a few steps at CP = 2 under the runner and write their outputs; every field they add is refused
on one line, naming the field and, where one is close, the name meant."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import yaml

from hf_ring.errors import RecipeError
from hf_ring.recipes import RECIPES_DIR, recipe_notes, recipe_plan
from testkit.spawn import run_ranks

pytest.importorskip("trl")

from tests.test_training import recipe_run  # noqa: E402

GiB = 2**30


def test_dpo_recipe_parses_and_is_priced_as_pairs() -> None:
    from hf_ring.recipes.recipe import parse_recipe
    from hf_ring.trainer.dpo import RingDPOConfig

    r = parse_recipe(["--output_dir", "runs/parse-test"], source="llama-3.1-8b-dpo-128k")
    assert r.trainer == "dpo" and isinstance(r.args, RingDPOConfig)
    assert r.args.max_length == 131072 and r.args.cp_size == 8 and r.args.loss_type == ["sigmoid"]
    p = recipe_plan("llama-3.1-8b-dpo-128k")
    assert p.settings.micro_batch == 2 and p.settings.seq_len == 131072 and p.settings.mode == "lora"
    total = p.summary_gib()["total"]
    assert 15 < total < 40, total  # 25.9 GiB per GPU when written
    single = recipe_plan("llama-3.1-8b-dpo-128k", micro_batch=1).summary_gib()["total"]
    assert total > single + 5  # the rejected sequence costs activations as the chosen one does
    notes = " ".join(p.notes)
    assert "2 sequences" in notes and "adapter disabled" in notes and "nothing added" in notes
    stated = yaml.safe_load((RECIPES_DIR / "llama-3.1-8b-dpo-128k.yaml").read_text())["memory_gb"]
    assert stated["total"] == pytest.approx(total, abs=0.01)  # hf-ring plan --write is current


def test_grpo_recipe_parses_and_says_generation_is_not_priced() -> None:
    from hf_ring.recipes.recipe import parse_recipe
    from hf_ring.trainer.grpo import RingGRPOConfig

    r = parse_recipe(["--output_dir", "runs/parse-test", "--cp_size", "1"], source="qwen3-8b-grpo-64k")
    assert r.trainer == "grpo" and isinstance(r.args, RingGRPOConfig) and r.args.max_completion_length == 61440
    p = recipe_plan("qwen3-8b-grpo-64k")
    assert p.settings.micro_batch == 1 and p.settings.seq_len == 65536 and p.settings.cp == 4
    total = p.summary_gib()["total"]
    assert 10 < total < 30, total  # 16.4 GiB per GPU when written
    notes = " ".join(p.notes)
    assert "generation memory is NOT included" in notes and "144 KiB per token" in notes and "9.0 GiB" in notes
    assert recipe_notes("tiny-cpu-demo") == []  # the causal-LM trainer: nothing to add


def test_full_fine_tuning_dpo_says_the_reference_weights_are_not_priced(tmp_path: Path) -> None:
    raw = yaml.safe_load((RECIPES_DIR / "llama-3.1-8b-dpo-128k.yaml").read_text())
    raw["lora"] = None
    path = tmp_path / "full.yaml"
    path.write_text(yaml.safe_dump(raw))
    notes = " ".join(recipe_notes(path))
    assert "a second copy of the weights, 1.9 GiB per GPU, NOT included" in notes  # 8.0B x 2 bytes / 8 GPUs


def _bad(tmp_path: Path, name: str, change: dict, drop: tuple[str, ...] = (), data: dict | None = None) -> str:
    """The one-line error of the tiny recipe ``name`` changed by ``change`` (and ``data`` keys)."""
    from hf_ring.recipes.recipe import parse_recipe

    raw = yaml.safe_load((RECIPES_DIR / f"{name}.yaml").read_text())
    raw["data"] = {**raw["data"], "path": str(RECIPES_DIR / raw["data"]["path"]), **(data or {})}
    raw["data"]["tokenizer"] = str(RECIPES_DIR / raw["data"]["tokenizer"])
    for key in drop:
        raw["data"].pop(key, None)
    raw.update(change)
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(RecipeError) as e:
        parse_recipe(["--cp_size", "1"], source=path)
    message = str(e.value)
    assert "\n" not in message
    return message


def test_bad_fields_are_refused_on_one_line(tmp_path: Path) -> None:
    assert "trainer: one of ['sft', 'dpo', 'grpo'], not 'dop' (did you mean 'dpo'?)" in _bad(
        tmp_path, "tiny-cpu-dpo", {"trainer": "dop"}
    )
    assert "'betta' (beta?)" in _bad(tmp_path, "tiny-cpu-dpo", {"betta": 0.1})
    assert "RingDPOConfig fields" in _bad(tmp_path, "tiny-cpu-dpo", {"num_generations": 4})
    msg = _bad(tmp_path, "tiny-cpu-dpo", {}, data={"reward": ["length"]})
    assert "unknown keys ['reward']" in msg and "preference pairs" in msg
    assert "'rewads' (rewards?)" in _bad(tmp_path, "tiny-cpu-grpo", {}, drop=("rewards",), data={"rewads": []})
    assert "give rewards" in _bad(tmp_path, "tiny-cpu-grpo", {}, drop=("rewards",))
    assert "give seq_len" in _bad(tmp_path, "tiny-cpu-dpo", {}, drop=("seq_len",))
    assert "data.seq_len: a whole number >= 2, not 1" in _bad(tmp_path, "tiny-cpu-dpo", {}, data={"seq_len": 1})
    assert "max_length=64 is longer than data.seq_len=32" in _bad(tmp_path, "tiny-cpu-dpo", {"max_length": 64})
    msg = _bad(tmp_path, "tiny-cpu-grpo", {"max_completion_length": 32})
    assert "max_completion_length=32 leaves no room for the prompt in data.seq_len=32" in msg
    rewards = {
        "lenght": "not a built-in reward (length, keyword) (did you mean 'length'?)",
        "no_such_module_x:f": "no module 'no_such_module_x' importable here",
        "json:no_such_function": "module 'json' has no 'no_such_function'",
    }
    for name, want in rewards.items():
        assert want in _bad(tmp_path, "tiny-cpu-grpo", {}, data={"rewards": [name]}), name
    msg = _bad(tmp_path, "tiny-cpu-grpo", {}, data={"rewards": [{"function": "length", "targt": 3}]})
    assert "data.rewards[0] 'length': no option 'targt' (did you mean 'target'?)" in msg
    from hf_ring.recipes.recipe import parse_recipe

    with pytest.raises(RecipeError, match=r"world size 1 is not a multiple of cp_size=2: launch a multiple"):
        parse_recipe([], source="tiny-cpu-grpo")  # one process
    assert "give keyword" in _bad(tmp_path, "tiny-cpu-grpo", {}, data={"rewards": [{"function": "keyword"}]})
    assert "data.rewards: a list" in _bad(tmp_path, "tiny-cpu-grpo", {}, data={"rewards": "length"})


def test_pairs_without_their_columns_are_refused(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    from hf_ring.recipes.post import post_dataset
    from hf_ring.recipes.recipe import parse_recipe

    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(json.dumps({"prompt": "w1 w2", "chosen": " w3"}) + "\n")
    r = parse_recipe(["--data.path", str(pairs)], source="tiny-cpu-dpo")
    tok = AutoTokenizer.from_pretrained(RECIPES_DIR / "tiny" / "tokenizer")
    with pytest.raises(RecipeError, match=r"no column \['rejected'\]"):
        post_dataset(r, tok, 64)
    with pytest.raises(RecipeError, match="more than the model's vocab_size 32"):
        post_dataset(r, tok, 32)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": " ".join(["w1"] * 25)}) + "\n")
    r = parse_recipe(["--data.path", str(prompts), "--cp_size", "1"], source="tiny-cpu-grpo")
    with pytest.raises(RecipeError, match="prompt 0 has 25 tokens, more than data.seq_len=32 - max_completion_length"):
        post_dataset(r, tok, 64)


def test_builtin_rewards() -> None:
    from hf_ring.recipes.rewards import reward_functions

    length, keyword = reward_functions([{"function": "length", "target": 4}, {"function": "keyword", "keyword": "w7"}])
    assert length(prompts=["p"] * 3, completions=["a b c d", "a b", [{"role": "assistant", "content": "a"}]]) == [
        1.0, 0.5, 0.25]  # fmt: skip
    assert keyword(completions=["w1 w7", "w1"]) == [1.0, 0.0]


@pytest.mark.parametrize("name", ["tiny-cpu-dpo", "tiny-cpu-grpo"])
def test_tiny_recipe_trains_at_cp2(tmp_path: Path, name: str) -> None:
    """The packaged tiny recipe, as ``torchrun --nproc_per_node 2 -m hf_ring.cli train NAME`` runs it."""
    out = tmp_path / "out"
    ranks = run_ranks(2, recipe_run, name, ["--output_dir", str(out)], timeout=300)
    summary, logs = ranks[0]["summary"], ranks[0]["logs"]
    steps = yaml.safe_load((RECIPES_DIR / f"{name}.yaml").read_text())["max_steps"]
    assert summary["trainer"] == name.split("-")[-1] and summary["cp_size"] == 2 and summary["steps"] == steps
    assert [h["step"] for h in logs] == list(range(1, steps + 1))
    assert all(math.isfinite(h["loss"]) for h in logs)
    assert ranks[1]["summary"]["steps"] == steps
    assert json.loads((out / "summary.json").read_text())["trainer"] == summary["trainer"]
    if name == "tiny-cpu-dpo":
        assert (out / "final" / "adapter_model.safetensors").exists()  # LoRA: the adapter
        assert logs[-1]["rewards/margins"] > 0 and logs[-1]["loss"] < logs[0]["loss"]
    else:
        assert (out / "final" / "model.safetensors").exists()
        assert all("rewards/reward_length/mean" in h and "reward" in h for h in logs)
    assert (out / "final" / "tokenizer.json").exists()
