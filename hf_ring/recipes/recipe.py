"""A recipe on the command line: ``hf-ring train RECIPE [--field value ...]``.

As in TRL's and the alignment handbook's scripts, the YAML holds ``RingTrainingArguments`` fields
(``cp_size``, ``per_device_train_batch_size``, ``learning_rate``, ``activation_checkpointing``,
``tiled_mlp``, ``output_dir``, ``report_to``, ...) plus the sections

* ``model``: ``name_or_path`` (hub name or folder), or ``config`` (a transformers config dict:
  random init), or ``init_from`` (a saved model to start from); ``dtype``; ``overrides`` (config
  fields); ``attn_implementation`` (default ``ring``);
* ``lora``: ``peft.LoraConfig`` fields (absent or ``null``: every weight trains);
* ``data``: see ``hf_ring.recipes.data`` (with a ``processor``: image and video examples,
  ``hf_ring.recipes.vlm_data``, and the model built by ``AutoModelForImageTextToText``);
* ``memory_gb``: the planner's estimate, for the reader (``hf-ring plan RECIPE --write``);
* ``trainer``: ``sft`` (default: the causal-LM loss, ``RingTrainer``), ``dpo`` (``RingDPOTrainer``:
  the fields are ``RingDPOConfig``'s, ``beta``, ``loss_type``, ...; the data section names
  preference pairs) or ``grpo`` (``RingGRPOTrainer``: ``RingGRPOConfig``'s fields,
  ``num_generations``, ``max_completion_length``, ...; the data section names prompts and reward
  functions, ``hf_ring.recipes.rewards``).

Flags override any field (``--max_steps 4 --output_dir X``, parsed by transformers'
``HfArgumentParser``) and any key of a section (``--data.seq_len 4096``, ``--lora.r 8``; values
read as YAML). The recipe file is read by ``hf_ring.recipes.read_recipe`` (a path or a packaged
recipe's name), the reader the planner uses too, and the model and data sections are resolved by the
planner's functions (``hf_ring.recipes.sections``), so ``hf-ring plan`` prices the model that trains.

Everything a recipe can get wrong is refused before any model weights load, naming the field:
unknown keys of each section, lengths that are not positive whole numbers (``parse_recipe``),
unknown fields of an inline model ``config`` or of ``overrides`` (``check_config_fields``), a model
the ring would refuse at the recipe's longest sequence (``check_ring_model``, on the meta device).
"""

from __future__ import annotations

import dataclasses
import inspect
import os
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, NoReturn

import torch
import yaml

from ..errors import RecipeError, did_you_mean
from ..trainer import RingTrainingArguments
from ..transformers.support import check_model
from .reader import read_recipe, recipe_path
from .sections import (
    DATA_KEYS,
    MODEL_KEYS,
    PATH_RULE,
    ModelSource,
    check_trainer,
    looks_local,
    resolve_data,
    resolve_model,
    resolve_paths,
    unknown_keys,
)

__all__ = [
    "ALIASES",
    "SECTIONS",
    "Recipe",
    "arguments_class",
    "auto_class",
    "build_model",
    "check_config_fields",
    "check_local",
    "check_lora",
    "check_ring_model",
    "model_config",
    "parse_recipe",
]

SECTIONS = ("model", "lora", "data", "memory_gb")
# names other trainers give to RingTrainingArguments fields: an unknown key named so is pointed there
ALIASES = {"batch_size": "per_device_train_batch_size", "micro_batch_size": "per_device_train_batch_size",
           "lr": "learning_rate", "steps": "max_steps", "train_steps": "max_steps", "epochs": "num_train_epochs",
           "grad_accum": "gradient_accumulation_steps", "gradient_accumulation": "gradient_accumulation_steps",
           "output": "output_dir", "out_dir": "output_dir", "warmup": "warmup_steps", "context_parallel": "cp_size",
           "cp": "cp_size", "ulysses": "ulysses_size"}  # fmt: skip


@dataclass
class Recipe:
    """A parsed recipe: the training arguments and the sections."""

    args: RingTrainingArguments
    model: dict[str, Any]
    lora: dict[str, Any] | None
    data: dict[str, Any]
    memory_gb: dict[str, Any] | None
    source: str
    path: Path | None = None  # the recipe file
    trainer: str = "sft"  # one of sections.TRAINERS


def _split_section_flags(argv: list[str]) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """``--section.key value`` / ``--section.key=value`` flags, and the remaining arguments."""
    over: dict[str, dict[str, Any]] = {}
    rest: list[str] = []
    i = 0
    while i < len(argv):
        a = argv[i]
        head = a[2:].split("=", 1)[0] if a.startswith("--") else ""
        if "." in head and head.split(".", 1)[0] in SECTIONS:
            section, key = head.split(".", 1)
            if "=" in a:
                value = a.split("=", 1)[1]
            else:
                if i + 1 >= len(argv):
                    raise RecipeError(f"{a}: give it a value ({a} VALUE, or {a}=VALUE)")
                i += 1
                value = argv[i]
            try:
                over.setdefault(section, {})[key] = yaml.safe_load(value)
            except yaml.YAMLError as e:
                raise RecipeError(f"{a} {value!r}: not a YAML value ({' '.join(str(e).split())})") from None
        else:
            rest.append(a)
        i += 1
    return over, rest


def _flag_error(message: str) -> NoReturn:
    """``HfArgumentParser.error``: one line instead of a usage listing of every field."""
    raise RecipeError(f"{message}; hf-ring train RECIPE --help lists the flags")


def _flags(names: set[str]) -> list[str]:
    """The flags ``hf-ring train`` takes: a field's, or a key of the model or data section."""
    return [f"--{n}" for n in names] + [f"--model.{k}" for k in MODEL_KEYS] + [f"--data.{k}" for k in DATA_KEYS]


def arguments_class(trainer: str) -> type:
    """The arguments a recipe's fields fill for ``trainer`` (``sections.TRAINERS``): ``RingTrainingArguments``,
    ``RingDPOConfig`` or ``RingGRPOConfig`` (these two import TRL)."""
    if trainer == "dpo":
        from ..trainer.dpo import RingDPOConfig

        return RingDPOConfig
    if trainer == "grpo":
        from ..trainer.grpo import RingGRPOConfig

        return RingGRPOConfig
    return RingTrainingArguments


def parse_recipe(argv: list[str] | None = None, *, source: str | os.PathLike | None = None) -> Recipe:
    """Parse ``RECIPE [--field value ...]`` (``source`` given: the flags only). The sections are
    checked here, before any data or model is built: the model section (``resolve_model``), the data
    section (``resolve_data``), the LoRA fields against ``peft.LoraConfig``, and the numbers of
    ``RingTrainingArguments``; every refusal is a ``RecipeError`` naming the field, the value and the
    fix. Relative paths of the model and data sections are read from the recipe's folder, else the
    working directory, when the recipe says them, from the working directory when flags do
    (``sections.resolve_paths``)."""
    argv = list(argv or [])
    if source is None:
        if not argv or argv[0].startswith("-"):
            raise RecipeError("give a recipe first: hf-ring train RECIPE [--field value ...] (hf-ring train --list "
                              "shows the packaged ones)")  # fmt: skip
        source, argv = argv[0], argv[1:]
    path = recipe_path(source)
    raw = read_recipe(source)
    where = f"recipe {str(source)!r}"
    section_flags, argv = _split_section_flags(argv)
    sections = {k: raw.pop(k, None) for k in SECTIONS}
    for name, values in section_flags.items():
        values = resolve_paths(name, values, [Path.cwd()], path)  # flags: from the working directory
        sections[name] = {**(sections[name] or {}), **values}
    try:
        trainer = check_trainer(raw.pop("trainer", None))
    except ValueError as e:
        raise RecipeError(f"{where}: {e}") from None
    cls = arguments_class(trainer)
    names = {f.name for f in fields(cls) if f.init}
    unknown = unknown_keys(raw, names | set(SECTIONS) | {"trainer"}, ALIASES)
    if unknown:
        raise RecipeError(f"{where}: {unknown} are neither {cls.__name__} fields nor sections {SECTIONS} (trainer: "
                          f"{trainer}); fix the names (hf-ring train RECIPE --help lists the fields)")  # fmt: skip
    if sections["model"] is None or sections["data"] is None:
        raise RecipeError(f"{where}: needs a model section and a data section")
    try:
        resolve_model(sections["model"], path)
        data = resolve_data(sections["data"], trainer)
        stages = data["stages"]
        check_lora(sections["lora"])
        if trainer == "grpo":  # the named functions import (a typo is refused before any model loads)
            from .rewards import reward_functions

            reward_functions(data["rewards"])
    except ValueError as e:
        raise RecipeError(f"{where}: {e}") from None
    if trainer == "dpo":  # DPO truncates each prompt + completion to max_length: the planned length
        raw.setdefault("max_length", stages[0]["seq_len"])
    if not torch.cuda.is_available():
        raw.setdefault("use_cpu", True)  # else Trainer ignores the launcher's processes on a CPU-only machine
    if "max_steps" not in raw and all(s["steps"] for s in stages):
        raw["max_steps"] = sum(s["steps"] for s in stages)
    from transformers import HfArgumentParser

    parser = HfArgumentParser(cls)
    parser.error = _flag_error  # type: ignore[method-assign]
    parser.set_defaults(**raw)
    try:
        args, rest = parser.parse_args_into_dataclasses(args=argv, return_remaining_strings=True)
    except ValueError as e:  # RingTrainingArguments' and TrainingArguments' own checks of the values
        if "world size" in str(e):  # RingGRPOConfig lays out its generation batch over the launched processes
            raise RecipeError(f"{where}: {e}: launch a multiple of cp_size processes (torchrun --nproc_per_node "
                              f"N -m hf_ring.cli train {source}), or set --cp_size 1") from e  # fmt: skip
        raise RecipeError(f"{where}: {e}") from e
    if rest:
        flag = next((a for a in rest if a.startswith("-")), rest[0])
        raise RecipeError(
            f"{where}: unknown flag {flag}{did_you_mean(flag.split('=')[0], _flags(names))}; flags are "
            "RingTrainingArguments fields (--max_steps 4) or keys of a section (--data.seq_len 4096)"
        )
    if args.output_dir is None:
        raise RecipeError(f"{where}: output_dir is not set: give output_dir in the recipe, or --output_dir runs/NAME")
    if args.max_steps <= 0:
        raise RecipeError(
            f"{where}: max_steps={args.max_steps}: a recipe trains a set number of optimizer steps; give "
            "--max_steps N (e.g. --max_steps 100), or steps to every data stage (data.stages: [{seq_len, steps}])"
        )
    seq_len = max(s["seq_len"] for s in stages)
    if trainer == "grpo" and args.max_completion_length >= seq_len:
        raise RecipeError(f"{where}: max_completion_length={args.max_completion_length} leaves no room for the "
                          f"prompt in data.seq_len={seq_len} (prompt + completion); raise data.seq_len or lower "
                          "max_completion_length")  # fmt: skip
    if trainer == "dpo" and args.max_length is not None and args.max_length > seq_len:
        raise RecipeError(f"{where}: max_length={args.max_length} is longer than data.seq_len={seq_len}, the length "
                          "the planner prices; raise data.seq_len, or drop max_length (it defaults to data.seq_len)")
    return Recipe(args, sections["model"], sections["lora"], sections["data"], sections["memory_gb"], str(source),
                  path, trainer)  # fmt: skip


def check_lora(lora: Any) -> None:
    """Refuse a ``lora`` section that is not a mapping of ``peft.LoraConfig`` fields."""
    if lora is None:
        return
    if not isinstance(lora, dict):
        raise RecipeError(f"lora: a mapping of peft.LoraConfig fields, or null (every weight trains), not {lora!r}")
    from peft import LoraConfig

    unknown = unknown_keys(lora, {f.name for f in fields(LoraConfig) if f.init})
    if unknown:
        raise RecipeError(f"lora: {unknown} are not fields of peft.LoraConfig (r, lora_alpha, target_modules, ...)")


def check_config_fields(config: Any, given: dict[str, Any], where: str) -> None:
    """Refuse the fields of ``given`` (a recipe's ``model.config`` or ``model.overrides``) that
    ``config``'s class does not define: transformers keeps them as plain attributes that no layer
    reads, so a typo (``intermediate_sizee``) would train another model than the one written."""
    cls = type(config)
    known = set(getattr(cls, "attribute_map", {})) | set(inspect.signature(cls.__init__).parameters)
    if dataclasses.is_dataclass(cls):
        known |= {f.name for f in dataclasses.fields(cls)}
    try:
        known |= set(cls().to_dict())
    except Exception:  # a config class that needs arguments: its fields and signature only
        pass
    stored = set(config.to_dict())  # legacy names that transformers converts (rope_theta, ...) are not kept
    unknown = unknown_keys({k: v for k, v in given.items() if k in stored}, known)
    if unknown:
        raise RecipeError(f"{where}: {unknown} are not fields of {cls.__name__}; fix the names, or drop them")


def check_local(field: str, ref: str | None) -> None:
    """Refuse ``ref`` (the value of ``field``) when it can only be a local path and names nothing:
    before transformers or datasets would take it for a hub name and retry a download."""
    if ref is not None and looks_local(ref) and not Path(ref).expanduser().exists():
        raise RecipeError(f"{field} {ref!r}: no such file or folder ({PATH_RULE}: {Path.cwd()}); fix the path")


def _resolved(section: dict[str, Any], where: Path | None) -> tuple[ModelSource, Any]:
    from transformers import AutoConfig

    src = resolve_model(section, where)
    if src.found != "recipe":
        check_local("model.init_from" if section.get("init_from") else "model.name_or_path", src.weights)
    if src.weights is None:
        conf = dict(src.fields or {})
        config = AutoConfig.for_model(conf.pop("model_type"), **conf)
        check_config_fields(config, section["config"], "model.config")
    elif src.found == "recipe":
        raise RecipeError(
            f"model.init_from {src.weights!r}: no saved model there yet; it is written by {src.writer.name} "
            f"(hf-ring train {src.writer.stem}): run that first"
        )
    else:
        try:
            config = AutoConfig.from_pretrained(src.weights, **src.overrides)
        except OSError as e:
            key = "init_from" if section.get("init_from") else "name_or_path"
            raise RecipeError(f"model.{key} {src.weights!r}: no model config found there ({e})") from None
        if src.found == "inline":  # a config given with init_from describes the saved model
            saved = config.to_dict()
            clash = sorted(k for k, v in section["config"].items() if k in saved and saved[k] != v)
            if clash:
                raise RecipeError(f"model.config disagrees with the config of init_from {src.weights!r} on {clash}; "
                                  "drop them from model.config, or put the changes in model.overrides")  # fmt: skip
    if src.overrides:
        check_config_fields(config, src.overrides, "model.overrides")
    return src, config


def model_config(section: dict[str, Any], where: Path | None = None) -> Any:
    """The transformers config of a model section (``where``: the recipe file), resolved as the
    planner resolves it (``sections.resolve_model``), its fields checked against the config class;
    for ``name_or_path`` / ``init_from``: their ``config.json``, downloaded when it is a hub name. No
    weights are read."""
    return _resolved(section, where)[1]


def auto_class(vision: bool = False) -> Any:
    """The transformers auto class a recipe builds its model with: ``AutoModelForImageTextToText``
    (the vision tower included) for image / video data (``vision``), else ``AutoModelForCausalLM``."""
    import transformers

    return transformers.AutoModelForImageTextToText if vision else transformers.AutoModelForCausalLM


def check_ring_model(config: Any, attn: str, cp_size: int, seq_len: int, vision: bool = False) -> None:
    """What ``RingTrainer`` would refuse about this model at ``seq_len`` tokens over ``cp_size``
    ranks, found on the model built on the meta device (no memory, no weights); ``vision``: the
    vision-language model (``auto_class``)."""
    if attn != "ring":
        if cp_size > 1:
            raise RecipeError(
                f"model.attn_implementation {attn!r}: cp_size={cp_size} needs 'ring' (each rank holds only a shard "
                "of the sequence); remove attn_implementation or set cp_size: 1"
            )
        return
    with torch.device("meta"):
        model = auto_class(vision).from_config(config, attn_implementation=attn)
    check_model(model, cp_size, seq_len)


def build_model(
    section: dict[str, Any], lora: dict[str, Any] | None, seed: int = 0, where: Path | None = None,
    vision: bool = False,
) -> torch.nn.Module:
    """The model of a recipe: loaded (``name_or_path``, ``init_from``) or random-initialised with
    ``seed`` (``config``), with ``attn_implementation`` (default ``"ring"``), and LoRA adapters
    through PEFT when ``lora`` is given; ``vision``: the vision-language model (``auto_class``: image /
    video data), its vision tower frozen unless LoRA targets it."""
    cls = auto_class(vision)
    dtype = getattr(torch, section.get("dtype", "float32"))
    attn = section.get("attn_implementation", "ring")
    src, config = _resolved(section, where)
    if src.weights is None:
        torch.manual_seed(seed)
        model = cls.from_config(config, attn_implementation=attn, dtype=dtype)
    else:
        model = cls.from_pretrained(src.weights, config=config, attn_implementation=attn, dtype=dtype)
    if lora:
        from peft import LoraConfig, get_peft_model

        torch.manual_seed(seed)
        model = get_peft_model(model, LoraConfig(**lora))
    return model
