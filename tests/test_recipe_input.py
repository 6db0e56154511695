"""Bad input to a recipe is refused before any model weights load (before the data is built when the
fault is in the recipe itself), with a message that names the field and the fix: token ids outside
the vocabulary, empty or unreadable data, lengths that are not positive whole numbers, unknown keys
in the data, lora and model sections and unknown fields of an inline model config, and a model the
ring would refuse (``support.check_model``: in the runner on the meta device, in ``RingTrainer``
when it is handed the model)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from hf_ring import RingNotSupported
from hf_ring.data.passkey import VOCAB
from hf_ring.transformers.support import check_model
from testkit.models import tiny_model

TINY = {"model_type": "llama", "vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512}  # fmt: skip
PASSKEY = {"task": "passkey", "seq_len": 48}


def _recipe(tmp_path: Path, data: dict[str, Any] | None = None, model: dict[str, Any] | None = None, **fields: Any
            ) -> Path:  # fmt: skip
    body = {"model": model or {"config": TINY}, "data": data or PASSKEY, "max_steps": 1, "save_strategy": "no",
            "report_to": "none", "disable_tqdm": True, "output_dir": str(tmp_path / "out"),
            "overwrite_output_dir": True, **fields}  # fmt: skip
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(body))
    return path


@pytest.fixture
def no_weights(monkeypatch: pytest.MonkeyPatch) -> None:
    """The runner may not build a model with weights: a refusal must come first."""

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the model was built before the bad input was refused")

    monkeypatch.setattr("hf_ring.recipes.run.build_model", refuse)


def _run(path: Path, *argv: str) -> None:
    from hf_ring.recipes.recipe import parse_recipe
    from hf_ring.recipes.run import run

    run(parse_recipe(list(argv), source=path))


def _docs(tmp_path: Path, rows: list[dict[str, Any]] | str) -> str:
    path = tmp_path / "docs.jsonl"
    path.write_text(rows if isinstance(rows, str) else "".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


# --- the data ------------------------------------------------------------------------------------


def test_token_ids_outside_the_vocabulary(tmp_path: Path, no_weights: None) -> None:
    path = _docs(tmp_path, [{"input_ids": list(range(20))}, {"input_ids": [1, 2, VOCAB + 6, 3]}])
    recipe = _recipe(tmp_path, {"path": path, "seq_len": 8, "boundaries": "concatenate"})
    with pytest.raises(ValueError, match=rf"document 1 holds token id {VOCAB + 6}, outside the model's vocabulary "
                                         rf"\[0, {VOCAB}\).*data.tokenizer.*model.overrides.vocab_size"):  # fmt: skip
        _run(recipe)
    negative = _docs(tmp_path, [{"input_ids": [4, -1, 5]}])
    with pytest.raises(ValueError, match="document 0 holds token id -1"):
        _run(_recipe(tmp_path, {"path": negative, "seq_len": 2}))
    with pytest.raises(ValueError, match=rf"data.pad_id 99 is outside the model's vocabulary \[0, {VOCAB}\)"):
        _run(_recipe(tmp_path, {"path": negative, "seq_len": 2, "pad_id": 99}))


def test_passkey_task_needs_its_vocabulary(tmp_path: Path, no_weights: None) -> None:
    recipe = _recipe(tmp_path, model={"config": {**TINY, "vocab_size": 50}})
    with pytest.raises(ValueError, match=rf"passkey uses token ids 0..{VOCAB - 1}.*vocab_size is 50"):
        _run(recipe)


def test_empty_and_unreadable_data(tmp_path: Path, no_weights: None) -> None:
    empty = _docs(tmp_path, "")
    with pytest.raises(ValueError, match=r"data.path .*docs.jsonl.*empty"):
        _run(_recipe(tmp_path, {"path": empty, "seq_len": 8}))
    (tmp_path / "blank").mkdir()
    (tmp_path / "blank" / "a.jsonl").write_text("\n\n")
    with pytest.raises(ValueError, match=r"data.path .*blank.*(no documents|could not read)"):
        _run(_recipe(tmp_path, {"path": str(tmp_path / "blank"), "seq_len": 8}))
    broken = _docs(tmp_path, '{"input_ids": [1, 2, 3]}\n{"input_ids": [1, 2\n')
    with pytest.raises(ValueError, match=r"data.path .*could not read \['docs.jsonl'\].*well-formed"):
        _run(_recipe(tmp_path, {"path": broken, "seq_len": 8}))


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"task": "passkey", "seq_len": "abc"}, r"data.seq_len: a whole number >= 2, not 'abc'"),
        ({"task": "passkey", "seq_len": 0}, r"data.seq_len: a whole number >= 2, not 0"),
        ({"task": "passkey", "seq_len": 64.5}, r"data.seq_len: a whole number >= 2, not 64.5"),
        ({"task": "passkey", "stages": [{"seq_len": 64, "steps": -1}]}, r"data.stages\[0\].steps: a whole number >= 0"),
        ({"task": "passkey", "stages": [{"seq_len": 64}]}, r"data.stages\[0\]: give exactly seq_len and steps"),
        ({"task": "passkey", "seq_len": 64, "eval": {"seq_len": 64, "samples": 0}}, r"data.eval.samples: a positive"),
        ({"task": "passkey", "seq_len": 8, "eval": {"seq_len": 8, "samples": 1, "seed": -1}}, r"eval.seed: a whole"),
        ({"task": "passkey", "seq_len": 64, "eval": {"seq_len": 64, "sample": 1}}, r"data.eval: \{seq_len, samples"),
        ({"task": "passkey", "seq_len": 64, "stages": [{"seq_len": 64, "steps": 1}]}, r"seq_len or stages, not both"),
        ({"path": "x.jsonl", "seq_len": 64, "boundary": "documents"}, r"unknown keys \['boundary' \(boundaries\?\)\]"),
        ({"path": "x.jsonl", "seq_len": 64, "boundaries": "document"}, r"data.boundaries: one of"),
        ({"path": "x.jsonl", "seq_len": 64, "num_proc": 0}, r"data.num_proc: a positive whole number, not 0"),
        ({"task": "passkey", "seq_len": 64, "path": "x.jsonl"}, r"unknown keys \['path'\].*passkey task makes its own"),
        ({"task": "needle", "seq_len": 64}, r"data.task: 'passkey'"),
        ({"seq_len": 64}, r"data: give path"),
    ],
)
def test_bad_data_section_is_refused_when_the_recipe_is_read(tmp_path: Path, data: dict, message: str) -> None:
    """In the runner and in the planner alike: both read the section through ``resolve_data``."""
    from hf_ring.recipes import recipe_settings
    from hf_ring.recipes.recipe import parse_recipe

    path = _recipe(tmp_path, data)
    with pytest.raises(ValueError, match=message):
        parse_recipe(source=path)
    with pytest.raises(ValueError, match=message):
        recipe_settings(path)


def test_eval_seed_fixes_the_held_out_samples(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``data.eval.seed`` picks the held-out passkeys whatever the run's ``seed`` (runs of several
    seeds are scored on the same samples); without it, the run's seed picks them."""
    seeds: list[int] = []
    monkeypatch.setattr("hf_ring.recipes.run.passkey_accuracy", lambda trainer, n, k, seed: seeds.append(seed) or 1.0)
    ev = {"seq_len": 48, "samples": 2}
    _run(_recipe(tmp_path, {**PASSKEY, "eval": {**ev, "seed": 3}}), "--seed", "7")
    _run(_recipe(tmp_path, {**PASSKEY, "eval": ev}), "--seed", "7")
    assert seeds == [3, 3, 7, 7]  # before and after, each run
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["eval"] == {**ev, "seed": 7}


def test_length_flags_are_checked_too(tmp_path: Path) -> None:
    from hf_ring.recipes.recipe import parse_recipe

    with pytest.raises(ValueError, match=r"data.seq_len: a whole number >= 2, not 'abc'"):
        parse_recipe(["--data.seq_len", "abc"], source=_recipe(tmp_path))
    with pytest.raises(ValueError, match=r"per_device_train_batch_size=0: sequences per process and micro-step; give "
                                         r"a whole number >= 1 \(e.g. --per_device_train_batch_size 1\)"):  # fmt: skip
        parse_recipe(["--per_device_train_batch_size", "0"], source=_recipe(tmp_path))


# --- the model and LoRA sections -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("model", "lora", "message"),
    [
        ({"config": TINY, "dtyp": "float32"}, None, r"model: unknown keys \['dtyp' \(dtype\?\)\]"),
        ({"config": TINY, "dtype": "bf16"}, None, r"model.dtype: one of \['float32', 'bfloat16'"),
        ({"config": {k: v for k, v in TINY.items() if k != "model_type"}}, None, r"model.config: give its model_type"),
        ({"dtype": "float32"}, None, r"model: give config .* name_or_path .* or init_from"),
        ({"config": TINY}, {"r": 4, "lora_alpa": 8}, r"lora: \['lora_alpa' \(lora_alpha\?\)\] are not fields of "
                                                     r"peft.LoraConfig"),
        ({"config": TINY}, ["q_proj"], r"lora: a mapping of peft.LoraConfig fields"),
    ],
)
def test_bad_model_or_lora_section(tmp_path: Path, model: dict, lora: Any, message: str) -> None:
    from hf_ring.recipes.recipe import parse_recipe

    with pytest.raises(ValueError, match=message):
        parse_recipe(source=_recipe(tmp_path, model=model, lora=lora))


def test_unknown_config_fields_are_refused_before_the_model_is_built(tmp_path: Path, no_weights: None) -> None:
    """A typo in an inline config or in the overrides would otherwise train another model (the
    config class keeps unknown names as plain attributes). Names transformers converts itself
    (``rope_theta``) and aliases (``attribute_map``) are accepted."""
    typo = _recipe(tmp_path, model={"config": {**TINY, "intermediate_sizee": 96}})
    with pytest.raises(ValueError, match=r"model.config: \['intermediate_sizee' \(intermediate_size\?\)\] are not "
                                         r"fields of LlamaConfig"):  # fmt: skip
        _run(typo)
    over = _recipe(tmp_path, model={"config": TINY, "overrides": {"num_hiden_layers": 2}})
    with pytest.raises(ValueError, match=r"model.overrides: \['num_hiden_layers' \(num_hidden_layers\?\)\]"):
        _run(over)
    from hf_ring.recipes.recipe import model_config

    fine = model_config({"config": {**TINY, "rope_theta": 5e5}, "overrides": {"max_position_embeddings": 1024}})
    assert fine.rope_parameters["rope_theta"] == 5e5 and fine.max_position_embeddings == 1024
    moe = model_config({"config": {"model_type": "mixtral", "num_experts": 4}})  # an alias of num_local_experts
    assert moe.num_local_experts == 4


# --- a model the ring would refuse ---------------------------------------------------------------


def test_runner_takes_a_sliding_window_shorter_than_the_sequence(
    tmp_path: Path, no_weights: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Sliding windows are exact (the ring reads them from the model's own mask in the forward): the
    runner goes on to the data whatever the window."""

    def no_data(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the data was built before the model was refused")

    monkeypatch.setattr("hf_ring.recipes.run.build_train_dataset", no_data)
    mistral = {**TINY, "model_type": "mistral", "sliding_window": 32}
    with pytest.raises(AssertionError, match="the data was built"):
        _run(_recipe(tmp_path, model={"config": mistral}))
    from hf_ring.recipes.recipe import check_ring_model, model_config

    with pytest.raises(ValueError, match=r"model.attn_implementation 'sdpa': cp_size=2 needs 'ring'"):
        check_ring_model(model_config({"config": TINY}), "sdpa", cp_size=2, seq_len=48)


def test_check_model_is_check_layer_on_every_attention_module() -> None:
    """What the first forward would refuse, found without running the model: length-dependent checks
    at the given length only, CP-dependent ones at cp_size > 1 only."""
    check_model(tiny_model("llama", "ring"), cp_size=4, seq_len=1 << 20)  # exact: nothing to refuse
    qwen = tiny_model("qwen2", "ring", use_sliding_window=True, sliding_window=8, max_window_layers=1)
    check_model(qwen, cp_size=2, seq_len=16)  # windows: the ring reads them from the mask in the forward
    dynamic = tiny_model("llama", "ring", rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4})
    with pytest.raises(RingNotSupported, match="rope_type='dynamic'"):
        check_model(dynamic, cp_size=1)
    from transformers import AutoConfig, AutoModelForCausalLM

    small = {k: v for k, v in TINY.items() if k != "model_type"}
    config = AutoConfig.for_model("mixtral", num_local_experts=2, output_router_logits=True,
                                  router_aux_loss_coef=0.02, **small)  # fmt: skip
    moe = AutoModelForCausalLM.from_config(config, attn_implementation="ring")
    check_model(moe, cp_size=1)
    check_model(moe, cp_size=2)  # the router loss is computed over the CP group: nothing to refuse


def test_ring_trainer_refuses_the_model_when_it_is_handed_over(tmp_path: Path) -> None:
    from hf_ring import RingTrainer, RingTrainingArguments

    model = tiny_model("llama", "ring", rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4})
    args = RingTrainingArguments(str(tmp_path), use_cpu=True, report_to="none", max_steps=1)
    with pytest.raises(RingNotSupported, match="rope_type='dynamic'"):
        RingTrainer(model=model, args=args)
    RingTrainer(model=tiny_model("llama", "ring"), args=args)  # and takes an exact one
    with pytest.raises(RingNotSupported, match="rope_type='dynamic'"):  # through model_init as well
        RingTrainer(model_init=lambda: model, args=args)
    assert torch.is_grad_enabled()
