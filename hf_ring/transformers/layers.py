"""Head groups and tiled decoder layers on a transformers model: opt-in, undone by ``disable_head_groups`` /
``disable_tiled_layers`` (and by ``hf_ring.uninstall()``).

- ``enable_head_groups(model, G)``: every attention module runs its heads in ``G`` groups inside the ring
  (``ops.ring``: the ring's accumulators and messages for one group at a time). The number is hf_ring's own
  record of the module (``attention.HEAD_GROUPS``, a weak map the attention function reads); nothing on the
  model changes.
- ``enable_tiled_layers(model, tile_tokens)``: every decoder layer of a supported family (``LAYERS``) runs
  its attention half as ``ops.tiled_layer.attention_block`` (its norm, projections with their LoRA
  adapters, per-head norms and RoPE over tiles of ``tile_tokens``; attention one head group at a time,
  the module's head groups) and its MLP half with its norm over tiles (``ops.tiled_mlp``); the final norm
  over tiles too. What that attention call is, and every check of it, is the attention function's own
  (``attention.ring_call``), asked with the keyword arguments the layer's attention module would pass. A
  call without the batch's ``ring_context`` (one process's semantics: ``attention.one_process_attention``),
  of CP decoding, with another attention implementation or with a KV cache runs the layer's own forward.
  Each layer's and the final norm's ``forward`` is replaced through the ledger (``hf_ring.ledger.LEDGER``,
  scope ``"model"``); what the tiled forward reads (the tile, the layer's own forward function, its place,
  the offload's stride) lives in hf_ring's weak maps here, never on the model.

``CHANGES`` is the table of what changes; ``changed(model)`` lists what is in effect on a model.
The computations are the ops'; this module finds the modules and wires them in.
"""

from __future__ import annotations

import functools
import sys
import types
import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from ..errors import RingNotSupported
from ..ledger import LEDGER
from ..ops.ring import head_groups_of
from ..ops.tiled_layer import AttentionSpec, Linear, attention_block
from ..ops.tiled_mlp import tiled_forward
from .attention import HEAD_GROUPS, head_groups, ring_call
from .carry import context_of
from .patches import causal_lm, decoder, offloaded

__all__ = ["CHANGES", "LAYERS", "changed", "disable_head_groups", "disable_tiled_layers", "enable_head_groups",
           "enable_tiled_layers", "forget", "markdown"]  # fmt: skip

# decoder layers whose structure the tiled forward computes: pre-norm, input_layernorm -> self_attn (q, k, v,
# o projections; Qwen3's per-head q_norm / k_norm; RoPE) -> residual, post_attention_layernorm -> mlp ->
# residual; and how each one's attention module passes its sliding window to the attention function
LAYERS: dict[str, Any] = {
    "LlamaDecoderLayer": None,
    "Qwen2DecoderLayer": lambda attn: attn.sliding_window,
    "Qwen3DecoderLayer": lambda attn: attn.sliding_window,
    "MistralDecoderLayer": lambda attn: getattr(attn.config, "sliding_window", None),
}

LAYER_WHY = ("`enable_tiled_layers`: the decoder layer's `forward` is the tiled layer (`layers.tiled_layer_forward`), "
             "its halves over tiles and its attention one head group at a time")  # fmt: skip
NORM_WHY = "`enable_tiled_layers`: the final norm's `forward` runs over tiles, saving only its input"

CHANGES = (
    ("`<decoder layer>.forward`", "instance attribute (ledger entry, scope model)", "enable_tiled_layers",
     "the tiled layer (`layers.tiled_layer_forward`): checkpointed as the layer's own forward is; a call "
     "without the batch's `ring_context`, of CP decoding, with another attention implementation or with a KV "
     "cache runs the layer's own forward"),
    ("`<decoder>.norm.forward`", "instance attribute (ledger entry, scope model)", "enable_tiled_layers",
     "the final norm over tiles, saving only its input (`ops.tiled_mlp.tiled_forward`)"),
    ("`<attention module>`'s head groups", "none: hf_ring's weak map `attention.HEAD_GROUPS`",
     "enable_head_groups", "the number of head groups the ring attention function (and the tiled layer) runs"),
)  # fmt: skip


@dataclass
class _Tiled:
    tile: int
    function: Any  # the layer's own forward function, unbound (a bound one would keep the layer alive)
    window: Any  # how its attention passes the sliding window (LAYERS)
    index: int = 0  # the layer's place in the decoder
    every: int = 1  # offload every ``every``-th layer's input; the others are made again from it
    lm: Any = None  # a weak reference to the causal LM (its offload)


_LAYERS: weakref.WeakKeyDictionary[nn.Module, _Tiled] = weakref.WeakKeyDictionary()  # decoder layer -> its tiling
_NORMS: weakref.WeakKeyDictionary[nn.Module, tuple[Any, int]] = weakref.WeakKeyDictionary()  # norm -> (function, tile)


def markdown() -> str:
    """``CHANGES`` as a Markdown table (docs/transformers.md shows it; tests/test_docs.py holds them equal)."""
    rows = ["| what changes | kind | by | effect |", "|---|---|---|---|"]
    rows += [f"| {what} | {kind} | `{by}` | {effect} |" for what, kind, by, effect in CHANGES]
    return "\n".join(rows)


def changed(model: nn.Module) -> list[tuple[str, str, str]]:
    """What the functions of this module changed on ``model`` and is in effect: ``(module, what, function)``
    per change -- ``"forward"`` (a ledger entry of the module) or ``"head groups"`` (hf_ring's record)."""
    lm = causal_lm(model, "changed")
    out = []
    for name, m in lm.named_modules():
        if (m in _LAYERS or m in _NORMS) and LEDGER.find(m, "forward") is not None:
            out.append((name, "forward", "enable_tiled_layers"))
        if m in HEAD_GROUPS:
            out.append((name, "head groups", "enable_head_groups"))
    return out


def forget() -> None:
    """Forget the head groups and tiled layers of every model (``uninstall``, after the ledger undid the changes)."""
    for kept in (HEAD_GROUPS, _LAYERS, _NORMS):
        kept.clear()


# --- head groups -------------------------------------------------------------------------------------


def _attention_modules(lm: nn.Module) -> list[nn.Module]:
    return [m for m in lm.modules() if all(isinstance(getattr(m, n, None), nn.Module) for n in ("q_proj", "o_proj"))
            and hasattr(getattr(m, "config", None), "num_key_value_heads")]  # fmt: skip


def enable_head_groups(model: nn.Module, groups: int) -> nn.Module:
    """Run every attention module's heads in ``groups`` groups inside the ring (``ring_attention``'s
    ``head_groups``; ``groups`` must divide the K/V heads: GQA groups stay whole). Exact; idempotent (a
    second call changes the number); ``1`` undoes it. The number is hf_ring's record of each module
    (``attention.HEAD_GROUPS``); the model is not changed. Returns ``model``."""
    lm = causal_lm(model, "enable_head_groups")
    mods = _attention_modules(lm)
    if groups != 1:
        if not mods:
            raise TypeError(f"enable_head_groups: no attention module with q_proj/o_proj in {type(lm).__name__}")
        for m in mods:
            heads, kv = m.config.num_attention_heads, m.config.num_key_value_heads
            try:
                head_groups_of(heads, kv, groups, "enable_head_groups")
            except ValueError as e:
                raise RingNotSupported(f"{e} (head_groups of RingTrainingArguments, a recipe's head_groups)") from None
    disable_head_groups(model)
    if groups != 1:
        for m in mods:
            HEAD_GROUPS[m] = int(groups)
    return model


def disable_head_groups(model: nn.Module) -> nn.Module:
    """Undo ``enable_head_groups``: every attention module of ``model`` runs its heads at once again."""
    for m in causal_lm(model, "disable_head_groups").modules():
        HEAD_GROUPS.pop(m, None)
    return model


# --- tiled layers ------------------------------------------------------------------------------------


def _linear(m: nn.Module, where: str) -> Linear:
    """A linear layer as ``Linear``: an ``nn.Linear``, or PEFT's LoRA layer around one."""
    if type(m).forward is nn.Linear.forward and isinstance(m, nn.Linear):
        return Linear(m.weight, m.bias)
    base, lora_a = getattr(m, "base_layer", None), getattr(m, "lora_A", None)
    if isinstance(base, nn.Module) and isinstance(lora_a, nn.ModuleDict):
        if getattr(m, "disable_adapters", False) or getattr(m, "merged", False):
            if getattr(m, "merged", False) and getattr(m, "disable_adapters", False):
                raise RingNotSupported(f"tiled layers: {where} has merged adapters that are disabled; unmerge them")
            return _linear(base, where)
        adapters = []
        for name in m.active_adapters:
            if name not in lora_a:
                continue
            drop = m.lora_dropout[name]
            if name in getattr(m, "lora_variant", {}) or m.lora_A[name].bias is not None or \
                    m.lora_B[name].bias is not None:  # fmt: skip
                raise RingNotSupported(
                    f"tiled layers: {where}'s adapter {name!r} is a LoRA variant (DoRA, ...) or has a bias, which the "
                    "tiled layer does not compute; train without tiled_layers"
                )
            if not isinstance(drop, nn.Identity) and m.training and getattr(drop, "p", 0.0) > 0:
                raise RingNotSupported(
                    f"tiled layers: {where}'s adapter {name!r} has lora_dropout={drop.p}, a random mask the tiled "
                    "layer would draw again in its backward; set lora_dropout=0 or train without tiled_layers"
                )
            adapters.append((m.lora_A[name].weight, m.lora_B[name].weight, float(m.scaling[name])))
        inner = _linear(base, where)
        return Linear(inner.weight, inner.bias, tuple(adapters), getattr(m, "cast_input_dtype_enabled", True))
    raise RingNotSupported(
        f"tiled layers: {where} is a {type(m).__name__}, neither torch's nn.Linear nor PEFT's LoRA layer around "
        "one, so the tiled layer cannot take its rows apart; train without tiled_layers"
    )


def _spec(layer: nn.Module) -> AttentionSpec:
    attn = layer.self_attn
    cfg = attn.config
    rope = getattr(sys.modules.get(type(attn).__module__), "apply_rotary_pos_emb", None)
    if rope is None:
        raise RingNotSupported(f"tiled layers: {type(attn).__name__}'s module has no apply_rotary_pos_emb")
    qn, kn = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
    name = type(layer).__name__
    return AttentionSpec(
        q=_linear(attn.q_proj, f"{name}.q_proj"), k=_linear(attn.k_proj, f"{name}.k_proj"),
        v=_linear(attn.v_proj, f"{name}.v_proj"), o=_linear(attn.o_proj, f"{name}.o_proj"),
        heads=cfg.num_attention_heads, kv_heads=cfg.num_key_value_heads, head_dim=attn.head_dim,
        norm=layer.input_layernorm, norm_params=tuple(layer.input_layernorm.parameters()),
        q_norm=qn, k_norm=kn, qk_norm_params=tuple(p for n in (qn, kn) if n is not None for p in n.parameters()),
        rope=rope,
    )  # fmt: skip


def tiled_layer_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Tensor:
    """A decoder layer's forward with the ring, its halves over tiles (installed by ``enable_tiled_layers``)."""
    state = _LAYERS[self]
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    ring = getattr(self.self_attn.config, "_attn_implementation", None) == "ring"
    ctx = context_of(kwargs)
    if not ring or cache is not None or kwargs.get("position_embeddings") is None or ctx is None or \
            ctx.decode is not None:  # fmt: skip
        # the layer's own forward: one process's attention without a ring_context, the KV cache of CP decoding
        return state.function(self, *args, **kwargs)
    kwargs.pop("cache", None)
    kwargs.pop("past_key_values", None)
    out = None
    if getattr(self, "gradient_checkpointing", False) and self.training and torch.is_grad_enabled():
        fn = getattr(self, "_gradient_checkpointing_func", None)
        if fn is not None:  # as transformers' GradientCheckpointingLayer checkpoints the layer's own forward
            out = fn(functools.partial(_tiled_body, self, **kwargs), *args)
    if out is None:
        out = _tiled_body(self, *args, **kwargs)
    offload = _offload(state)
    source = args[0] if args else kwargs.get("hidden_states")
    if offload is not None and source is not None and state.index % state.every != state.every - 1:
        # the next layer's input is not stored: backward makes it again from this layer's input
        rest = {k: v for k, v in kwargs.items() if k != "hidden_states"}
        offload.recompute_from(out, source, functools.partial(_tiled_body, self, **rest))
    return out


def _offload(state: _Tiled) -> Any:
    """The model's activation offload, when the layers' inputs are offloaded every ``state.every`` layers."""
    if state.every == 1 or state.lm is None:
        return None
    lm = state.lm()
    return None if lm is None else offloaded(lm)


def _tiled_body(
    self: nn.Module, hidden_states: Tensor, attention_mask: Any = None, position_ids: Tensor | None = None,
    use_cache: bool | None = False, position_embeddings: tuple[Tensor, Tensor] | None = None, **kwargs: Any,
) -> Tensor:  # fmt: skip
    state = _LAYERS[self]
    attn = self.self_attn
    b, s, _ = hidden_states.shape
    cfg = attn.config
    passed = dict(kwargs, position_ids=position_ids, use_cache=use_cache)  # what the attention module passes on
    ctx = context_of(passed)
    passed.pop("ring_context", None)
    if state.window is not None:
        passed["sliding_window"] = state.window(attn)
    call, sinks = ring_call(
        attn, attention_mask, ctx, shape=(b, cfg.num_attention_heads, s, attn.head_dim), keys=s,
        scaling=attn.scaling, dropout=0.0 if not attn.training else attn.attention_dropout, **passed,
    )  # fmt: skip
    if sinks is not None:
        raise RingNotSupported(f"tiled layers: {type(attn).__name__} has attention sinks; train without tiled_layers")
    cos, sin = position_embeddings  # type: ignore[misc]
    y = attention_block(
        hidden_states, _spec(self), call, cos=cos, sin=sin, tile=state.tile, head_groups=head_groups(attn)
    )
    h = hidden_states + y
    del y
    norm, mlp = self.post_attention_layernorm, self.mlp
    z = tiled_forward(None, lambda t: mlp(norm(t)), h, state.tile, params=[*norm.parameters(), *mlp.parameters()])
    return h + z


def _tiled_norm(self: nn.Module, x: Tensor) -> Tensor:
    function, tile = _NORMS[self]
    return tiled_forward(self, types.MethodType(function, self), x, tile)


def _own_forward(module: nn.Module, caller: str) -> Any:
    """``module``'s forward function, unbound (the class's, or the one bound to it as an instance attribute)."""
    forward = module.forward
    function = getattr(forward, "__func__", None)
    if function is None or getattr(forward, "__self__", None) is not module:
        raise TypeError(f"{caller}: {type(module).__name__}.forward is not a method of the module")
    return function


def enable_tiled_layers(model: nn.Module, tile_tokens: int = 8192, offload_every: int = 1) -> nn.Module:
    """Run every decoder layer of ``model`` (Llama, Qwen2, Qwen3, Mistral: ``LAYERS``) over tiles of
    ``tile_tokens`` tokens with its heads in the module's head groups (``enable_head_groups``), and the
    final norm over tiles (``ops.tiled_layer``, ``ops.tiled_mlp``): no full-length norm, projection or
    adapter temporary, and q, k, v with their gradients for one head group at a time. Exact. Works on
    plain, PEFT- and DDP-wrapped models, with activation checkpointing (and offload); idempotent (a second
    call changes the tile). Other decoder layers raise ``RingNotSupported``. Each layer's and the final
    norm's ``forward`` is a ledger entry of the model (``hf_ring.ledger.LEDGER``). Returns ``model``.

    ``offload_every=2``, with the offload on (``enable_activation_checkpointing(model, offload=True)``):
    only every other layer's input goes to host memory; the input of each layer between is made again in
    backward by running the layer before it once more, without gradients (``OffloadActivations.
    recompute_from``): half the host memory, for one more forward of half the layers."""
    if isinstance(tile_tokens, bool) or not isinstance(tile_tokens, int) or tile_tokens < 1:
        raise ValueError(f"enable_tiled_layers: tile_tokens must be a positive int, not {tile_tokens!r}")
    if offload_every not in (1, 2):
        raise ValueError(f"enable_tiled_layers: offload_every must be 1 (every layer's input) or 2, not "
                         f"{offload_every!r}")  # fmt: skip
    lm = causal_lm(model, "enable_tiled_layers")
    dec = decoder(lm, "enable_tiled_layers")
    layers = getattr(dec, "layers", None)
    if not isinstance(layers, nn.ModuleList) or not len(layers):
        raise TypeError(f"enable_tiled_layers: {type(dec).__name__} has no decoder layers (.layers)")
    others = sorted({type(layer).__name__ for layer in layers} - set(LAYERS))
    if others:
        raise RingNotSupported(
            f"tiled layers: {', '.join(others)} is not a layer the tiled forward computes (it does: "
            f"{', '.join(LAYERS)}); train without tiled_layers"
        )
    disable_tiled_layers(model)
    norm = getattr(dec, "norm", None)
    norm = norm if isinstance(norm, nn.Module) else None
    functions = [_own_forward(layer, "enable_tiled_layers") for layer in layers]
    norm_function = _own_forward(norm, "enable_tiled_layers") if norm is not None else None
    for i, (layer, function) in enumerate(zip(layers, functions)):
        _LAYERS[layer] = _Tiled(tile_tokens, function, LAYERS[type(layer).__name__], i, offload_every, weakref.ref(lm))
        LEDGER.set_attr(layer, "forward", types.MethodType(tiled_layer_forward, layer), why=LAYER_WHY, scope="model")
    if norm is not None:
        _NORMS[norm] = (norm_function, tile_tokens)
        LEDGER.set_attr(norm, "forward", types.MethodType(_tiled_norm, norm), why=NORM_WHY, scope="model")
    return model


def disable_tiled_layers(model: nn.Module) -> nn.Module:
    """Undo ``enable_tiled_layers``: every layer's and the final norm's forward as before (their ledger entries
    undone)."""
    for m in causal_lm(model, "disable_tiled_layers").modules():
        was_tiled = _LAYERS.pop(m, None) is not None
        was_tiled = _NORMS.pop(m, None) is not None or was_tiled
        entry = LEDGER.find(m, "forward") if was_tiled else None
        if entry is not None:
            LEDGER.undo(entry)
    return model
