"""Tiny random configs for every causal-LM family of the installed transformers.

``tiny_config(model_type, **variant)`` starts from the family's default config
(``AutoConfig.for_model``, or the text config its ``ForCausalLM`` class takes), shrinks every size
field that exists (see ``config_fields.SIZES``), keeps one layer of each kind for hybrids (the shortest prefix
of the default layer pattern that holds every kind), and applies a short table of per-family
``OVERRIDES`` where the generic shrink is not enough. Windows (sliding, chunked, local) become
``max_position_embeddings`` long, i.e. never shorter than a test sequence, unless the ``sliding``
variant asks for a short one.

``families()`` lists the model types to sweep: the decoder-only causal LMs that run from
``input_ids`` alone; ``skipped()`` gives every other model type with the reason.
``variants(model_type)`` names the variants a family has:

- ``router_aux``: MoE router load-balancing loss on (``output_router_logits=True``, coef 0.1);
- ``sliding``: a window shorter than the sequence, through the field the family uses;
- ``mla``: multi-head latent attention with ``v_head_dim != qk head dim`` (the shape of released
  MLA models; the plain config has ``v_head_dim`` equal to the qk head dim);
- ``temperature``: Llama 4's NoPE query temperature on a NoPE last layer, ``floor_scale=4`` (the
  temperature steps every 4 tokens), with weights (``initializer_range=0.2``) large enough for it
  to move the loss.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from typing import Any

from .config_fields import (
    DERIVED,
    INDEX_LISTS,
    MAX_POSITIONS,
    OVERRIDES,
    SIZES,
    WINDOWS,
    ZERO,
)

__all__ = ["NOT_FROM_IDS", "OVERRIDES", "SIZES", "causal_lm_class", "families", "skipped", "tiny_config", "variants"]


def causal_lm_class(model_type: str) -> type | None:
    """The ``ForCausalLM`` class that ``AutoModelForCausalLM`` builds for ``model_type``."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type], None)


def _default(config_class: type) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return config_class()


def _config_class(model_type: str) -> type:
    """The config class the ``ForCausalLM`` class takes (a composite config's text config class)."""
    from transformers import CONFIG_MAPPING

    own = CONFIG_MAPPING[model_type]
    cls = causal_lm_class(model_type)
    wanted = getattr(cls, "config_class", None)
    return wanted if isinstance(wanted, type) and not issubclass(own, wanted) else own


def _fields(config_class: type) -> set[str]:
    names = {f.name for f in dataclasses.fields(config_class)} if dataclasses.is_dataclass(config_class) else set()
    return names | set(getattr(config_class, "attribute_map", {}))


def _num_layers(cfg: Any) -> int | None:
    n = getattr(cfg, "num_hidden_layers", None)
    return n if isinstance(n, int) else None


def _per_layer(cfg: Any, n_layers: int) -> dict[str, list]:
    """Every attribute of ``cfg`` (properties included) that describes each layer: lists of length
    ``n_layers``, and index lists turned into membership."""
    out: dict[str, list] = {}
    for name in dir(cfg):
        if name.startswith("_") or name.endswith("token_id") or name in DERIVED:
            continue
        try:
            v = getattr(cfg, name)
        except Exception:  # noqa: BLE001 - some properties need fields a config lacks
            continue
        if name in INDEX_LISTS and isinstance(v, (list, tuple)):
            out[name] = [i in v for i in range(n_layers)]
        elif isinstance(v, (list, tuple)) and len(v) == n_layers and n_layers > 1:
            out[name] = [repr(x) for x in v]
    return out


def _prefix_covering(kinds: dict[str, list]) -> int:
    """The shortest prefix of layers that holds every value of every per-layer attribute."""
    n = 1
    for values in kinds.values():
        first: dict[Any, int] = {}
        for i, v in enumerate(values):
            first.setdefault(v, i)
        n = max(n, max(first.values(), default=0) + 1)
    return n


def _shrink(defaults: dict[str, Any], names: set[str]) -> dict[str, Any]:
    """Small values for the size fields among ``names`` (nested configs shrunk the same way)."""
    out: dict[str, Any] = {}
    for name in names:
        if name not in defaults:
            continue
        v = defaults[name]
        if name == "per_layer_config" and isinstance(v, dict):  # heterogeneous layers: {"02": {fields}, ...}
            out[name] = {k: {**d, **_shrink(d, set(d))} for k, d in v.items() if isinstance(d, dict)}
        elif isinstance(v, dict) and ("model_type" in v or any(k in v for k in SIZES)):
            out[name] = {**v, **_shrink(v, set(v))}
        elif name in SIZES and (v is None or isinstance(v, int)) and not isinstance(v, bool):
            out[name] = SIZES[name]  # None too: real checkpoints set these (head_dim, n_routed_experts, ...)
        elif name in SIZES and isinstance(v, list) and v and all(isinstance(x, int) for x in v):
            out[name] = [SIZES[name]] * len(v)  # per-layer sizes (fixed up to the layer count below)
        elif ("dropout" in name or "pdrop" in name or name in ZERO) and isinstance(v, float):
            out[name] = 0.0
        elif name in WINDOWS and isinstance(v, int) and not isinstance(v, bool):
            out[name] = MAX_POSITIONS
    vocab = out.get("vocab_size", defaults.get("vocab_size"))
    if isinstance(vocab, int):
        for name in names:  # special token ids must fit the small vocabulary
            v = defaults.get(name)
            if name.endswith(("token_id", "token_index")) and isinstance(v, int) and v >= vocab:
                out[name] = vocab - 1
            elif name.endswith("token_id") and isinstance(v, list) and any(x >= vocab for x in v):
                out[name] = [min(x, vocab - 1) for x in v]
    return out


def _mla_base(kwargs: dict[str, Any], defaults: dict[str, Any], names: set[str]) -> None:
    """Multi-head latent attention: one K/V head per query head, and ``head_dim`` kept in the relation
    to the MLA head dims that the default has (the RoPE part, or the whole qk head)."""
    if "kv_lora_rank" not in names or "qk_rope_head_dim" not in names:
        return
    layers = kwargs.get("per_layer_config") or {}
    for fields, dflt in (
        (kwargs, defaults),
        *((v, {**defaults, **defaults["per_layer_config"][k]}) for k, v in layers.items()),
    ):
        if "num_key_value_heads" in fields or fields is kwargs and "num_key_value_heads" in names:
            fields["num_key_value_heads"] = SIZES["num_attention_heads"]
        head_dim = dflt.get("head_dim")
        if head_dim is not None and head_dim == dflt.get("qk_rope_head_dim"):
            fields["head_dim"] = SIZES["qk_rope_head_dim"]
        elif head_dim is not None and head_dim == (dflt.get("qk_nope_head_dim") or 0) + dflt["qk_rope_head_dim"]:
            fields["head_dim"] = SIZES["qk_head_dim"]


def _variant_kwargs(names: set[str], *, sliding: int | None, router_aux: bool, mla: bool) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if sliding is not None:
        out.update({k: sliding for k in WINDOWS if k in names})
        if "use_sliding_window" in names:
            out["use_sliding_window"] = True
        if "max_window_layers" in names:
            out["max_window_layers"] = 1  # Qwen2: layers from 1 on slide; Qwen2-MoE: layers before 1
    if router_aux:
        out["output_router_logits"] = True
        if "router_aux_loss_coef" in names:
            out["router_aux_loss_coef"] = 0.1
    if mla:
        out["v_head_dim"] = 16  # != qk_nope_head_dim + qk_rope_head_dim = 24
    return out


def tiny_config(
    model_type: str,
    *,
    sliding: int | None = None,
    router_aux: bool = False,
    mla: bool = False,
    temperature: bool = False,
    **fields: Any,
) -> Any:
    """A tiny config of ``model_type`` (``None`` when its ``ForCausalLM`` class has no config class).

    Variants: ``sliding=W`` (a window of ``W`` tokens through the field the family uses),
    ``router_aux=True`` (router load-balancing loss on), ``mla=True`` (``v_head_dim`` != qk head
    dim). ``fields`` are set last, over everything else.
    """
    if causal_lm_class(model_type) is None:
        return None
    cls = _config_class(model_type)
    default = _default(cls)
    names = _fields(cls)
    defaults = default.to_dict()
    if "per_layer_config" in defaults:
        names.add("per_layer_config")
    for alias, target in getattr(cls, "attribute_map", {}).items():
        if target in defaults:
            defaults.setdefault(alias, defaults[target])
    kwargs = _shrink(defaults, names)
    _mla_base(kwargs, defaults, names)
    if "is_decoder" in defaults:
        kwargs["is_decoder"] = True  # encoder families used as causal LMs (BertLMHeadModel and co.)
    override, _ = OVERRIDES.get(model_type, ({}, ""))
    kwargs.update(override)
    # Hybrids: as many layers as it takes to keep one layer of each kind.
    n_default = _num_layers(default)
    if n_default and "num_hidden_layers" not in override:
        kinds = _per_layer(default, n_default)
        n = max(2, _prefix_covering(kinds)) if kinds else 2
        if (getattr(default, "num_kv_shared_layers", 0) or 0) > 0:
            n += 1  # one layer that reuses the K/V of an earlier layer of its type
            kwargs["num_kv_shared_layers"] = 1
        if n > 2:
            kwargs["num_hidden_layers"] = n
        if isinstance(kwargs.get("per_layer_config"), dict):
            kwargs["per_layer_config"] = {k: v for k, v in kwargs["per_layer_config"].items() if int(k) < n}
        for name, v in defaults.items():
            if name in ("num_hidden_layers",) or name not in names:
                continue
            if name in INDEX_LISTS and isinstance(v, list):
                kwargs[name] = [i for i in v if i < n]
            elif isinstance(v, list) and len(v) == n_default:
                kwargs[name] = (kwargs.get(name) or v)[:n]
        kwargs = _drop_rederived(cls, kwargs, default, n)
    kwargs.update(_variant_kwargs(names, sliding=sliding, router_aux=router_aux, mla=mla))
    if temperature:
        n = kwargs.get("num_hidden_layers", 2)
        kwargs.update(attn_temperature_tuning=True, floor_scale=4, attn_scale=1.0, initializer_range=0.2,
                      no_rope_layers=[1] * (n - 1) + [0])  # fmt: skip
    kwargs.update(fields)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return cls(**kwargs)


def _drop_rederived(cls: type, kwargs: dict[str, Any], default: Any, n: int) -> dict[str, Any]:
    """Leave out the per-layer lists that the config derives by itself, as the default does (so a
    variant such as ``use_sliding_window`` can still change them); keep the others explicit."""
    listed = [k for k, v in kwargs.items() if isinstance(v, list) and k not in INDEX_LISTS and len(v) == n]
    if not listed:
        return kwargs
    bare = {k: v for k, v in kwargs.items() if k not in listed}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            derived = cls(**bare)
    except Exception:  # noqa: BLE001 - the config needs the lists given
        return kwargs
    keep = dict(bare)
    for k in listed:
        if list(getattr(derived, k, None) or []) != list(kwargs[k]):
            keep[k] = kwargs[k]
    return keep


# ------------------------------------------------------------------------------------------------
# which families to sweep

# Causal-LM classes that do not run from input_ids alone (found by running them; see skipped()).
NOT_FROM_IDS: dict[str, str] = {
    "gemma4_assistant": "speculative-decoding drafter: runs on the target model's inputs_embeds and shared_kv_states",
    "gemma4_unified_assistant": "speculative-decoding drafter: runs on the target model's inputs_embeds and "
    "shared_kv_states",
    "git": "image-to-text (GIT): its loss skips the image tokens that pixel_values put ahead of the text",
    "musicgen": "audio-codebook decoder: input_ids are [batch x codebooks, N] audio codes",
    "musicgen_melody": "audio-codebook decoder: input_ids are [batch x codebooks, N] audio codes",
}


@functools.cache
def _classify() -> tuple[tuple[str, ...], dict[str, str]]:
    from transformers import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    keep: list[str] = []
    skip: dict[str, str] = {}
    owner: dict[tuple[str, str], str] = {}  # (class, config class) -> the model type whose own config it is
    for mt, cls_name in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items():
        cls = causal_lm_class(mt)
        if cls is not None and CONFIG_MAPPING[mt] is _config_class(mt):
            key = (cls_name, _config_class(mt).__name__)
            if key not in owner or getattr(CONFIG_MAPPING[mt], "model_type", None) == mt:
                owner[key] = mt
    for mt, cls_name in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items():
        cls = causal_lm_class(mt)
        if cls is None:
            skip[mt] = f"{cls_name} is not importable from this transformers install"
            continue
        if mt in NOT_FROM_IDS:
            skip[mt] = NOT_FROM_IDS[mt]
            continue
        if "ConditionalGeneration" in cls_name:
            text = _text_model_type(mt)
            also = f"; its text model is swept as {text}" if text in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES else ""
            skip[mt] = f"multimodal {cls_name} (swept with image inputs: testkit.sweep_images){also}"
            continue
        same = owner.get((cls_name, _config_class(mt).__name__))
        if same is not None and same != mt:
            skip[mt] = f"builds the same {cls_name} from the same {_config_class(mt).__name__} as {same}"
            continue
        keep.append(mt)
    return tuple(keep), skip


def _text_model_type(model_type: str) -> str | None:
    from transformers import CONFIG_MAPPING

    try:
        return _default(CONFIG_MAPPING[model_type]).get_text_config().model_type
    except Exception:  # noqa: BLE001
        return None


def families() -> list[str]:
    """The causal-LM model types the sweep runs (see ``skipped()`` for the others)."""
    return list(_classify()[0])


def skipped() -> dict[str, str]:
    """Model types of ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` that the sweep does not run, with why."""
    return dict(_classify()[1])


def variants(model_type: str) -> list[str]:
    """The variants that apply to ``model_type`` (besides the plain config)."""
    cls = _config_class(model_type)
    names = _fields(cls)
    default = _default(cls)
    out = []
    if "output_router_logits" in names:
        out.append("router_aux")
    if {"attn_temperature_tuning", "no_rope_layers", "floor_scale"} <= names:
        out.append("temperature")
    kinds = {str(t) for t in (getattr(default, "layer_types", None) or [])}
    if any(k in names for k in WINDOWS) or any("sliding" in k or "chunked" in k for k in kinds):
        out.append("sliding")
    if "kv_lora_rank" in names and "v_head_dim" in names:
        out.append("mla")
    return out
