"""``hf-ring`` command line. ``hf-ring plan MODEL --seq-len 1M --gpus 8``: per-rank memory table,
the smallest CP size that fits, whether the ring's transfers hide behind compute, and the ring /
Ulysses / hybrid layouts of the CP group priced per layer with the recommended ``ulysses_size``.
``hf-ring train RECIPE [--field value ...]``: train a recipe on this process (``hf_ring.recipes.run``),
alone or under a launcher (``accelerate launch ... -m hf_ring.cli train RECIPE``, ``torchrun ... -m
hf_ring.cli train RECIPE``); ``hf-ring train --list`` shows the packaged recipes and launch configs.
``hf-ring eval needle|ppl MODEL ...``: long-context evaluation (``hf_ring.evaluation.cli``).

The options of ``hf-ring plan`` are the fields of ``hf_ring.planner.PlanSettings`` (their metadata
gives flag, help and parsing); an option given on the command line overrides a recipe's setting.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import MISSING, Field, fields, replace
from pathlib import Path
from typing import Any

from .planner import KNOWN_MODELS, ModelShape, PlanSettings, max_seq_len, model_shape, plan, smallest_cp, tokens
from .recipes import (
    description,
    launch_config_path,
    launch_configs,
    packaged_recipes,
    recipe_model,
    recipe_path,
    recipe_settings,
    write_recipe_memory,
)

__all__ = ["add_plan_options", "main", "tokens"]


def _option(f: Field) -> tuple[str, dict[str, Any]] | None:
    """The argparse flag and keyword arguments of one ``PlanSettings`` field (``None``: no option).
    Options default to ``SUPPRESS``, so the namespace holds only what was given."""
    meta = f.metadata
    if meta.get("cli", True) is False:
        return None
    name = "--" + f.name.replace("_", "-")
    default = meta.get("cli_default") if f.default is MISSING else f.default
    kw: dict[str, Any] = {"dest": f.name, "default": argparse.SUPPRESS, "help": meta["help"]}
    if isinstance(default, bool):
        # a switch that turns the default around: --offload, --no-checkpointing
        kw["action"] = "store_false" if default else "store_true"
        kw["help"] += " (default on; this option turns it off)" if default else " (default off)"
        return meta.get("flag", name if not default else "--no-" + name[2:]), kw
    flag = meta.get("flag", name)
    unit = meta.get("unit", 1)
    parse = meta.get("parse") or type(default)
    kw["type"] = parse if unit == 1 else (lambda text: float(text) * unit)
    if "choices" in meta:
        kw["choices"] = meta["choices"]
    else:
        kw["metavar"] = meta.get("metavar", flag[2:].upper().replace("-", "_"))
    if default is not None:
        kw["help"] += f" (default {default / unit:g})" if isinstance(default, float) else f" (default {default})"
    return flag, kw


def add_plan_options(parser: argparse.ArgumentParser) -> None:
    """One option per ``PlanSettings`` field."""
    for f in fields(PlanSettings):
        opt = _option(f)
        if opt is not None:
            parser.add_argument(opt[0], **opt[1])


def _model_and_settings(a: argparse.Namespace) -> tuple[ModelShape, PlanSettings]:
    """MODEL's shape and the settings to plan: a recipe's, or the defaults, with the options given."""
    given = {f.name: getattr(a, f.name) for f in fields(PlanSettings) if hasattr(a, f.name)}
    recipe = recipe_path(a.model)
    if recipe is not None:
        return recipe_model(recipe), replace(recipe_settings(recipe), **given)
    if "seq_len" not in given:
        raise SystemExit("hf-ring plan: --seq-len is required unless MODEL is a recipe")
    defaults = {f.name: f.metadata["cli_default"] for f in fields(PlanSettings) if "cli_default" in f.metadata}
    return model_shape(a.model), PlanSettings(**{**defaults, **given})


def cmd_plan(a: argparse.Namespace) -> int:
    """``hf-ring plan``: print (or ``--json``) the plan of a model or a recipe."""
    if a.write:
        recipe = recipe_path(a.model)
        if recipe is None:
            raise SystemExit("hf-ring plan: --write needs a recipe as MODEL")
        print(f"{recipe}: {write_recipe_memory(recipe)}")
    try:
        model, settings = _model_and_settings(a)
        best = smallest_cp(model, settings)
        p = plan(model, settings if settings.cp else replace(settings, cp=best or settings.gpus))
        longest = max_seq_len(model, replace(settings, cp=None)) if a.max_len else None
    except ValueError as e:  # an unknown model, or settings that contradict each other
        raise SystemExit(f"hf-ring plan: {e}") from None
    if a.json:
        out = p.as_dict()
        out["smallest_fitting_cp"] = best
        if longest is not None:
            out["max_seq_len"] = longest
        print(json.dumps(out, indent=2))
        return 0
    print(p.table())
    if best is None:
        print(f"  no CP size up to {p.gpus} fits: add GPUs, or try --offload, --tiled-mlp 8K, --sharding fsdp, LoRA")
    else:
        print(f"  smallest CP size that fits: {best}")
    if longest is not None:
        print(f"  longest sequence that fits with CP={p.gpus}: {longest:,} tokens")
    return 0


TRAIN_USAGE = """usage: hf-ring train RECIPE [--field value ...]   train a recipe on this process (each launched one)
       hf-ring train --list                       the packaged recipes and launch configs
       hf-ring train --config NAME                the path of a packaged launch config

RECIPE: a recipe YAML, or the name of a packaged one. Flags override any RingTrainingArguments field
(--max_steps 4 --output_dir runs/try) and any key of a section (--data.seq_len 4096, --lora.r 8).
Several processes:
  accelerate launch --config_file $(hf-ring train --config NAME) -m hf_ring.cli train RECIPE [...]
  torchrun --nproc_per_node N -m hf_ring.cli train RECIPE [...]
"""


def _command(path: Path) -> str:
    """The command a recipe's opening comment gives (its indented ``#   `` lines)."""
    lines = [line[1:].strip() for line in path.read_text().splitlines() if line.startswith("#   ")]
    return " ".join(line.removesuffix("\\").strip() for line in lines)


def train_listing() -> str:
    """What ``hf-ring train --list`` prints: recipes with their command, launch configs with their path."""
    out = ["Recipes (hf-ring train NAME [--field value ...]; hf-ring plan NAME prices its memory):"]
    for p in packaged_recipes():
        out += [f"  {p.stem}", f"      {description(p)}"]
        if _command(p):
            out.append(f"      $ {_command(p)}")
    launch = "accelerate launch --config_file $(hf-ring train --config NAME) -m hf_ring.cli train RECIPE"
    out += ["", f"Launch configs ({launch}):"]
    out += [f"  {p.stem:<20} {description(p)}\n  {'':<20} {p}" for p in launch_configs()]
    out += ["", "Under torchrun: torchrun --nproc_per_node N -m hf_ring.cli train RECIPE [--field value ...]"]
    return "\n".join(out)


def cmd_train(argv: list[str]) -> int:
    """``hf-ring train``: ``--list``, ``--config NAME``, or run a recipe (``hf_ring.recipes.run.main``)."""
    if not argv or argv[0] in ("-h", "--help"):
        print(TRAIN_USAGE)
        return 0 if argv else 2
    if argv[0] == "--list":
        print(train_listing())
        return 0
    if argv[0] == "--config":
        if len(argv) != 2:
            raise SystemExit("hf-ring train --config NAME: one launch config name (hf-ring train --list shows them)")
        try:
            print(launch_config_path(argv[1]))
        except FileNotFoundError as e:
            raise SystemExit(f"hf-ring train: {e}") from None
        return 0
    from .recipes.run import main as run_recipe

    run_recipe(argv)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``hf-ring``."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["train"]:  # its flags are the recipe's: parsed by hf_ring.recipes.recipe
        return cmd_train(argv[1:])
    ap = argparse.ArgumentParser(prog="hf-ring", description="hf_ring: ring attention for long-context fine-tuning")
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("train", help="train a recipe (hf-ring train --help, hf-ring train --list)", add_help=False)
    p = sub.add_parser(
        "plan",
        help="per-rank memory of a long-context fine-tuning run",
        description="Per-rank memory table, smallest CP size that fits, the ring overlap check and the ring / "
        "Ulysses layouts (communication time per layer, recommended ulysses_size). MODEL: a "
        f"known name ({', '.join(KNOWN_MODELS)}), a config.json or a directory with one, or a recipe (a .yaml "
        "file, or the name of one in hf_ring/recipes/; then its sequence length, CP size, LoRA and checkpointing "
        "settings are used, and the options given override them).",
    )
    p.add_argument("model")
    add_plan_options(p)
    p.add_argument("--max-len", action="store_true", help="also search the longest sequence that fits")
    p.add_argument("--json", action="store_true")
    p.add_argument("--write", action="store_true", help="write the figures into the recipe's memory_gb line")
    p.set_defaults(func=cmd_plan)
    from .evaluation.cli import add_eval_parser

    add_eval_parser(sub)
    a = ap.parse_args(argv)
    return a.func(a)


if __name__ == "__main__":
    sys.exit(main())
