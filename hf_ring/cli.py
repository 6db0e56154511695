"""``hf-ring`` command line. ``hf-ring plan MODEL --seq-len 1M --gpus 8``: per-rank memory table,
the smallest CP size that fits, whether the ring's transfers hide behind compute, and the grids of
the CP group (ring, Ulysses, Ulysses x ring) priced per layer with the recommended ``ulysses_size``.
``hf-ring train RECIPE [--field value ...]``: train a recipe on this process (``hf_ring.recipes.run``),
alone or under a launcher (``accelerate launch ... -m hf_ring.cli train RECIPE``, ``torchrun ... -m
hf_ring.cli train RECIPE``); ``hf-ring train --list`` shows the packaged recipes and launch configs.
``hf-ring eval needle|ppl MODEL ...``: long-context evaluation (``hf_ring.evaluation.commands``).

The options of ``hf-ring plan`` are the fields of ``hf_ring.planner.PlanSettings`` (their metadata
gives flag, help and parsing); an option given on the command line overrides a recipe's setting.

``--help``, ``train --list``, ``train --config`` and ``plan`` import neither torch nor transformers.
A user's mistake (``hf_ring.errors.is_user_error``) ends a command with one line naming the field,
the value and the fix, from one process (rank 0 under a launcher), and exit status 1;
``HF_RING_DEBUG=1`` shows its traceback instead.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import MISSING, Field, fields, replace
from pathlib import Path
from typing import Any, NoReturn

from .errors import UserError, debug, did_you_mean, exit_for, is_user_error, reports
from .planner import KNOWN_MODELS, ModelShape, PlanSettings, max_seq_len, model_shape, plan, smallest_cp, tokens
from .recipes import (
    description,
    launch_config_path,
    launch_configs,
    missing_recipe,
    packaged_recipes,
    recipe_model,
    recipe_notes,
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
    kw["type"] = _bounded(parse if unit == 1 else (lambda text: float(text) * unit), meta)
    if "choices" in meta:
        kw["choices"] = meta["choices"]
    else:
        kw["metavar"] = meta.get("metavar", flag[2:].upper().replace("-", "_"))
    if default is not None:
        kw["help"] += f" (default {default / unit:g})" if isinstance(default, float) else f" (default {default})"
    return flag, kw


def _bounded(parse: Any, meta: Any) -> Any:
    """``parse``, refusing a number below the field's ``least`` or not above its ``above``."""
    least, above = meta.get("least"), meta.get("above")
    if least is None and above is None:
        return parse

    def read(text: str) -> Any:
        value = parse(text)
        if (least is not None and value < least) or (above is not None and value <= above):
            bound = f">= {least}" if least is not None else f"> {above}"
            raise argparse.ArgumentTypeError(f"{text}: give a number {bound}")
        return value

    read.__name__ = getattr(parse, "__name__", "number")  # argparse names it in "invalid ... value"
    return read


class _Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose mistakes are user errors (one line, ``hf_ring.errors``), with the
    closest valid name for an unknown subcommand, choice or option."""

    def error(self, message: str) -> NoReturn:  # type: ignore[override]
        raise UserError(message + self._nearest(message))

    def _nearest(self, message: str) -> str:
        if "invalid choice: " in message:
            given = message.split("invalid choice: ", 1)[1].split(" (choose from", 1)[0].strip("'\"")
            choices = message.split("(choose from", 1)[1] if "(choose from" in message else ""
            return did_you_mean(given, [c.strip(" '\")") for c in choices.split(",")])
        if message.startswith("unrecognized arguments: "):
            flags = [f for f in message.split(": ", 1)[1].split() if f.startswith("--")]
            return did_you_mean(flags[0].split("=")[0], _flags(self)) if flags else ""
        return ""


def _flags(parser: argparse.ArgumentParser) -> set[str]:
    """Every option string of ``parser`` and of its subcommands."""
    out: set[str] = set()
    for action in parser._actions:
        out.update(s for s in action.option_strings if s.startswith("--"))
        for sub in getattr(action, "choices", None) or {}:
            if isinstance(action.choices, dict) and isinstance(action.choices[sub], argparse.ArgumentParser):
                out |= _flags(action.choices[sub])
    return out


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
    model = _model(a.model)
    if "seq_len" not in given:
        raise UserError(f"--seq-len: give the tokens per sequence to plan {a.model} with (--seq-len 128K); "
                        "only a recipe states its own")  # fmt: skip
    defaults = {f.name: f.metadata["cli_default"] for f in fields(PlanSettings) if "cli_default" in f.metadata}
    return model, PlanSettings(**{**defaults, **given})


def _model(name: str) -> ModelShape:
    """The shape of a model MODEL names (a known name, a config.json or a folder with one); an
    unknown name is refused with the closest recipe or known model."""
    try:
        return model_shape(name)
    except ValueError:
        pass
    if Path(name).suffix in (".yaml", ".yml"):  # a recipe file was meant
        raise UserError(missing_recipe(name))
    names = [p.stem for p in packaged_recipes()] + list(KNOWN_MODELS)
    raise UserError(
        f"MODEL {name!r}: no recipe, known model or config.json of that name{did_you_mean(name, names)}; "
        "hf-ring train --list shows the recipes, hf-ring plan --help the known models"
    )


def _decode_table(a: argparse.Namespace) -> int:
    """``hf-ring plan MODEL --decode``: per-rank memory of greedy decoding under CP (``hf-ring eval ruler``)."""
    from .planner.decode import decode_cache_bytes
    from .planner.settings import format_tokens

    recipe = recipe_path(a.model)
    model = recipe_model(recipe) if recipe is not None else _model(a.model)
    lengths = [a.seq_len] if getattr(a, "seq_len", None) else [2**17, 2**18, 2**19, 2**20]
    cps = [a.cp] if getattr(a, "cp", None) else [1, 8, 16, 32]
    rows = [{"tokens": n, "cp": cp, **decode_cache_bytes(model, n, cp)} for n in lengths for cp in cps]
    if a.json:
        print(json.dumps({"model": model.name, "decode_cache_bytes_per_rank": rows}, indent=2))
        return 0
    gib = 2**30
    print(f"{model.name}: KV cache per rank for greedy decoding under CP (bf16, batch 1, 128 new tokens; GiB)")
    print(f"  {'tokens':>7} {'CP':>4} {'shard':>8} {'tail':>8} {'states':>8} {'total':>8} {'one process':>12}")
    for r in rows:
        print(f"  {format_tokens(r['tokens']):>7} {r['cp']:>4} {r['kv_shard'] / gib:>8.2f} {r['kv_tail'] / gib:>8.3f} "
              f"{r['states'] / gib:>8.3f} {r['total'] / gib:>8.2f} {r['one_process'] / gib:>12.1f}")  # fmt: skip
    return 0


def cmd_plan(a: argparse.Namespace) -> int:
    """``hf-ring plan``: print (or ``--json``) the plan of a model or a recipe."""
    if a.decode:
        return _decode_table(a)
    if a.write:
        recipe = recipe_path(a.model)
        if recipe is None:
            raise UserError(f"--write: MODEL {a.model!r} is not a recipe; --write rewrites a recipe's memory_gb line")
        print(f"{recipe}: {write_recipe_memory(recipe)}")
    model, settings = _model_and_settings(a)
    try:
        best = smallest_cp(model, settings)
        p = plan(model, settings if settings.cp else replace(settings, cp=best or settings.gpus))
        longest = max_seq_len(model, replace(settings, cp=None)) if a.max_len else None
    except ValueError as e:  # settings that contradict each other, each message naming them
        raise UserError(str(e)) from e
    recipe = recipe_path(a.model)
    if recipe is not None:  # DPO / GRPO: what the figures count and leave out
        p.notes.extend(recipe_notes(recipe, p.settings))
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
(--max_steps 4 --output_dir runs/try) and any key of a section (--data.seq_len 4096, --lora.r 8);
hf-ring train RECIPE --help lists every field. Relative paths of the model and data sections are
read from the recipe's folder when written in the recipe, from the working directory when given
as flags; output_dir is in the working directory. Run again, the same command resumes from the
newest checkpoint in output_dir and says from which step; an output_dir holding an earlier run
without checkpoints is refused unless --overwrite_output_dir true (--resume_from_checkpoint no:
start over). A mistake prints one line; HF_RING_DEBUG=1 shows its traceback.
Several processes:
  accelerate launch --config_file $(hf-ring train --config NAME) -m hf_ring.cli train RECIPE [...]
  torchrun --nproc_per_node N -m hf_ring.cli train RECIPE [...]
"""


def _recipe_command(path: Path) -> str:
    """The command a recipe's opening comment gives (its indented ``#   `` lines)."""
    lines = [line[1:].strip() for line in path.read_text().splitlines() if line.startswith("#   ")]
    return " ".join(line.removesuffix("\\").strip() for line in lines)


def train_listing() -> str:
    """What ``hf-ring train --list`` prints: recipes with their command, launch configs with their path."""
    out = ["Recipes (hf-ring train NAME [--field value ...]; hf-ring plan NAME prices its memory):"]
    for p in packaged_recipes():
        out += [f"  {p.stem}", f"      {description(p)}"]
        if _recipe_command(p):
            out.append(f"      $ {_recipe_command(p)}")
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
            raise UserError("--config NAME: give one launch config name (hf-ring train --list shows them)")
        try:
            print(launch_config_path(argv[1]))
        except FileNotFoundError as e:
            raise UserError(str(e)) from None
        return 0
    from .recipes.run import main as run_recipe

    run_recipe(argv)
    return 0


def _command(argv: list[str]) -> str:
    """``hf-ring`` and the subcommand of ``argv`` (``hf-ring train``, ``hf-ring eval needle``), for messages."""
    if argv[:1] == ["eval"] and argv[1:2] and argv[1] in ("needle", "ppl", "plot"):
        return f"hf-ring eval {argv[1]}"
    return f"hf-ring {argv[0]}" if argv[:1] and argv[0] in ("train", "plan", "eval") else "hf-ring"


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``hf-ring``: a user's mistake ends it with one line (``hf_ring.errors``)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        return _main(argv)
    except SystemExit as e:  # a message of our own (argparse prints its own before): one rank says it
        if isinstance(e.code, str) and not reports():
            raise SystemExit(1) from None
        raise
    except Exception as e:
        if debug() or not is_user_error(e):
            raise
        raise exit_for(e, _command(argv)) from None


EPILOG = ("A mistake in what you give (recipe, flags, data, model, CP layout) prints one line naming the field, "
          "the value and the fix; HF_RING_DEBUG=1 shows its traceback.")  # fmt: skip


def _main(argv: list[str]) -> int:
    if argv[:1] == ["train"]:  # its flags are the recipe's: parsed by hf_ring.recipes.recipe
        return cmd_train(argv[1:])
    ap = _Parser(prog="hf-ring", description="hf_ring: ring attention for long-context fine-tuning", epilog=EPILOG)
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("train", help="train a recipe (hf-ring train --help, hf-ring train --list)", add_help=False)
    p = sub.add_parser(
        "plan",
        help="per-rank memory of a long-context fine-tuning run",
        description="Per-rank memory table, smallest CP size that fits, the ring overlap check and the ring / "
        "Ulysses grids (communication time per layer, recommended ulysses_size). MODEL: a "
        f"known name ({', '.join(KNOWN_MODELS)}), a config.json or a directory with one, or a recipe (a .yaml "
        "file, or the name of one in hf_ring/recipes/; then its sequence length, CP size, LoRA and checkpointing "
        "settings are used, and the options given override them).",
    )
    p.add_argument("model")
    add_plan_options(p)
    p.add_argument("--max-len", action="store_true", help="also search the longest sequence that fits")
    p.add_argument("--json", action="store_true")
    p.add_argument("--write", action="store_true", help="write the figures into the recipe's memory_gb line")
    p.add_argument("--decode", action="store_true", help="the per-rank KV cache of greedy decoding under CP instead "
                   "(hf-ring eval ruler), at --seq-len (default 128K-1M) and --cp (default 1, 8, 16, 32)")  # fmt: skip
    p.set_defaults(func=cmd_plan)
    from .evaluation.commands import add_eval_parser

    add_eval_parser(sub)
    if not argv:
        ap.print_help(sys.stderr)
        return 2
    a = ap.parse_args(argv)
    return a.func(a)


if __name__ == "__main__":
    sys.exit(main())
