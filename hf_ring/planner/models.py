"""The shapes of decoder-only models that decide their memory: a catalogue of published configs.

``model_shape("Llama-3.1-8B")`` (a known name, with or without its hub prefix), a transformers
``config.json`` (or a directory holding one), or a config dict gives a ``ModelShape``; nothing is
downloaded. Recipes name their model too: ``hf_ring.recipes.recipe_model`` resolves those.

Hybrid models (Qwen3.5 / Qwen3-Next: Gated DeltaNet and gated full attention, each layer with an MLP;
Nemotron-H: one block per layer, Mamba2, attention or MLP) take their layer pattern from the config
(``layer_types``, ``layers_block_type``, ``hybrid_override_pattern``) into ``ModelShape.blocks``
and the sizes of their linear token mixer into ``MixerShape``. A multimodal config (Qwen3.5's) gives
its language model (``text_config``).

Imports neither torch nor transformers.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["KNOWN_MODELS", "LORA_TARGETS", "MixerShape", "ModelShape", "known_config", "model_shape"]

QWEN3_5_9B_TEXT: dict[str, Any] = dict(
    model_type="qwen3_5_text", hidden_size=4096, intermediate_size=12288, num_hidden_layers=32,
    num_attention_heads=16, num_key_value_heads=4, head_dim=256, vocab_size=248320, tie_word_embeddings=False,
    linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
    linear_conv_kernel_dim=4, max_position_embeddings=262144,
    rope_parameters=dict(rope_type="default", rope_theta=10000000, partial_rotary_factor=0.25,
                         mrope_section=[11, 11, 10], mrope_interleaved=True),
)  # fmt: skip

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
    # Qwen3.5-9B, a multimodal config: its language model (text_config) interleaves 3 Gated DeltaNet
    # layers with one gated full-attention layer; 262K positions natively.
    "Qwen3.5-9B": dict(model_type="qwen3_5", tie_word_embeddings=False, text_config=QWEN3_5_9B_TEXT),
    # Nemotron-H-8B: 24 Mamba2, 4 attention and 24 MLP blocks (transformers' NemotronHConfig defaults).
    "Nemotron-H-8B-Base-8K": dict(model_type="nemotron_h", hidden_size=4096, intermediate_size=21504,
                                  num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=131072,
                                  tie_word_embeddings=False, mamba_num_heads=128, mamba_head_dim=64,
                                  ssm_state_size=128, n_groups=8, conv_kernel=4, chunk_size=128,
                                  hybrid_override_pattern="M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-"),
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
_ALIASES.update({f"nvidia/{k}".lower(): k for k in KNOWN_MODELS if k.startswith("Nemotron")})
_ALIASES.update({f"meta-llama/{k}".lower(): k for k in KNOWN_MODELS if k.startswith("Llama")})
_ALIASES.update({f"meta-llama/meta-{k}".lower(): k for k in KNOWN_MODELS if k.startswith("Llama")})
_ALIASES.update({f"qwen/{k}".lower(): k for k in KNOWN_MODELS if k.startswith("Qwen")})
_ALIASES.update({f"mistralai/{k}".lower(): k for k in KNOWN_MODELS if k.startswith("Mistral")})
_ALIASES.update({f"openai/{k}".lower(): k for k in KNOWN_MODELS if k.startswith("gpt-oss")})
_ALIASES.update({f"google/{k}-pt".lower(): k for k in KNOWN_MODELS if k.startswith("gemma")})

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

# A layer's parts, in order, each after its own RMSNorm: "attention", "mlp", and the linear token
# mixers "gated_deltanet" (Qwen3.5, Qwen3-Next, OLMo-Hybrid) and "mamba2" (Nemotron-H).
ATTENTION_MLP = ("attention", "mlp")
_QWEN_LAYERS = {"full_attention": ("attention", "mlp"), "linear_attention": ("gated_deltanet", "mlp")}
_NEMOTRON_BLOCKS = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}
_NEMOTRON_PARTS = {"mamba": ("mamba2",), "attention": ("attention",), "mlp": ("mlp",), "moe": ("moe",),
                   "linear_attention": ("mamba2",), "full_attention": ("attention",)}  # fmt: skip


@dataclass(frozen=True)
class MixerShape:
    """The linear token mixer of a hybrid's non-attention layers.

    ``gated_deltanet``: ``k_heads`` x ``k_dim`` query/key heads, ``v_heads`` x ``v_dim`` value heads,
    state ``[k_dim, v_dim]`` per value head. ``mamba2``: ``k_heads`` = groups of B/C, ``k_dim`` =
    state size, ``v_heads`` x ``v_dim`` = heads x head dim (x, z), state ``[v_dim, k_dim]`` per head.
    Both: a depthwise causal convolution of kernel ``conv`` over ``2 k_heads k_dim + v_heads v_dim``
    channels; ``chunk``: the chunk length of the chunked kernels."""

    kind: str
    k_heads: int
    v_heads: int
    k_dim: int
    v_dim: int
    conv: int = 4
    chunk: int = 64

    @property
    def conv_channels(self) -> int:
        return 2 * self.k_heads * self.k_dim + self.v_heads * self.v_dim

    @property
    def state_elems(self) -> int:
        """Elements of the recurrent state of one sequence (all heads)."""
        return self.v_heads * self.k_dim * self.v_dim

    @property
    def map_elems(self) -> int:
        """Elements of one run's map of the state in the state passing (``ops.state_passing``): a
        ``[k_dim, k_dim]`` matrix per value head for the delta rule, a decay per head for SSD."""
        return self.v_heads * self.k_dim * self.k_dim if self.kind == "gated_deltanet" else self.v_heads

    def linear_shapes(self, hidden: int) -> dict[str, tuple[int, int]]:
        """``(in, out)`` of the mixer's linear layers, by name (as transformers names them)."""
        v = self.v_heads * self.v_dim
        if self.kind == "gated_deltanet":
            return {"in_proj_qkv": (hidden, self.conv_channels), "in_proj_z": (hidden, v),
                    "in_proj_b": (hidden, self.v_heads), "in_proj_a": (hidden, self.v_heads),
                    "out_proj": (v, hidden)}  # fmt: skip
        return {"in_proj": (hidden, self.conv_channels + v + self.v_heads), "out_proj": (v, hidden)}

    @property
    def other_params(self) -> int:
        """Parameters besides the linear layers: convolution (Mamba2: with bias), per-head decay and
        time step (Mamba2: and D), the gated norm."""
        c = self.conv_channels
        if self.kind == "gated_deltanet":
            return c * self.conv + 2 * self.v_heads + self.v_dim
        return c * (self.conv + 1) + 3 * self.v_heads + self.v_heads * self.v_dim


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
    # hybrids: each layer's parts (empty: every layer is ATTENTION_MLP), the linear mixer's sizes,
    # an output gate on attention (q_proj twice as wide: Qwen3.5, Qwen3-Next), an MLP without gate
    blocks: tuple[tuple[str, ...], ...] = ()
    mixer: MixerShape | None = None
    attn_gate: bool = False
    mlp_gated: bool = True
    experts: int = 0  # routed experts of each MoE layer (0: a dense MLP)
    active_experts: int = 0  # experts each token goes through (top-k)
    expert_intermediate: int = 0  # the intermediate size of one expert
    window: int = 0  # the sliding window of the windowed layers (0: none)
    windowed_layers: int = 0  # layers that attend within ``window`` tokens; the others attend to all
    sinks: bool = False  # one learned attention-sink logit per head and layer (GPT-OSS)

    @classmethod
    def from_config(cls, config: dict[str, Any], name: str = "model") -> ModelShape:
        """The shape of a transformers config (a ``config.json`` as a dict; a multimodal one's
        ``text_config``)."""
        c = dict(config)
        if isinstance(c.get("text_config"), dict):
            c = {**c["text_config"], "tie_word_embeddings": c.get("tie_word_embeddings", False)}
        heads = c["num_attention_heads"]
        blocks, mixer = _hybrid(c)
        mt = str(c.get("model_type", ""))
        experts = c.get("num_local_experts") or c.get("num_experts") or c.get("n_routed_experts") or 0
        experts = 0 if blocks else int(experts)  # a hybrid's experts are its own "moe" part
        window = c.get("sliding_window")
        window = window if isinstance(window, int) and not isinstance(window, bool) and window > 0 else 0
        types = c.get("layer_types")
        if not window or blocks:
            windowed = 0
        elif isinstance(types, (list, tuple)):
            windowed = sum(t == "sliding_attention" for t in types[: c["num_hidden_layers"]])
        else:
            windowed = c["num_hidden_layers"] if c.get("use_sliding_window", True) is not False else 0
        return cls(
            name=name,
            hidden=c["hidden_size"],
            intermediate=c["intermediate_size"],
            layers=len(blocks) or c["num_hidden_layers"],
            heads=heads,
            kv_heads=c.get("num_key_value_heads") or heads,
            head_dim=c.get("head_dim") or c["hidden_size"] // heads,
            vocab=c["vocab_size"],
            tied=bool(c.get("tie_word_embeddings", False)),
            qk_norm=mt in ("qwen3", "qwen3_moe", "gemma3_text") or mt.startswith(("qwen3_5", "qwen3_next")),
            qkv_bias=bool(c.get("attention_bias", mt == "qwen2")),
            blocks=blocks,
            mixer=mixer,
            attn_gate=mt.startswith(("qwen3_5", "qwen3_next")),
            mlp_gated=not mt.startswith("nemotron_h"),
            experts=experts,
            active_experts=int(c.get("num_experts_per_tok") or 0) if experts else 0,
            expert_intermediate=int(c.get("moe_intermediate_size") or c["intermediate_size"]) if experts else 0,
            window=window if windowed else 0,
            windowed_layers=windowed,
            sinks=mt == "gpt_oss",
        )

    @property
    def moe(self) -> bool:
        """The MLP of every layer is a mixture of experts (a plain MoE transformer)."""
        return self.experts > 0

    @property
    def expert_params(self) -> int:
        """Parameters of one MoE layer's experts (gate, up, down each) and router; 0 when dense."""
        return self.experts * 3 * self.hidden * self.expert_intermediate + self.hidden * self.experts

    @property
    def hybrid(self) -> bool:
        """Some layer is not attention + MLP."""
        return bool(self.blocks) and any(b != ATTENTION_MLP for b in self.blocks)

    @property
    def layer_blocks(self) -> tuple[tuple[str, ...], ...]:
        """Every layer's parts (``ATTENTION_MLP`` for each layer of a plain transformer)."""
        return self.blocks or (ATTENTION_MLP,) * self.layers

    def part_shapes(self, part: str) -> dict[str, tuple[int, int]]:
        """``(in, out)`` of the linear layers of one part of a layer, by name."""
        h, q, kv, i = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim, self.intermediate
        if part == "attention":
            return {"q_proj": (h, q * (2 if self.attn_gate else 1)), "k_proj": (h, kv), "v_proj": (h, kv),
                    "o_proj": (q, h)}  # fmt: skip
        if part == "mlp" and self.moe:
            return {}  # stacked expert weights in transformers 5: no nn.Linear for LoRA's target_modules
        if part == "mlp":
            return {"gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)} if self.mlp_gated else \
                {"up_proj": (h, i), "down_proj": (i, h)}  # fmt: skip
        if part in ("gated_deltanet", "mamba2") and self.mixer is not None:
            return self.mixer.linear_shapes(h)
        raise ValueError(f"{self.name}: no sizes for a layer part {part!r} (the planner prices attention, mlp, "
                         "gated_deltanet and mamba2; mixture-of-experts blocks are not priced yet)")  # fmt: skip

    def part_params(self, part: str) -> int:
        """Parameters of one part of a layer: linear layers, its RMSNorm, biases, q/k norms, the
        mixer's convolution, decays and gated norm."""
        n = sum(a * b for a, b in self.part_shapes(part).values()) + self.hidden
        if part == "attention":
            if self.qkv_bias:
                n += (self.heads + 2 * self.kv_heads) * self.head_dim
            if self.qk_norm:
                n += 2 * self.head_dim
            if self.sinks:
                n += self.heads
        elif part == "mlp":
            n += self.expert_params
        elif part != "mlp" and self.mixer is not None:
            n += self.mixer.other_params
        return n

    # parameter counts
    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """``(in, out)`` of the linear layers of an attention + MLP layer, by name."""
        return {**self.part_shapes("attention"), **self.part_shapes("mlp")}

    @property
    def layer_params(self) -> int:
        """Parameters of the largest decoder layer (linear layers, norms, biases, mixer parameters)."""
        return max(sum(self.part_params(p) for p in parts) for parts in set(self.layer_blocks))

    @property
    def params(self) -> int:
        """Parameters of the whole model: layers, embedding (and untied head), final norm."""
        emb = self.vocab * self.hidden
        layers = sum(sum(self.part_params(p) for p in parts) for parts in self.layer_blocks)
        return layers + emb * (1 if self.tied else 2) + self.hidden

    def lora_params(self, rank: int, targets: tuple[str, ...] = LORA_TARGETS) -> int:
        """Parameters of rank-``rank`` LoRA adapters on the ``targets`` linear layers of every layer."""
        return rank * sum(a + b for parts in self.layer_blocks for p in parts
                          for t, (a, b) in self.part_shapes(p).items() if t in targets)  # fmt: skip


def _hybrid(c: dict[str, Any]) -> tuple[tuple[tuple[str, ...], ...], MixerShape | None]:
    """A config's layer pattern (each layer's parts) and linear mixer; ``((), None)`` for a plain
    transformer."""
    mt = str(c.get("model_type", ""))
    if "linear_num_value_heads" in c:  # Qwen3.5, Qwen3-Next: Gated DeltaNet layers
        types = c.get("layer_types")
        if not types:
            every = c.get("full_attention_interval", 4)
            n = c["num_hidden_layers"]
            types = ["full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(n)]
        mixer = MixerShape("gated_deltanet", c["linear_num_key_heads"], c["linear_num_value_heads"],
                           c["linear_key_head_dim"], c["linear_value_head_dim"],
                           c.get("linear_conv_kernel_dim", 4))  # fmt: skip
        ffn = "moe" if c.get("num_experts") else "mlp"  # Qwen3.5-MoE, Qwen3-Next: experts (not priced yet)
        return tuple((_QWEN_LAYERS[t][0], ffn) for t in types), mixer
    if mt.startswith("nemotron_h"):
        types = c.get("layers_block_type") or c.get("layer_types")
        if not types:
            types = [_NEMOTRON_BLOCKS[ch] for ch in c["hybrid_override_pattern"]]
        mixer = MixerShape("mamba2", c.get("n_groups", 8), c["mamba_num_heads"], c.get("ssm_state_size", 128),
                           c["mamba_head_dim"], c.get("conv_kernel", 4), c.get("chunk_size", 128))  # fmt: skip
        return tuple(_NEMOTRON_PARTS[t] for t in types), mixer
    return (), None


def known_config(name: str) -> dict[str, Any] | None:
    """The catalogued config fields of a known model name (with or without its hub prefix), or None."""
    key = _ALIASES.get(str(name).lower())
    return copy.deepcopy(KNOWN_MODELS[key]) if key is not None else None


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
