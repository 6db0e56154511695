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
}  # fmt: skip

_ALIASES = {k.lower(): k for k in KNOWN_MODELS}
_ALIASES.update({f"meta-llama/{k}".lower(): k for k in KNOWN_MODELS if k.startswith("Llama")})
_ALIASES.update({f"meta-llama/meta-{k}".lower(): k for k in KNOWN_MODELS if k.startswith("Llama")})
_ALIASES.update({f"qwen/{k}".lower(): k for k in KNOWN_MODELS if k.startswith("Qwen")})
_ALIASES.update({f"mistralai/{k}".lower(): k for k in KNOWN_MODELS if k.startswith("Mistral")})

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

    @classmethod
    def from_config(cls, config: dict[str, Any], name: str = "model") -> ModelShape:
        """The shape of a transformers config (a ``config.json`` as a dict)."""
        c = dict(config)
        heads = c["num_attention_heads"]
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
            qk_norm=c.get("model_type") in ("qwen3", "qwen3_moe"),
            qkv_bias=bool(c.get("attention_bias", c.get("model_type") == "qwen2")),
        )

    # parameter counts
    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """``(in, out)`` of the linear layers of one decoder layer, by name."""
        h, q, kv, i = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim, self.intermediate
        return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
                "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}  # fmt: skip

    @property
    def layer_params(self) -> int:
        """Parameters of one decoder layer (linear layers, norms, biases)."""
        n = sum(a * b for a, b in self.linear_shapes().values()) + 2 * self.hidden
        if self.qkv_bias:
            n += (self.heads + 2 * self.kv_heads) * self.head_dim
        if self.qk_norm:
            n += 2 * self.head_dim
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
