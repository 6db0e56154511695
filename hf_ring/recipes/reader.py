"""Find and read a recipe, and the planner's view of it.

A recipe holds ``RingTrainingArguments`` fields (``cp_size``, ``per_device_train_batch_size``,
``activation_checkpointing``, ``tiled_mlp``, ``learning_rate``, ``output_dir``, ...) and the sections
``model`` (``config | name_or_path | init_from``, ``dtype``, ``overrides``), ``lora`` (PEFT
``LoraConfig`` fields), ``data`` (``seq_len`` or ``stages: [{seq_len, steps}]``, the source; see
``hf_ring.recipes.data``) and ``memory_gb``, the planner's memory per GPU.

``read_recipe`` parses one (the training runner, ``hf_ring.recipes.recipe``, uses it; both resolve
the model and data sections through ``hf_ring.recipes.sections``);
``recipe_model``, ``recipe_model_config``, ``recipe_settings`` and ``recipe_plan`` give the
planner's view of it; ``write_recipe_memory`` writes the planner's figures back. Imports neither
torch nor transformers (the package ``hf_ring`` itself does).
"""

from __future__ import annotations

import os
from dataclasses import replace
from importlib.resources import files
from pathlib import Path
from typing import Any

import yaml

from ..errors import RecipeError, RecipeNotFound, did_you_mean
from ..planner import (
    LORA_TARGETS,
    GiB,
    ModelShape,
    Plan,
    PlanSettings,
    model_shape,
    parse_ulysses_size,
    plan,
)
from .sections import PATH_KEYS, ModelSource, check_trainer, resolve_data, resolve_model, resolve_paths

__all__ = [
    "RECIPES_DIR",
    "description",
    "launch_config_path",
    "launch_configs",
    "missing_recipe",
    "packaged_recipes",
    "read_recipe",
    "recipe_memory",
    "recipe_model",
    "recipe_model_config",
    "recipe_notes",
    "recipe_path",
    "recipe_plan",
    "recipe_settings",
    "write_recipe_memory",
]

Source = str | os.PathLike

# a regular package on the file system (wheel or source tree): its resources are plain files
RECIPES_DIR = Path(str(files(__package__)))
_SUFFIXES = (".yaml", ".yml")


def packaged_recipes() -> list[Path]:
    """The recipes shipped with hf_ring, sorted by name."""
    return sorted(RECIPES_DIR.glob("*.yaml"))


def launch_configs() -> list[Path]:
    """The accelerate launch configs shipped with hf_ring (``hf_ring/recipes/accelerate/*.yaml``),
    sorted by name: ``accelerate launch --config_file PATH -m hf_ring.cli train RECIPE``."""
    return sorted((RECIPES_DIR / "accelerate").glob("*.yaml"))


def launch_config_path(name: Source) -> Path:
    """The launch config ``name`` names: a packaged one's name (``cpu-4proc``, with or without
    ``.yaml``) or an existing file."""
    p = Path(name)
    for cand in (RECIPES_DIR / "accelerate" / p.name, RECIPES_DIR / "accelerate" / f"{p.name}.yaml"):
        if p.name == str(name) and cand.suffix in _SUFFIXES and cand.is_file():
            return cand
    if p.is_file():
        return p
    names = [c.stem for c in launch_configs()]
    raise RecipeNotFound(f"no launch config {str(name)!r}{did_you_mean(p.stem, names)}: give a packaged one "
                         f"({', '.join(names)}) or a file")  # fmt: skip


def description(path: Path) -> str:
    """The first sentence of the comment a recipe or launch config opens with."""
    words = []
    for line in path.read_text().splitlines():
        if not line.startswith("#") or line.startswith("#  "):
            break
        words.append(line.lstrip("#").strip())
    text = " ".join(words)
    end = text.find(". ")
    return text[: end + 1] if end >= 0 else text


def recipe_path(source: Source) -> Path | None:
    """The recipe file ``source`` names: an existing ``.yaml``/``.yml`` file, or the name of a
    packaged recipe with or without ``.yaml`` (``llama-3.1-8b-128k``); ``None`` if it names none."""
    p = Path(source)
    if p.suffix in _SUFFIXES and p.is_file():
        return p
    if p.name == str(source):  # a bare name: a packaged recipe
        for cand in (RECIPES_DIR / p.name, RECIPES_DIR / f"{p.name}.yaml"):
            if cand.suffix in _SUFFIXES and cand.is_file():
                return cand
    return None


def missing_recipe(source: Source) -> str:
    """Why ``source`` names no recipe, in one line: a file (a ``.yaml`` name or a path) that does not exist,
    with the absolute path it was looked for at, or an unknown packaged name; then the packaged names."""
    names = [p.stem for p in packaged_recipes()]
    p = Path(source)
    hint = did_you_mean(p.stem, names)
    if p.suffix not in _SUFFIXES and p.name == str(source):  # a bare name: a packaged recipe was meant
        return f"no recipe {str(source)!r}{hint}: give a .yaml file or a packaged recipe ({', '.join(names)})"
    where = p.expanduser().resolve()
    what = ("is a directory (at" if where.is_dir() else "is not a .yaml file (at" if where.exists()
            else "does not exist (looked for")  # fmt: skip
    return (f"recipe file {str(source)!r} {what} {where}); give an existing .yaml file, or a packaged "
            f"recipe{hint}: {', '.join(names)}")  # fmt: skip


def _find(source: Source) -> Path:
    path = recipe_path(source)
    if path is None:
        raise RecipeNotFound(missing_recipe(source))
    return path


def _yaml(path: Path) -> Any:
    with open(path) as f:
        return yaml.safe_load(f)


def _load(path: Path) -> dict[str, Any]:
    try:
        data = _yaml(path)
    except yaml.YAMLError as e:
        raise RecipeError(f"{path}: not valid YAML ({' '.join(str(e).split())})") from None
    if not isinstance(data, dict):
        raise RecipeError(f"{path}: a recipe is a YAML mapping (model, stages, ...), not {type(data).__name__}")
    bases = [path.resolve().parent, Path.cwd()]
    for name in PATH_KEYS:
        if name in data:
            data[name] = resolve_paths(name, data[name], bases, path)
    return data


def read_recipe(source: Source) -> dict[str, Any]:
    """The fields of a recipe (a path, or a packaged recipe's name) as written in its YAML, but for
    the relative paths of its model and data sections that exist, made absolute: read from the
    recipe's folder, else from the working directory (``sections.resolve_paths``)."""
    return _load(_find(source))


def _shape(m: ModelSource) -> ModelShape:
    if m.fields is None:
        return model_shape(m.weights)  # a known name, else "unknown model ..." naming what to give
    name = model_shape(m.weights).name if m.found == "catalogue" else m.name
    return ModelShape.from_config(m.fields, name=name)


def recipe_model(source: Source) -> ModelShape:
    """The model of a recipe, resolved as the runner resolves it (``sections.resolve_model``): a
    saved model's ``config.json``, the recipe that writes an ``init_from`` run that does not exist
    yet (its ``output_dir``), the inline config, or a known name; ``overrides`` on top."""
    path = _find(source)
    return _shape(resolve_model(_load(path).get("model"), path))


def _trainer(r: dict[str, Any]) -> str:
    return check_trainer(r.get("trainer"))


def _seq_len(r: dict[str, Any]) -> int:
    return max(s["seq_len"] for s in resolve_data(r.get("data"), _trainer(r))["stages"])


def recipe_model_config(source: Source) -> dict[str, Any]:
    """The transformers config fields of a recipe's model (``model_type`` included), found as
    ``recipe_model`` finds its shape, nothing downloaded: a saved model's ``config.json``, the
    recipe that writes an ``init_from`` run, the inline config, or the catalogue's fields of a
    known name; the recipe's ``overrides`` on top."""
    path = _find(source)
    m = resolve_model(_load(path).get("model"), path)
    if m.fields is None:
        raise RecipeError(f"{path.name}: no config for model {m.weights!r} without downloading it")
    return dict(m.fields)


def _settings(r: dict[str, Any]) -> PlanSettings:
    lora = r.get("lora")
    cp = int(r.get("cp_size", 1))
    stated = r.get("memory_gb") or {}
    checkpointing = r.get("activation_checkpointing", r.get("gradient_checkpointing", False))
    return PlanSettings(
        seq_len=_seq_len(r),
        gpus=int(stated.get("gpus", cp)),
        cp=cp,
        mode="lora" if lora else "full",
        lora_rank=(lora or {}).get("r", 16),
        lora_targets=tuple((lora or {}).get("target_modules", LORA_TARGETS)),
        dtype=(r.get("model") or {}).get("dtype", "float32"),
        checkpointing=bool(checkpointing),
        offload=bool(r.get("activation_offload", False)),
        chunked_loss=bool(r.get("chunked_loss", True)),
        # a DPO pair is two sequences (chosen, rejected) in one forward; GRPO's micro-batch counts completions
        micro_batch=int(r.get("per_device_train_batch_size", 8)) * (2 if _trainer(r) == "dpo" else 1),
        tiled_mlp=r.get("tiled_mlp"),
        tiled_layers=r.get("tiled_layers"),
        head_groups=int(r.get("head_groups", 1)),
        offload_every=int(r.get("offload_every", 1)),
        gpus_per_node=int(stated.get("gpus_per_node", 8)),
        host_gib=stated.get("host_gib"),
        sharding=stated.get("sharding", "none"),
        gpu_gib=float(stated.get("gpu", 80)),
        reserve_gib=0.0,
        ulysses_size=parse_ulysses_size(r.get("ulysses_size", 1)),
        attention_backend=str(r.get("attention_backend", "auto")),
        visual_fraction=float((r.get("data") or {}).get("visual_fraction") or 0.0),
    )


def recipe_settings(source: Source) -> PlanSettings:
    """The planner's settings of a recipe: its ``data.seq_len`` (or longest stage), ``cp_size``,
    ``ulysses_size``, ``per_device_train_batch_size``, dtype, LoRA or full fine-tuning,
    ``activation_checkpointing`` (or its alias ``gradient_checkpointing``), ``activation_offload``,
    ``chunked_loss``, ``tiled_mlp``, ``tiled_layers``, ``head_groups``, ``offload_every`` and
    ``data.visual_fraction`` (the share of image / video tokens: the planner prices the vision tower,
    frozen). The number of GPUs, the sharding, the GPU size, the GPUs per node and the node's host memory
    come from the launch, which the recipe states in ``memory_gb: {gpus, sharding, gpu, gpus_per_node,
    host_gib}`` (default: ``cp_size`` GPUs, no sharding, 80 GiB, 8 per node, host memory not checked); no
    runtime reserve."""
    return _settings(read_recipe(source))


def _notes(r: dict[str, Any], m: ModelShape, s: PlanSettings) -> list[str]:
    trainer = _trainer(r)
    if trainer == "sft":
        return []
    out = []
    if trainer == "dpo":
        out.append(f"DPO: each pair is 2 sequences of {s.seq_len:,} tokens (chosen, rejected) in one forward: priced "
                   f"as micro-batch {s.micro_batch} = 2 x {s.micro_batch // 2} pair(s)")  # fmt: skip
    reference = trainer == "dpo" or float(r.get("beta", 0.0)) > 0  # GRPO: a KL term needs one (TRL's beta: 0)
    if reference and s.mode == "lora":
        out.append("reference model: the policy with its LoRA adapter disabled: no extra weights, and its forward "
                   "keeps no activations (no gradient): nothing added")  # fmt: skip
    elif reference:
        size = 2 if s.dtype in ("bfloat16", "float16") else 4
        shards = s.gpus if s.sharding == "fsdp" else 1
        out.append(f"reference model: a second copy of the weights, {m.params * size / shards / GiB:.1f} GiB per "
                   "GPU, NOT included above (use LoRA: the adapter disabled is the reference)")  # fmt: skip
    if trainer == "grpo":
        size = 2 if s.dtype in ("bfloat16", "float16") else 4
        kv = 2 * m.layers * m.kv_heads * m.head_dim * size
        out.append(f"GRPO: generation memory is NOT included (transformers generate, whole prompt on each rank): "
                   f"its KV cache is {kv / 1024:.0f} KiB per token, {kv * s.seq_len / GiB:.1f} GiB per "
                   f"{s.seq_len:,}-token sequence, times the sequences generated at once")  # fmt: skip
    return out


def recipe_notes(source: Source, settings: PlanSettings | None = None) -> list[str]:
    """What the planner's figures of a DPO or GRPO recipe count and leave out, as notes for its
    table (``settings``: those planned, default the recipe's): pairs as two sequences, the reference
    model (nothing with LoRA; its weights, not included, without), generation's KV cache (not
    included). ``[]`` for the causal-LM trainer."""
    path = _find(source)
    r = _load(path)
    return _notes(r, _shape(resolve_model(r.get("model"), path)), settings or _settings(r))


def recipe_plan(source: Source, **overrides: Any) -> Plan:
    """The plan of a recipe (``recipe_model``, ``recipe_settings``); ``overrides`` replace any
    ``PlanSettings`` field (``gpus=16``, ``cp=4``). A DPO or GRPO recipe's notes say what its
    figures count and leave out (``recipe_notes``)."""
    path = _find(source)
    r = _load(path)
    shape, settings = _shape(resolve_model(r.get("model"), path)), replace(_settings(r), **overrides)
    p = plan(shape, settings)
    p.notes.extend(_notes(r, shape, settings))
    return p


def recipe_memory(source: Source) -> dict[str, Any]:
    """What a recipe's ``memory_gb`` states: the launch inputs it already names (``gpus``,
    ``sharding``, ``gpu``) and the planner's per-GPU figures in GiB (``model_states``,
    ``activations``, ``total`` = the two; ``host`` when activations are offloaded)."""
    stated = read_recipe(source).get("memory_gb") or {}
    p = recipe_plan(source)
    out: dict[str, Any] = {k: stated[k] for k in ("gpus", "sharding", "gpu", "gpus_per_node", "host_gib")
                           if k in stated}  # fmt: skip
    out.update(p.summary_gib())
    if any(p.host.values()):
        out["host"] = round(sum(p.host.values()) / GiB, 3)
        if p.host_per_node != p.host_per_rank:
            out["host_node"] = round(p.host_per_node / GiB, 1)
    return out


def write_recipe_memory(source: Source) -> str:
    """Rewrite the ``memory_gb:`` line of a recipe with ``recipe_memory`` (one flow-style line,
    comments elsewhere kept); returns the new line."""
    p = _find(source)
    values = recipe_memory(p)
    line = "memory_gb: {" + ", ".join(f"{k}: {v}" for k, v in values.items()) + "}"
    lines = p.read_text().splitlines(keepends=True)
    comment = "  # per GPU, GiB: hf-ring plan " + p.name + "\n"
    for i, old in enumerate(lines):
        if old.startswith("memory_gb:"):
            if old.split("#")[0].rstrip().endswith(":"):
                raise RecipeError(f"{p}: write memory_gb on one line (memory_gb: {{...}}) to have it rewritten")
            lines[i] = line + comment
            break
    else:
        lines.append(line + comment)
    p.write_text("".join(lines))
    return line
