"""Which models and options ring attention computes exactly, and a clear refusal for the rest.

Ring attention replaces one thing, the attention of each layer, by attention over the whole
sequence. Everything else in the model must then act on each token alone, or be something the
ring reproduces. ``check_layer`` runs at every ring attention call (plain attribute reads) and
raises ``RingNotSupported`` -- naming the model, the reason and the alternative -- for:

- sequence mixers outside the attention registry (Mamba/SSM mixers, gated DeltaNet, lightning
  and other linear attention, short convolutions, RG-LRU, ...) that have no context-parallel form
  (``mixers.FAMILIES`` routes the rest): they would run on the local zigzag shard as if it were a
  contiguous sequence;
- restrictions that live only in the model, or in a mask the ring cannot read (a sliding window or
  chunked attention that the model's own mask does not state -- the ring computes the ones
  transformers' mask functions apply, ``_check_mask`` --);
- the MoE router's auxiliary loss with a nonzero coefficient in models whose loss ``router.py``
  does not compute over the CP group;
- dropout, additive bias, KV-cache decoding, dynamic RoPE; a window on a non-causal layer (logit
  soft-capping and attention sinks are computed exactly inside the ring, windowed layers included).

A call without the batch's ``ring_context`` (a model called without ``shard_batch``) never reaches
``check_layer``: every rank holds the whole batch then, and it computes what one process computes
(``attention.one_process_attention``).

``check_layer`` also refuses, at CP > 1, causal LMs that compute their loss themselves (hf_ring sums
the loss over the CP group through the model's ``loss_function``), and RoBERTa-style models that
number positions from the padding index when ``shard_batch`` had to number them.
``REFUSED_AT_BUILD`` names the models that cannot run the ring at all -- those that pick their
attention class from a table of their own, and the few that call neither the attention nor the loss
registry -- which ``install`` refuses while they are built. The sweep in
``tests/test_model_sweep.py`` builds every causal-LM family of the installed transformers and holds
each to "exact or refused".

The exceptions (``RingNotSupported``, ``RingMaskUsed``, ``RingNeverRan``) live in ``hf_ring.errors``
and are re-exported here.
"""

from __future__ import annotations

import functools
import inspect
import re
import sys
from typing import Any

from torch import nn

from ..errors import RingMaskUsed, RingNeverRan, RingNotSupported
from .mixers import routed_classes
from .router import routed

__all__ = ["REFUSED_AT_BUILD", "RingMaskUsed", "RingNeverRan", "RingNotSupported", "check_layer", "check_model",
           "refuse_at_build"]  # fmt: skip


def model_name(config: Any) -> str:
    return str(getattr(config, "model_type", None) or type(config).__name__)


# Class names of token-mixing modules that do not go through transformers' attention registry.
_MIXERS = re.compile(
    r"Mamba|Mixer|DeltaNet|DeltaAttention|Lightning|LinearAttention|ShortConv|CausalConv|CCAProjection|Rglru"
    r"|RecurrentBlock|Rwkv|xLSTM|Lstm|Retention"
)
_NOT_TEXT = re.compile(r"Audio|Vision|VQVAE|Image|Video")


@functools.cache
def sequence_mixers(modeling_module: str) -> tuple[str, ...]:
    """Classes of a transformers modeling module that mix tokens outside the attention registry."""
    mod = sys.modules.get(modeling_module)
    if mod is None:
        return ()
    return tuple(
        sorted(
            name
            for name, obj in vars(mod).items()
            if isinstance(obj, type)
            and issubclass(obj, nn.Module)
            and obj.__module__ == modeling_module
            and _MIXERS.search(name)
            and not _NOT_TEXT.search(name)
        )
    )


def _model_classes(modeling_module: str) -> list[type]:
    from transformers import PreTrainedModel

    mod = sys.modules.get(modeling_module)
    return [
        obj
        for obj in (vars(mod).values() if mod is not None else ())
        if isinstance(obj, type) and issubclass(obj, PreTrainedModel) and obj.__module__ == modeling_module
    ]


@functools.cache
def computes_own_loss(modeling_module: str) -> tuple[str, ...]:
    """Causal-LM classes of a modeling module whose forward computes the loss itself instead of
    calling transformers' loss registry (``self.loss_function``), which hf_ring sums over CP."""
    own = []
    for cls in _model_classes(modeling_module):
        if not cls.__name__.endswith(("ForCausalLM", "LMHeadModel")):
            continue
        try:
            src = inspect.getsource(cls.forward)
        except (OSError, TypeError):
            continue
        if "labels" in src and "loss_function" not in src:
            own.append(cls.__name__)
    return tuple(sorted(own))


@functools.cache
def numbers_positions_from_ids(modeling_module: str) -> bool:
    """The module's embeddings derive positions from the input ids (``padding_idx + 1 + ...``)
    when no ``position_ids`` are given (RoBERTa and its relatives)."""
    mod = sys.modules.get(modeling_module)
    if mod is None:
        return False
    return hasattr(mod, "create_position_ids_from_input_ids") or any(
        isinstance(o, type) and hasattr(o, "create_position_ids_from_input_ids") for o in vars(mod).values()
    )


def router_loss_coefficient(config: Any) -> float:
    """The weight of the MoE load-balancing loss, under any of the names transformers' models use."""
    for holder in (config, getattr(config, "ffn_config", None)):
        for name in ("router_aux_loss_coef", "aux_loss_coef", "moe_loss_weight"):
            value = getattr(holder, name, None) if holder is not None else None
            if isinstance(value, (int, float)) and value:
                return float(value)
    return 0.0


def _layer_type(module: nn.Module, config: Any) -> str | None:
    types = getattr(config, "layer_types", None)
    idx = getattr(module, "layer_idx", None)
    if isinstance(types, (list, tuple)) and isinstance(idx, int) and 0 <= idx < len(types):
        return str(types[idx])
    return None


def _mask_window(module: nn.Module, config: Any) -> int | None:
    """The sliding window of this layer as the model's mask would apply it, from its config."""
    window = getattr(config, "sliding_window", None)
    if not isinstance(window, int) or isinstance(window, bool) or window <= 0:
        return None
    kind = _layer_type(module, config)
    if kind is not None:
        return window if kind == "sliding_attention" else None
    if getattr(config, "use_sliding_window", True) is False:
        return None
    return window


def _check_mask(module: nn.Module, config: Any, name: str, kwargs: dict[str, Any], n_global: int, mask: Any) -> None:
    """Refuse a window or chunk the ring cannot take from the model's own mask.

    The model's mask is the truth (its SDPA and eager paths apply nothing else): a config field such
    as ``sliding_window`` that the mask ignores is ignored (moshi), and a window the mask applies is
    computed. Refused: a layer that passes ``sliding_window=`` to the attention function but whose
    mask applies another window (flash-attn would apply the keyword, SDPA the mask), a chunked layer
    whose mask has no chunks, a local mask the ring cannot name, and -- without the mask (a model
    that builds no mask through transformers' mask functions) -- any window or chunk shorter than the sequence.
    """
    kw = kwargs.get("sliding_window")
    chunk = getattr(config, "attention_chunk_size", None)
    chunked = _layer_type(module, config) == "chunked_attention" and isinstance(chunk, int) and chunk < n_global
    if mask is None:
        window = kw if kw is not None else (_mask_window(module, config) if config is not None else None)
        if window is not None and window < n_global:
            raise RingNotSupported(
                f'attn_implementation="ring": this {name} layer has a sliding window of {window} tokens, shorter '
                f"than the sequence ({n_global}), and the ring did not make its mask (the model builds no mask "
                "through transformers' mask functions), so it cannot tell which "
                "window the model applies. Pass the batch through hf_ring.shard_batch, or set "
                "config.sliding_window = None (Mistral) / config.use_sliding_window = False (Qwen2) to train "
                "with full attention."
            )
        if chunked:
            raise RingNotSupported(
                f'attn_implementation="ring": this {name} layer attends within chunks of {chunk} tokens '
                f"(attention_chunk_size), shorter than the sequence ({n_global}), and the ring did not make its "
                "mask. Pass the batch through hf_ring.shard_batch, or set "
                f"config.attention_chunk_size >= {n_global}."
            )
        return
    if mask.unknown is not None and mask.local_size == 0:
        raise RingNotSupported(
            f'attn_implementation="ring": this {name} layer\'s causal mask carries mask functions of the model\'s '
            "own (a bidirectional prefix or image blocks, transformers' or_mask_function / and_mask_function), "
            "which the ring does not compute. Run this model with another attn_implementation."
        )
    if mask.unknown is not None and mask.local_size < n_global:
        raise RingNotSupported(
            f'attn_implementation="ring": this {name} layer\'s mask is local over {mask.local_size} tokens, '
            f"shorter than the sequence ({n_global}), but {mask.unknown}, so the ring cannot compute it exactly. "
            "Keep sequences within that length, or train with cp_size=1 and another attn_implementation."
        )
    if kw is not None and kw < n_global and kw != mask.window:
        raise RingNotSupported(
            f'attn_implementation="ring": this {name} layer passes sliding_window={kw} to the attention function '
            f"but its mask applies {f'a window of {mask.window}' if mask.window else 'no window'}; the model "
            "computes different attention with flash-attn and with SDPA, so the ring cannot tell which is meant. "
            "Set config.sliding_window to the window the model should apply, or None."
        )
    if chunked and mask.chunk != chunk:
        raise RingNotSupported(
            f'attn_implementation="ring": this {name} layer is a chunked-attention layer (chunks of {chunk} '
            "tokens) but its mask has no chunks, so the ring cannot tell which attention is meant. Set "
            f"config.attention_chunk_size >= {n_global}."
        )


def _check_mixers(name: str, modeling_module: str, mixers: tuple[str, ...]) -> None:
    """Mixers routed through their context-parallel form (``mixers.FAMILIES``) are exact on batches from
    ``shard_batch``; any other mixer class is refused."""
    routed_here = set(routed_classes(modeling_module))
    unrouted = [m for m in mixers if m not in routed_here]
    if unrouted:
        raise RingNotSupported(
            f'attn_implementation="ring": {name} mixes tokens outside attention ({", ".join(unrouted)}); those '
            "layers would run on each rank's zigzag shard as if it were the whole sequence, and hf_ring has no "
            "context-parallel form of them. Train this model without context parallelism (cp_size=1) or with "
            "another attn_implementation."
        )


def _check_router_loss(name: str, modeling_module: str, coef: float) -> None:
    """The router load-balancing loss is exact over the CP group where ``router.routed`` says it has a
    context-parallel form; refused otherwise."""
    if not routed(modeling_module):
        raise RingNotSupported(
            f'attn_implementation="ring": {name} adds the router load-balancing loss '
            f"(coefficient {coef}) after the language-model loss, computed from this rank's "
            "router logits only, so each rank would train on a different loss, and hf_ring has no "
            "context-parallel form of this model's loss. Set config.output_router_logits = False "
            "(or router_aux_loss_coef = 0) for context-parallel training."
        )


def check_layer(
    module: nn.Module,
    kwargs: dict[str, Any],
    n_global: int,
    labelled: bool,
    cp_size: int,
    positions_given: bool = True,
    mask: Any = None,
) -> None:
    """Raise ``RingNotSupported`` if this attention call cannot be computed exactly by the ring.

    ``module``: the attention module transformers called us from; ``kwargs``: the keyword
    arguments it passed (``sliding_window``, ``softcap``, ``output_router_logits``, ...);
    ``n_global``: the whole sequence's length; ``labelled``: the batch computes a loss;
    ``positions_given``: the batch came with its own ``position_ids``;
    ``mask``: what the model's own mask function applies, as the ring's mask function read it (an
    object with ``window``, ``chunk``, ``unknown``: ``attention.RingMask``), ``None`` when the model
    made no mask through it (windows and chunks shorter than the sequence are then refused), or
    ``"static"`` (``check_model``: not known before the forward, not checked).
    """
    config = getattr(module, "config", None)
    name = model_name(config)
    mixers = sequence_mixers(type(module).__module__)
    if mixers and cp_size > 1:
        _check_mixers(name, type(module).__module__, mixers)
    own_loss = computes_own_loss(type(module).__module__)
    if own_loss and labelled and cp_size > 1:
        raise RingNotSupported(
            f'attn_implementation="ring": {name} computes its loss itself ({", ".join(own_loss)}) instead of '
            "through transformers' loss registry, so each rank would report the loss of its own shard. "
            "Compute the loss outside the model from its logits (hf_ring.unshard), or train it with cp_size=1."
        )
    if not positions_given and numbers_positions_from_ids(type(module).__module__):
        raise RingNotSupported(
            f'attn_implementation="ring": {name} numbers positions from the padding index when it is given no '
            "position_ids, and shard_batch would pass 0, 1, 2, ... instead. Pass the position_ids the model "
            "uses (padding_idx + 1 + offset) in the batch to shard_batch."
        )
    if mask != "static":
        _check_mask(module, config, name, kwargs, n_global, mask)
    coef = router_loss_coefficient(config)
    if kwargs.get("output_router_logits") and coef and labelled and cp_size > 1:
        _check_router_loss(name, type(module).__module__, coef)
    rope = getattr(config, "rope_parameters", None) or {}
    if isinstance(rope, dict) and rope.get("rope_type") in ("dynamic", "longrope"):
        raise RingNotSupported(
            f"attn_implementation=\"ring\": rope_type={rope['rope_type']!r} rescales RoPE from the largest "
            "position each rank sees, which differs between ranks; use 'default', 'linear', 'llama3' or 'yarn'."
        )


_OWN_CODE = (
    "computes attention itself instead of calling transformers' attention registry (AttentionInterface), so it "
    "cannot run ring attention. Use a model that calls the registry (Llama, Qwen, Mistral, Gemma, ...)."
)
_NEITHER = (
    "computes attention and its loss itself, outside transformers' registries, so ring attention cannot run it. "
    "Use a model that calls the attention registry (Llama, Qwen, Mistral, Gemma, ...)."
)
# modeling module -> why a model of it cannot be built with attn_implementation="ring". Falcon and
# GPT-Neo pick their attention class from a table of their own (and would fail with KeyError:
# 'ring'); the others call neither the attention nor the loss registry.
REFUSED_AT_BUILD = {
    "transformers.models.falcon.modeling_falcon": _OWN_CODE,
    "transformers.models.gpt_neo.modeling_gpt_neo": _OWN_CODE,
    "transformers.models.xlm.modeling_xlm": _NEITHER,
    "transformers.models.xlnet.modeling_xlnet": _NEITHER,
    "transformers.models.cpmant.modeling_cpmant": _NEITHER,
    "transformers.models.prophetnet.modeling_prophetnet": _NEITHER,
}


def refuse_at_build(model: nn.Module) -> None:
    """Raise ``RingNotSupported`` for a model of ``REFUSED_AT_BUILD`` that asks for the ring."""
    why = REFUSED_AT_BUILD.get(type(model).__module__)
    if why is not None:
        name = type(model).__module__.rsplit(".", 1)[-1].removeprefix("modeling_")
        raise RingNotSupported(f'attn_implementation="ring": {name} {why}')


def check_model(model: nn.Module, cp_size: int, seq_len: int = 0, labelled: bool = True) -> None:
    """``check_layer`` on every attention module of ``model`` without running it: what the ring
    would refuse at the first forward, found when the model is handed over (``RingTrainer``) or, on
    the meta device, before its weights load (the recipe runner).

    ``seq_len``: the longest sequence the run will see (0: unknown, length-dependent checks are left
    to the forward; sliding windows and chunks, which the ring reads from the model's mask, are
    always left to the forward); ``labelled``: it trains on
    a loss. The keyword arguments a layer would pass are taken from the module (``sliding_window``)
    and its config (``output_router_logits``).
    """
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is None or not hasattr(module, "layer_idx") or "Attention" not in type(module).__name__:
            continue
        kwargs = {
            "sliding_window": getattr(module, "sliding_window", None),
            "output_router_logits": getattr(config, "output_router_logits", False),
        }
        check_layer(module, kwargs, seq_len, labelled, cp_size, mask="static")
