"""A recipe on the command line: ``recipes/train.py RECIPE [--field value ...]``.

As in TRL's and the alignment handbook's scripts, the YAML holds ``RingTrainingArguments`` fields
(``cp_size``, ``per_device_train_batch_size``, ``learning_rate``, ``activation_checkpointing``,
``tiled_mlp``, ``output_dir``, ``report_to``, ...) plus the sections

* ``model``: ``name_or_path`` (hub name or folder), or ``config`` (a transformers config dict:
  random init), or ``init_from`` (a saved model to start from); ``dtype``; ``overrides`` (config
  fields); ``attn_implementation`` (default ``ring``);
* ``lora``: ``peft.LoraConfig`` fields (absent or ``null``: every weight trains);
* ``data``: see ``hf_ring.recipes.data``;
* ``memory_gb``: the planner's estimate, for the reader (``hf-ring plan RECIPE --write``).

Flags override any field (``--max_steps 4 --output_dir X``, parsed by transformers'
``HfArgumentParser``) and any key of a section (``--data.seq_len 4096``, ``--lora.r 8``; values
read as YAML). The recipe file is read by ``hf_ring.recipes.read_recipe`` (a path or a packaged
recipe's name), the reader the planner uses too.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, fields
from typing import Any

import torch
import yaml

from ..trainer import RingTrainingArguments
from .data import stages_of
from .reader import read_recipe

__all__ = ["SECTIONS", "Recipe", "build_model", "model_config", "parse_recipe"]

SECTIONS = ("model", "lora", "data", "memory_gb")


@dataclass
class Recipe:
    """A parsed recipe: the training arguments and the sections."""

    args: RingTrainingArguments
    model: dict[str, Any]
    lora: dict[str, Any] | None
    data: dict[str, Any]
    memory_gb: dict[str, Any] | None
    source: str


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
                    raise SystemExit(f"{a}: needs a value")
                i += 1
                value = argv[i]
            over.setdefault(section, {})[key] = yaml.safe_load(value)
        else:
            rest.append(a)
        i += 1
    return over, rest


def parse_recipe(argv: list[str] | None = None, *, source: str | os.PathLike | None = None) -> Recipe:
    """Parse ``[RECIPE] [--field value ...]`` (``source`` given: the flags only)."""
    argv = list(argv or [])
    if source is None:
        head = argparse.ArgumentParser(prog="recipes/train.py", add_help=False)
        head.add_argument("recipe", help="a recipe YAML, or the name of one in hf_ring/recipes/")
        known, argv = head.parse_known_args(argv)
        source = known.recipe
    raw = read_recipe(source)
    section_flags, argv = _split_section_flags(argv)
    sections = {k: raw.pop(k, None) for k in SECTIONS}
    for name, values in section_flags.items():
        sections[name] = {**(sections[name] or {}), **values}
    names = {f.name for f in fields(RingTrainingArguments) if f.init}
    unknown = sorted(set(raw) - names)
    if unknown:
        raise ValueError(
            f"recipe {str(source)!r}: {unknown} are neither RingTrainingArguments fields nor sections {SECTIONS}"
        )
    if sections["model"] is None or sections["data"] is None:
        raise ValueError(f"recipe {str(source)!r}: needs a model section and a data section")
    if not torch.cuda.is_available():
        raw.setdefault("use_cpu", True)  # else Trainer ignores the launcher's processes on a CPU-only machine
    stages = stages_of(sections["data"])
    if "max_steps" not in raw and all(s["steps"] for s in stages):
        raw["max_steps"] = sum(s["steps"] for s in stages)
    from transformers import HfArgumentParser

    parser = HfArgumentParser(RingTrainingArguments)
    parser.set_defaults(**raw)
    (args,) = parser.parse_args_into_dataclasses(args=argv)
    if args.output_dir is None:
        raise ValueError(f"recipe {str(source)!r}: set output_dir")
    if args.max_steps <= 0:
        raise ValueError(f"recipe {str(source)!r}: set max_steps (or give every data stage its steps)")
    return Recipe(args, sections["model"], sections["lora"], sections["data"], sections["memory_gb"], str(source))


def model_config(section: dict[str, Any]) -> Any:
    """The transformers config a model section describes (for ``name_or_path`` / ``init_from``: its
    ``config.json``, downloaded when it is a hub name; no weights)."""
    from transformers import AutoConfig

    overrides = dict(section.get("overrides") or {})
    if "config" in section and not section.get("init_from"):
        conf = dict(section["config"])
        return AutoConfig.for_model(conf.pop("model_type"), **conf, **overrides)
    return AutoConfig.from_pretrained(section.get("init_from") or section["name_or_path"], **overrides)


def build_model(section: dict[str, Any], lora: dict[str, Any] | None, seed: int = 0) -> torch.nn.Module:
    """The model of a recipe: loaded (``name_or_path``, ``init_from``) or random-initialised with
    ``seed`` (``config``), with ``attn_implementation`` (default ``"ring"``), and LoRA adapters
    through PEFT when ``lora`` is given."""
    from transformers import AutoModelForCausalLM

    dtype = getattr(torch, section.get("dtype", "float32"))
    attn = section.get("attn_implementation", "ring")
    config = model_config(section)
    if "config" in section and not section.get("init_from"):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=dtype)
    else:
        ref = section.get("init_from") or section["name_or_path"]
        model = AutoModelForCausalLM.from_pretrained(ref, config=config, attn_implementation=attn, dtype=dtype)
    if lora:
        from peft import LoraConfig, get_peft_model

        torch.manual_seed(seed)
        model = get_peft_model(model, LoraConfig(**lora))
    return model
