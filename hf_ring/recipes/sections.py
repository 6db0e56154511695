"""The ``model`` and ``data`` sections of a recipe, each resolved by one function that the planner
(``hf-ring plan``, ``hf_ring.recipes.reader``) and the runner (``hf-ring train``,
``hf_ring.recipes.recipe``) both call, so that the plan prices the model that trains.

``resolve_model(section, where)``: where the weights come from and the model's config fields,
nothing downloaded (``ModelSource``). ``resolve_data(section)``: the data section checked (its
keys, lengths and choices, each refusal naming the field) with its ``stages``.
``resolve_paths(name, section, bases, where)``: the relative paths of a section made absolute,
read from the recipe's folder, else the working directory, when a recipe file says them, from the
working directory when flags do (runs, ``output_dir``, are written from the working directory).
Imports neither torch nor transformers.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from ..errors import RecipeError, closest, did_you_mean
from ..planner import known_config

__all__ = [
    "BOUNDARIES",
    "BUILTIN_REWARDS",
    "DATA_KEYS",
    "PAIRS_KEYS",
    "PROMPTS_KEYS",
    "TRAINERS",
    "DTYPES",
    "MODEL_KEYS",
    "MULTIMODAL_KEYS",
    "ModelSource",
    "check_trainer",
    "PATH_KEYS",
    "PATH_RULE",
    "looks_local",
    "positive_int",
    "resolve_data",
    "resolve_model",
    "resolve_paths",
    "unknown_keys",
]

MODEL_KEYS = ("config", "name_or_path", "init_from", "dtype", "overrides", "attn_implementation")
DTYPES = ("float32", "bfloat16", "float16", "float64")
BOUNDARIES = ("pad", "concatenate", "documents")
# the keys of the model and data sections that name files or folders (``resolve_paths``)
PATH_KEYS = {"model": ("init_from", "name_or_path"), "data": ("path", "tokenizer", "processor")}
FILE_SUFFIXES = (".json", ".jsonl", ".parquet", ".arrow", ".csv", ".txt", ".text", ".yaml", ".yml", ".safetensors",
                 ".bin", ".pt")  # fmt: skip
# the keys of image / video examples (hf_ring.recipes.vlm_data): a processor makes a data section multimodal
MULTIMODAL_KEYS = ("processor", "image_field", "video_field", "visual_fraction")
# the keys of a data section: the passkey task's, and those of documents (hf_ring.recipes.data)
PASSKEY_KEYS = ("task", "seq_len", "stages", "eval")
DATA_KEYS = (*PASSKEY_KEYS, "path", "name", "split", "text_field", "ids_field", "tokenizer", "add_eos",
             "boundaries", "pad_id", "num_proc", *MULTIMODAL_KEYS)  # fmt: skip
# the recipe's ``trainer``: the causal-LM loss (RingTrainer), DPO (RingDPOTrainer), GRPO (RingGRPOTrainer)
TRAINERS = ("sft", "dpo", "grpo")
# the data sections of DPO (preference pairs: prompt, chosen, rejected) and GRPO (prompts, reward functions)
PAIRS_KEYS = ("path", "name", "split", "tokenizer", "seq_len")
PROMPTS_KEYS = (*PAIRS_KEYS, "rewards")
# the reward functions hf_ring ships (hf_ring.recipes.rewards); any other is named module:function
BUILTIN_REWARDS = ("length", "keyword")


@dataclass(frozen=True)
class ModelSource:
    """A recipe's ``model`` section, resolved.

    ``weights``: the folder or hub name the weights load from (``init_from``, else ``name_or_path``);
    ``None``: random initialisation from ``config``. ``fields``: the transformers config fields
    (``model_type`` included, ``overrides`` on top) as far as they are known without downloading
    anything, else ``None``. ``found``: where they come from: ``"inline"`` (the section's
    ``config``), ``"saved"`` (``config.json`` in the ``weights`` folder), ``"recipe"`` (the recipe
    next to this one whose ``output_dir`` will hold ``weights``: ``writer``), ``"catalogue"`` (a
    known hub name, ``hf_ring.planner.KNOWN_MODELS``) or ``"hub"`` (not known here). ``name``: the
    model's name in the planner's table.
    """

    weights: str | None
    fields: dict[str, Any] | None
    found: str
    overrides: dict[str, Any] = field(default_factory=dict)
    name: str = "model"
    writer: Path | None = None


def unknown_keys(given: Iterable[str], known: Iterable[str], aliases: dict[str, str] | None = None) -> str:
    """The keys of ``given`` outside ``known``, each with the known key it is likely meant for
    (``['boundary' (boundaries?)]``): its entry in ``aliases`` (names other tools use), else the
    closest by spelling (``hf_ring.errors.closest``); ``""`` when there is none."""
    known = sorted(set(known))
    out = []
    for key in sorted(set(given) - set(known)):
        near = (aliases or {}).get(str(key).lower()) or closest(str(key), known)
        out.append(f"{key!r} ({near}?)" if near in known else repr(key))
    return f"[{', '.join(out)}]" if out else ""


def _absolute(ref: str | Path, base: Path | None = None) -> Path:
    """``ref`` as an absolute path (``~`` expanded, ``..`` folded), a relative one taken from ``base``
    (default: the working directory)."""
    p = Path(ref).expanduser()
    return Path(os.path.abspath(p if p.is_absolute() else (base or Path.cwd()) / p))


def looks_local(ref: str) -> bool:
    """Whether ``ref`` can only be a path on this machine, never a hub name (``name`` or ``org/name``):
    it starts with ``/``, ``.`` or ``~``, holds a backslash, a glob character or more than one
    ``/``, or ends in a file suffix (``.jsonl``, ``.parquet``, ...)."""
    return (
        ref.startswith(("/", ".", "~"))
        or any(c in ref for c in "\\*?[")
        or ref.count("/") > 1
        or Path(ref).suffix.lower() in FILE_SUFFIXES
    )


def _config_json(ref: str) -> Path:
    return _absolute(ref) / "config.json"  # relative: a run written from the working directory


def _writer(ref: str, where: Path | None) -> tuple[dict[str, Any], Path] | None:
    """The recipe next to ``where`` whose ``output_dir`` holds ``ref`` (a run, maybe not written yet;
    both relative to the working directory, where runs are written)."""
    if where is None:
        return None
    for other in sorted(where.parent.glob("*.yaml")):
        if other.resolve() == where.resolve():
            continue
        try:
            with open(other) as f:
                r = yaml.safe_load(f)
        except (OSError, yaml.YAMLError):  # not a recipe: it writes no run
            continue
        out = r.get("output_dir") if isinstance(r, dict) else None
        if out and isinstance(r.get("model"), dict) and _absolute(ref).is_relative_to(_absolute(out)):
            return r["model"], other
    return None


def resolve_paths(name: str, section: Any, bases: list[Path], where: Path | None = None) -> Any:
    """``section`` (the ``model`` or ``data`` section, or flags for it) with each relative path of its
    ``PATH_KEYS`` that exists made absolute: the first of ``bases`` that holds it -- the recipe's
    folder, then the working directory, for what a recipe file says; the working directory for
    flags. A ``model.init_from`` inside the ``output_dir`` of another recipe next to ``where`` (a run
    that recipe writes, maybe not yet: the demo's second stage starts from the first) is taken from
    the working directory, where runs are written. Anything else stays as written: a hub name, or a
    path that exists nowhere, which the runner refuses by name before any hub lookup. Returns a new
    dict (anything but a dict as it is)."""
    if not isinstance(section, dict):
        return section
    out = dict(section)
    for key in PATH_KEYS.get(name, ()):
        ref = out.get(key)
        if not isinstance(ref, str) or not ref:
            continue
        if Path(ref).expanduser().is_absolute():
            out[key] = str(_absolute(ref))
            continue
        found = next((_absolute(ref, base) for base in bases if (base / ref).exists()), None)
        if found is None and name == "model" and key == "init_from" and _writer(ref, where) is not None:
            found = _absolute(ref)
        if found is not None:
            out[key] = str(found)
    return out


# where a relative path that exists nowhere was looked for, for messages
PATH_RULE = ("a relative path written in a recipe is read from the recipe's folder, else from the working directory; "
             "one given as a flag, from the working directory")  # fmt: skip


def _check_model_section(section: Any) -> None:
    if not isinstance(section, dict):
        raise RecipeError(f"model: a mapping (config | name_or_path | init_from, dtype, overrides), not {section!r}")
    unknown = unknown_keys(section, MODEL_KEYS)
    if unknown:
        raise RecipeError(f"model: unknown keys {unknown}; a model section holds {list(MODEL_KEYS)}")
    for key in ("config", "overrides"):
        if section.get(key) is not None and not isinstance(section[key], dict):
            raise RecipeError(f"model.{key}: a mapping of transformers config fields, not {section[key]!r}")
    if section.get("config") is not None and "model_type" not in section["config"]:
        raise RecipeError("model.config: give its model_type (llama, qwen2, ...) with the config fields")
    if section.get("dtype", "float32") not in DTYPES:
        raise RecipeError(f"model.dtype: one of {list(DTYPES)}, not {section['dtype']!r}")
    for key in ("name_or_path", "init_from"):
        if section.get(key) is not None and not isinstance(section[key], str):
            raise RecipeError(f"model.{key}: a folder or a hub name, not {section[key]!r}")
    if not (section.get("config") or section.get("init_from") or section.get("name_or_path")):
        raise RecipeError(
            "model: give config (a transformers config dict: random initialisation), name_or_path (a hub name "
            "or a folder) or init_from (a saved model to start from)"
        )


def resolve_model(section: Any, where: Path | None = None, _seen: tuple[Path, ...] = ()) -> ModelSource:
    """Resolve a recipe's ``model`` section (``where``: the recipe file, for the name and to find
    the recipe that writes an ``init_from`` run).

    The weights come from ``init_from`` when it is set, else from ``name_or_path`` unless ``config``
    is given (random initialisation; ``name_or_path`` then only names the tokenizer). The config
    fields come from the weights' ``config.json`` when it exists, else from the recipe that writes
    them, else from the section's ``config``, else from the planner's catalogue; ``overrides`` on
    top. A ``config`` given with ``init_from`` describes the saved model: a field that contradicts
    its ``config.json`` is refused (changes belong in ``overrides``).
    """
    _check_model_section(section)
    overrides = dict(section.get("overrides") or {})
    inline = dict(section["config"]) if section.get("config") is not None else None
    weights = section.get("init_from") or (section.get("name_or_path") if inline is None else None)
    stem = where.stem if where is not None else "model"
    if weights is None:
        return ModelSource(None, {**inline, **overrides}, "inline", overrides, stem)
    cfg = _config_json(weights)
    if cfg.exists():
        saved = json.loads(cfg.read_text())
        clash = sorted(k for k, v in (inline or {}).items() if k in saved and saved[k] != v)
        if clash:
            raise RecipeError(
                f"model.config disagrees with {cfg} on {clash}: the model starts from init_from {weights!r}; drop "
                "those fields from model.config, or put the changes in model.overrides"
            )
        return ModelSource(weights, {**saved, **overrides}, "saved", overrides, weights)
    found = _writer(weights, where)
    if found is not None and found[1] not in _seen:
        other = resolve_model(found[0], found[1], (*_seen, found[1]))
        if other.fields is not None:
            return ModelSource(weights, {**other.fields, **overrides}, "recipe", overrides, other.name, found[1])
    if inline is not None:
        return ModelSource(weights, {**inline, **overrides}, "inline", overrides, stem)
    known = known_config(weights)
    if known is not None:
        return ModelSource(weights, {**known, **overrides}, "catalogue", overrides, weights)
    return ModelSource(weights, None, "hub", overrides, weights)


# --- data --------------------------------------------------------------------------------------


def positive_int(value: Any, name: str, minimum: int = 1) -> int:
    """``value`` as an ``int`` >= ``minimum``; else a ``ValueError`` naming the field ``name``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        what = "a positive whole number" if minimum == 1 else f"a whole number >= {minimum}"
        raise RecipeError(f"{name}: {what}, not {value!r}")
    return value


def _stages(data: dict[str, Any]) -> list[dict[str, int]]:
    if "stages" in data:
        stages = data["stages"]
        if not isinstance(stages, list) or not stages or any(not isinstance(s, dict) for s in stages):
            raise RecipeError(f"data.stages: a list of {{seq_len, steps}}, not {stages!r}")
        out = []
        for k, s in enumerate(stages):
            if set(s) != {"seq_len", "steps"}:
                raise RecipeError(f"data.stages[{k}]: give exactly seq_len and steps, not {sorted(s)}")
            out.append({"seq_len": positive_int(s["seq_len"], f"data.stages[{k}].seq_len", 2),
                        "steps": positive_int(s["steps"], f"data.stages[{k}].steps", 0)})  # fmt: skip
        if "seq_len" in data:
            raise RecipeError("data: give seq_len or stages, not both")
        return out
    if "seq_len" not in data:
        raise RecipeError("data: give seq_len (tokens per sequence) or stages: [{seq_len, steps}, ...]")
    return [{"seq_len": positive_int(data["seq_len"], "data.seq_len", 2), "steps": 0}]


def check_trainer(value: Any) -> str:
    """A recipe's ``trainer`` (absent: ``sft``), refused with the closest name when it is none of ``TRAINERS``."""
    if value is None:
        return "sft"
    if value not in TRAINERS:
        raise RecipeError(f"trainer: one of {list(TRAINERS)}, not {value!r}{did_you_mean(str(value), TRAINERS)}")
    return value


def _check_rewards(rewards: Any) -> None:
    """``data.rewards``: a non-empty list of built-in names (``BUILTIN_REWARDS``) or ``module:function``
    import paths, each a string or ``{function: ..., <keyword arguments>}``; imported by the runner."""
    if not isinstance(rewards, list) or not rewards:
        raise RecipeError(f"data.rewards: a list of reward functions ({', '.join(BUILTIN_REWARDS)} or "
                          f"module:function), not {rewards!r}")  # fmt: skip
    for k, entry in enumerate(rewards):
        name = entry.get("function") if isinstance(entry, dict) else entry
        if not isinstance(name, str) or not name:
            raise RecipeError(f"data.rewards[{k}]: a function name, or {{function: NAME, ...options}}, not {entry!r}")
        if ":" not in name and name not in BUILTIN_REWARDS:
            raise RecipeError(f"data.rewards[{k}] {name!r}: not a built-in reward ({', '.join(BUILTIN_REWARDS)})"
                              f"{did_you_mean(name, BUILTIN_REWARDS)}; name your own as module:function")  # fmt: skip


def _post_data(section: dict[str, Any], trainer: str) -> dict[str, Any]:
    """The data section of a DPO or GRPO recipe: ``path`` (pairs with prompt, chosen, rejected; or
    prompts), ``seq_len`` (the longest sequence: DPO's prompt + completion, GRPO's prompt +
    completion), ``tokenizer``, ``name``, ``split``, and for GRPO ``rewards``."""
    allowed = PAIRS_KEYS if trainer == "dpo" else PROMPTS_KEYS
    what = "preference pairs" if trainer == "dpo" else "prompts and reward functions"
    unknown = unknown_keys(section, allowed)
    if unknown:
        raise RecipeError(f"data: unknown keys {unknown}; the data section of trainer {trainer} ({what}) holds "
                          f"{list(allowed)}")  # fmt: skip
    if "seq_len" not in section:
        raise RecipeError(f"data: give seq_len (tokens of the longest prompt + completion, trainer {trainer})")
    if not section.get("path"):
        raise RecipeError(f"data: give path (json/jsonl {what}, a save_to_disk folder, or a hub dataset name)")
    for key in ("path", "name", "split", "tokenizer"):
        if section.get(key) is not None and not isinstance(section[key], str):
            raise RecipeError(f"data.{key}: a string, not {section[key]!r}")
    if trainer == "grpo":
        if "rewards" not in section:
            raise RecipeError(f"data: give rewards (a list: {', '.join(BUILTIN_REWARDS)} or module:function)")
        _check_rewards(section["rewards"])
    data = dict(section)
    data["stages"] = [{"seq_len": positive_int(section["seq_len"], "data.seq_len", 2), "steps": 0}]
    return data


def _check_multimodal(data: dict[str, Any]) -> None:
    """``visual_fraction`` (the planner's share of visual tokens) in [0, 1], and only with a ``processor``."""
    vf = data.get("visual_fraction")
    if vf is not None and (isinstance(vf, bool) or not isinstance(vf, (int, float)) or not 0 <= vf <= 1):
        raise RecipeError(f"data.visual_fraction: the share of visual tokens, between 0 and 1, not {vf!r}")
    if data.get("processor") is not None:
        unused = [k for k in ("ids_field", "add_eos", "num_proc", "eval") if data.get(k) is not None]
        if data.get("boundaries", "documents") != "documents":
            unused.append("boundaries")
        if unused:
            raise RecipeError(f"data: {unused} are not used with image / video examples (data.processor: they are "
                              "processed, then packed as documents); drop them")  # fmt: skip
    else:
        given = [k for k in MULTIMODAL_KEYS if data.get(k) is not None]
        if given:
            raise RecipeError(f"data: {given} are for image / video examples: give data.processor too")


def resolve_data(section: Any, trainer: str = "sft") -> dict[str, Any]:
    """The ``data`` section checked, as a new dict with its ``stages`` (``[{seq_len, steps}]``;
    ``seq_len`` alone: one stage whose ``steps`` 0 means as many as ``max_steps``).

    Refused, naming the field: a key that is not one of ``DATA_KEYS`` (or not the passkey task's),
    lengths, steps, sample counts and ``num_proc`` that are not positive whole numbers (a sequence
    holds at least 2 tokens), a ``boundaries`` outside ``BOUNDARIES``, a ``task`` other than
    ``passkey``, and documents without a ``path``. ``trainer`` ``dpo`` / ``grpo``: the data section
    of preference pairs / of prompts and reward functions instead (``_post_data``).
    """
    if not isinstance(section, dict):
        raise RecipeError(f"data: a mapping (task: passkey, or path; seq_len or stages), not {section!r}")
    if trainer != "sft":
        return _post_data(section, trainer)
    passkey = section.get("task") is not None
    if passkey and section["task"] != "passkey":
        raise RecipeError(f"data.task: 'passkey' (the demo's task) or absent (documents from data.path), not "
                          f"{section['task']!r}")  # fmt: skip
    allowed = PASSKEY_KEYS if passkey else DATA_KEYS
    unknown = unknown_keys(section, allowed)
    if unknown:
        extra = " (the passkey task makes its own data)" if passkey else ""
        raise RecipeError(f"data: unknown keys {unknown}; a data section holds {list(allowed)}{extra}")
    data = dict(section)
    data["stages"] = _stages(section)
    if not passkey and not section.get("path"):
        raise RecipeError("data: give path (local files, a save_to_disk folder, or a hub dataset name), "
                          "or task: passkey")  # fmt: skip
    if data.get("boundaries", "pad") not in BOUNDARIES:
        raise RecipeError(f"data.boundaries: one of {list(BOUNDARIES)}, not {data['boundaries']!r}")
    for key in ("num_proc", "pad_id"):
        if data.get(key) is not None:
            positive_int(data[key], f"data.{key}", 1 if key == "num_proc" else 0)
    if data.get("add_eos") is not None and not isinstance(data["add_eos"], bool):
        raise RecipeError(f"data.add_eos: true or false, not {data['add_eos']!r}")
    for key in ("path", "name", "split", "text_field", "ids_field", "tokenizer", "processor", "image_field",
                "video_field"):
        if data.get(key) is not None and not isinstance(data[key], str):
            raise RecipeError(f"data.{key}: a string, not {data[key]!r}")
    _check_multimodal(data)
    ev = data.get("eval")
    if ev is not None:
        if not isinstance(ev, dict) or not {"seq_len", "samples"} <= set(ev) <= {"seq_len", "samples", "seed"}:
            raise RecipeError(
                f"data.eval: {{seq_len, samples[, seed]}} (passkey retrieval before and after), not {ev!r}"
            )
        data["eval"] = {"seq_len": positive_int(ev["seq_len"], "data.eval.seq_len", 2),
                        "samples": positive_int(ev["samples"], "data.eval.samples")}  # fmt: skip
        if ev.get("seed") is not None:  # the held-out samples, fixed whatever the run's seed (default: it)
            data["eval"]["seed"] = positive_int(ev["seed"], "data.eval.seed", 0)
    return data
