"""The shapes of decoder-only models that decide their memory: a catalogue of published configs.

``model_shape("Llama-3.1-8B")`` (a known name, with or without its hub prefix), a transformers
``config.json`` (or a directory holding one), or a config dict gives a ``ModelShape``; nothing is
downloaded. Recipes name their model too: ``hf_ring.recipes.recipe_model`` resolves those.

Imports neither torch nor transformers.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["KNOWN_MODELS", "LORA_TARGETS", "ModelShape", "known_config", "model_shape"]

# Plain dicts of the published config.json fields that matter here (nothing is downloaded).
KNOWN_MODELS: dict[str, dict[str, Any]] = {
    "Llama-3.2-1B": dict(model_type="llama", hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=64, vocab_size=128256,
                         tie_word_embeddings=True),
    "Llama-3.2-3B": dict(model_type="llama", hidden_size=3072, intermediate_size=8192, num_hidden_layers=28,
                         num_attention_heads=24, num_key_value_heads=8, head_dim=128, vocab_size=128256,
                         tie_word_embeddings=True),
    "Llama-3.1-8B": dict(model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=128256,
                         tie_word_embeddings=False),
    "Llama-3.1-70B": dict(model_type="llama", hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                          num_attention_heads=64, num_key_value_heads=8, head_dim=128, vocab_size=128256,
                          tie_word_embeddings=False),
    "Qwen2.5-1.5B": dict(model_type="qwen2", hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                         num_attention_heads=12, num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "Qwen2.5-7B": dict(model_type="qwen2", hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                       num_attention_heads=28, num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False),
    "Qwen2.5-14B": dict(model_type="qwen2", hidden_size=5120, intermediate_size=13824, num_hidden_layers=48,
                        num_attention_heads=40, num_key_value_heads=8, vocab_size=152064, tie_word_embeddings=False),
    "Qwen3-8B": dict(model_type="qwen3", hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                     tie_word_embeddings=False),
    "Mistral-7B-v0.3": dict(model_type="mistral", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                            num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=32768,
                            tie_word_embeddings=False),
    # MoE: 32 experts, 4 active; 128-token windows on every other layer; learned attention sinks
    "gpt-oss-20b": dict(model_type="gpt_oss", hidden_size=2880, intermediate_size=2880, num_hidden_layers=24,
                        num_attention_heads=64, num_key_value_heads=8, head_dim=64, vocab_size=201088,
                        num_local_experts=32, num_experts_per_tok=4, sliding_window=128,
                        layer_types=["sliding_attention", "full_attention"] * 12, attention_bias=True,
                        tie_word_embeddings=False, max_position_embeddings=131072,
                        rope_parameters=dict(rope_type="yarn", rope_theta=150000.0, factor=32.0, beta_fast=32.0,
                                             beta_slow=1.0, truncate=False, original_max_position_embeddings=4096)),
    # Gemma 3's language model: five layers with 1024-token windows to one with full attention
    "gemma-3-27b": dict(model_type="gemma3_text", hidden_size=5376, intermediate_size=21504, num_hidden_layers=62,
                        num_attention_heads=32, num_key_value_heads=16, head_dim=128, vocab_size=262208,
                        query_pre_attn_scalar=168, sliding_window=1024,
                        layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 10 + ["sliding_attention"] * 2,
                        tie_word_embeddings=True, max_position_embeddings=131072,
                        rope_parameters=dict(full_attention=dict(rope_type="linear", factor=8.0, rope_theta=1e6),
                                             sliding_attention=dict(rope_type="default", rope_theta=10000.0))),
    "gemma-3-12b": dict(model_type="gemma3_text", hidden_size=3840, intermediate_size=15360, num_hidden_layers=48,
                        num_attention_heads=16, num_key_value_heads=8, head_dim=256, vocab_size=262208,
                        query_pre_attn_scalar=256, sliding_window=1024,
                        layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 8,
                        tie_word_embeddings=True, max_position_embeddings=131072,
                        rope_parameters=dict(full_attention=dict(rope_type="linear", factor=8.0, rope_theta=1e6),
                                             sliding_attention=dict(rope_type="default", rope_theta=10000.0))),
}  # fmt: skip

_ALIASES = {k.lower(): k for k in KNOWN_MODELS}
_ALIASES.update({f"meta-llama/{k}".lower(): k for k in KNOWN_MODELS if k.startswith("Llama")})
_ALIASES.update({f"meta-llama/meta-{k}".lower(): k for k in KNOWN_MODELS if k.startswith("Llama")})
_ALIASES.update({f"qwen/{k}".lower(): k for k in KNOWN_MODELS if k.startswith("Qwen")})
_ALIASES.update({f"mistralai/{k}".lower(): k for k in KNOWN_MODELS if k.startswith("Mistral")})
_ALIASES.update({f"openai/{k}".lower(): k for k in KNOWN_MODELS if k.startswith("gpt-oss")})
_ALIASES.update({f"google/{k}-pt".lower(): k for k in KNOWN_MODELS if k.startswith("gemma")})

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a decoder-only transformer that decide its memory."""

    name: str = field(compare=False)
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm on each head's q and k
    qkv_bias: bool = False  # Qwen2
    experts: int = 0  # routed experts of each MoE layer (0: a dense MLP)
    active_experts: int = 0  # experts each token goes through (top-k)
    expert_intermediate: int = 0  # the intermediate size of one expert
    window: int = 0  # the sliding window of the windowed layers (0: none)
    windowed_layers: int = 0  # layers that attend within ``window`` tokens; the others attend to all
    sinks: bool = False  # one learned attention-sink logit per head and layer (GPT-OSS)

    @classmethod
    def from_config(cls, config: dict[str, Any], name: str = "model") -> ModelShape:
        """The shape of a transformers config (a ``config.json`` as a dict)."""
        c = dict(config)
        heads = c["num_attention_heads"]
        experts = int(c.get("num_local_experts") or c.get("num_experts") or c.get("n_routed_experts") or 0)
        window = c.get("sliding_window")
        window = window if isinstance(window, int) and not isinstance(window, bool) and window > 0 else 0
        types = c.get("layer_types")
        if not window:
            windowed = 0
        elif isinstance(types, (list, tuple)):
            windowed = sum(t == "sliding_attention" for t in types[: c["num_hidden_layers"]])
        else:
            windowed = c["num_hidden_layers"] if c.get("use_sliding_window", True) is not False else 0
        return cls(
            name=name,
            hidden=c["hidden_size"],
            intermediate=c["intermediate_size"],
            layers=c["num_hidden_layers"],
            heads=heads,
            kv_heads=c.get("num_key_value_heads") or heads,
            head_dim=c.get("head_dim") or c["hidden_size"] // heads,
            vocab=c["vocab_size"],
            tied=bool(c.get("tie_word_embeddings", False)),
            qk_norm=c.get("model_type") in ("qwen3", "qwen3_moe", "gemma3_text"),
            qkv_bias=bool(c.get("attention_bias", c.get("model_type") == "qwen2")),
            experts=experts,
            active_experts=int(c.get("num_experts_per_tok") or 0) if experts else 0,
            expert_intermediate=int(c.get("moe_intermediate_size") or c["intermediate_size"]) if experts else 0,
            window=window if windowed else 0,
            windowed_layers=windowed,
            sinks=c.get("model_type") == "gpt_oss",
        )

    @property
    def moe(self) -> bool:
        return self.experts > 0

    # parameter counts
    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """``(in, out)`` of the linear layers of one decoder layer, by name. An MoE layer's experts are
        stacked weights in transformers 5 (no ``nn.Linear`` for LoRA's ``target_modules``): only the
        attention projections are listed."""
        h, q, kv, i = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim, self.intermediate
        attention = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h)}
        if self.moe:
            return attention
        return {**attention, "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}

    @property
    def expert_params(self) -> int:
        """Parameters of one MoE layer's experts (gate, up, down each) and router; 0 when dense."""
        return self.experts * 3 * self.hidden * self.expert_intermediate + self.hidden * self.experts

    @property
    def layer_params(self) -> int:
        """Parameters of one decoder layer (linear layers, experts and router, norms, biases, sinks)."""
        n = sum(a * b for a, b in self.linear_shapes().values()) + 2 * self.hidden + self.expert_params
        if self.qkv_bias:
            n += (self.heads + 2 * self.kv_heads) * self.head_dim
        if self.qk_norm:
            n += 2 * self.head_dim
        if self.sinks:
            n += self.heads
        return n

    @property
    def params(self) -> int:
        """Parameters of the whole model: layers, embedding (and untied head), final norm."""
        emb = self.vocab * self.hidden
        return self.layers * self.layer_params + emb * (1 if self.tied else 2) + self.hidden

    def lora_params(self, rank: int, targets: tuple[str, ...] = LORA_TARGETS) -> int:
        """Parameters of rank-``rank`` LoRA adapters on the ``targets`` linear layers of every layer."""
        shapes = self.linear_shapes()
        return self.layers * rank * sum(a + b for t, (a, b) in shapes.items() if t in targets)


def known_config(name: str) -> dict[str, Any] | None:
    """The catalogued config fields of a known model name (with or without its hub prefix), or None."""
    key = _ALIASES.get(str(name).lower())
    return dict(KNOWN_MODELS[key]) if key is not None else None


def model_shape(source: str | dict[str, Any] | ModelShape) -> ModelShape:
    """A ``ModelShape`` from a known name (``KNOWN_MODELS``, e.g. ``Llama-3.1-8B`` or
    ``meta-llama/Llama-3.1-8B``), a local ``config.json`` (or a directory holding one), or a config
    dict. A recipe's model: ``hf_ring.recipes.recipe_model``."""
    if isinstance(source, ModelShape):
        return source
    if isinstance(source, dict):
        return ModelShape.from_config(source)
    key = _ALIASES.get(str(source).lower())
    if key is not None:
        return ModelShape.from_config(KNOWN_MODELS[key], name=key)
    p = Path(source)
    if p.is_dir():
        p = p / "config.json"
    if p.name.endswith(".json") and p.exists():
        return ModelShape.from_config(json.loads(p.read_text()), name=str(source))
    raise ValueError(
        f"unknown model {source!r}: give a known name ({', '.join(KNOWN_MODELS)}), a config.json (or a "
        "directory with one), or, to hf-ring plan, a recipe (a .yaml file or a packaged recipe's name)"
    )
