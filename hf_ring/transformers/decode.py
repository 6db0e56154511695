"""Greedy decoding under context parallelism: the sharded KV cache, carried by the batch's context.

A prompt is prefilled with ``shard_batch`` as in training, with one more thing on its ``RingContext``:
``decode``, a ``DecodeStep`` over a ``ShardedCache``. Then:

- **prefill** (``DecodeStep.decoding`` false): the ring attention function keeps this rank's keys and
  values of every layer (``keep_kv``: its shard, ``1/P`` of the prompt); a short causal convolution
  keeps the last rows of its input (``keep_conv``: gathered from the ranks that hold them); a delta
  rule keeps the state after the prompt's last token (``ops.mixers.delta.delta_rule(final_state=True)``);
- **decoding** (``decoding`` true, a new ``RingContext`` per forward): the new tokens -- the same on
  every rank, with their global ``position_ids`` and ``use_cache=False`` -- run replicated. Attention
  (``attention``) appends their keys and values to the replicated tail and attends to every rank's
  shard through ``ops.decode.decode_attention`` (partials merged through their log-sum-exp); a
  convolution (``conv``) and a delta rule (``delta``) go on from the kept rows and state.

Layers are told apart by the order of their calls within a forward (each kind counted on the
``DecodeStep``), which is the same in every forward of a model; ``DecodeStep.check_calls`` refuses a
forward whose calls do not match the prefill's. Nothing is parked on the model: the cache lives with
the caller (``hf_ring.evaluation.generate``) and reaches the layers through the context.

What this supports is checked before anything runs (``check_model``): attention of transformers'
registry (windows, chunks, soft-capping and sinks included) and the Gated DeltaNet / KDA / short
convolution mixers; other token mixers (Mamba, Mamba2, lightning attention, RG-LRU) and Llama 4's
position temperature are refused.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from ..errors import RingNotSupported
from ..ops.decode import decode_attention, gather_rows
from .context import RingContext
from .support import check_layer, sequence_mixers
from .temperature import nope_temperature

__all__ = ["DecodeStep", "ShardedCache", "check_model"]

_DECODED_ROUTES = {"conv", "delta"}  # token-mixer routes that go on decoding from a kept state


@dataclass(eq=False)
class ShardedCache:
    """What a context-parallel prefill leaves for decoding, on one rank.

    Attributes:
        prompt: the tokens prefilled under context parallelism (the rest run replicated).
        positions: ``[S_r]`` global positions of this rank's prompt rows (its shard).
        keys, values: per attention layer (call order), this rank's ``[B, Hkv, S_r, D]``.
        tail_keys, tail_values: per attention layer, ``[B, Hkv, T, D]`` of the replicated tokens.
        tail_positions: ``[T]`` their global positions.
        conv: per short convolution, ``[B, C, K - 1]``: its input's last rows before the next token.
        states: per delta rule, ``[B, Hv, Dk, Dv]``: the state after the last token (``None``: zero).
    """

    prompt: int = 0
    positions: Tensor | None = None
    keys: list[Tensor] = field(default_factory=list)
    values: list[Tensor] = field(default_factory=list)
    tail_keys: list[Tensor | None] = field(default_factory=list)
    tail_values: list[Tensor | None] = field(default_factory=list)
    tail_positions: Tensor | None = None
    conv: list[Tensor] = field(default_factory=list)
    states: list[Tensor | None] = field(default_factory=list)
    layers: dict[str, int] | None = None  # calls of each kind per forward (the first forward's)

    def nbytes(self) -> int:
        """Bytes this rank holds (shard, tail, convolution rows, states)."""
        parts = [*self.keys, *self.values, *self.tail_keys, *self.tail_values, *self.conv, *self.states]
        return sum(t.numel() * t.element_size() for t in parts if t is not None)


@dataclass(eq=False)
class DecodeStep:
    """One forward's part in decoding (``RingContext.decode``): fill ``cache`` (the prefill) or read it
    (``decoding``: new tokens at global ``positions [M]``). ``calls`` counts the layers of each kind
    this forward reached."""

    cache: ShardedCache
    decoding: bool = False
    positions: Tensor | None = None
    calls: dict[str, int] = field(default_factory=dict)

    def next(self, kind: str) -> int:
        i = self.calls.get(kind, 0)
        self.calls[kind] = i + 1
        known = self.cache.layers
        if known is not None and i >= known.get(kind, 0):
            raise RingNotSupported(
                f"decoding under context parallelism: this forward made more {kind} calls than the first "
                f"({known.get(kind, 0)}); the model must call every layer once per forward."
            )
        return i

    def check_calls(self) -> None:
        """After a forward: the first one (the prefill) records its calls; every later one must make the same."""
        if self.cache.layers is None:
            self.cache.layers = dict(self.calls)
        elif self.calls != self.cache.layers:
            raise RingNotSupported(
                f"decoding under context parallelism: a forward made {self.calls} calls, the prefill "
                f"{self.cache.layers}; the model must call every layer once per forward, in the same order."
            )


def check_model(model: nn.Module) -> None:
    """Refuse, before anything runs, a model whose decoding under context parallelism is not computed
    exactly: token mixers other than Gated DeltaNet, KDA and short convolutions; position temperatures."""
    from .mixers import MIXER_FAMILIES

    modules = {type(m).__module__ for m in model.modules()}
    for module in sorted(modules):
        mixers = sequence_mixers(module)
        if not mixers:
            continue
        family = MIXER_FAMILIES.get(module.removeprefix("transformers.models."))
        ok = family is not None and not family.adapters and set(family.functions.values()) <= _DECODED_ROUTES
        if not ok:
            raise RingNotSupported(
                f"decoding under context parallelism: {module.rsplit('.', 1)[-1]} mixes tokens with "
                f"{', '.join(mixers)}, which hf_ring decodes only for Gated DeltaNet, KDA and short convolutions "
                "(attention of transformers' registry for the rest). Evaluate this model in one process per "
                "replica (--cp-size 1), which runs model.generate."
            )
    for m in model.modules():
        if nope_temperature(m) is not None:
            raise RingNotSupported(
                f"decoding under context parallelism: {type(m).__name__} scales its queries by a temperature of "
                "their positions (Llama 4's NoPE layers), which the decoding attention does not apply. Evaluate "
                "this model with --cp-size 1."
            )


# --- attention ----------------------------------------------------------------------------------


def keep_kv(ctx: RingContext, key: Tensor, value: Tensor) -> None:
    """Prefill: keep this rank's ``key``/``value [B, Hkv, S_local, D]`` of one attention layer."""
    step = ctx.decode
    step.next("attention")
    cache = step.cache
    if cache.positions is None:
        index = ctx.cached("decode-index", lambda: ctx.layout.index(key.shape[0]))
        cache.positions = index[ctx.rank, 0].to(key.device)
    cache.keys.append(key.detach().contiguous())
    cache.values.append(value.detach().contiguous())
    cache.tail_keys.append(None)
    cache.tail_values.append(None)


def attention(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Any,
    ctx: RingContext,
    *,
    scaling: float | None = None,
    dropout: float = 0.0,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """Decoding: the attention of the new tokens (``query [B, Hq, M, D]``, ``key``/``value [B, Hkv, M, D]``,
    the same on every rank) to the whole sequence. Returns ``([B, M, Hq, Dv], None)``."""
    step = ctx.decode
    i = step.next("attention")
    cache = step.cache
    pos = step.positions
    n_global = int(pos[-1]) + 1
    if dropout:
        raise RingNotSupported("decoding under context parallelism: attention dropout is not supported (eval mode)")
    if (module.is_causal if is_causal is None else is_causal) is False:
        raise RingNotSupported("decoding under context parallelism: a bidirectional attention layer cannot decode")
    window = getattr(attention_mask, "window", None)
    chunk = getattr(attention_mask, "chunk", None)
    check_layer(module, kwargs, n_global, False, ctx.size, True, mask=attention_mask)
    ctx.cross_rank_calls.attention_ran()
    key, value = key.detach(), value.detach()
    if i >= len(cache.tail_keys):  # no prefill under context parallelism: the tail starts here
        cache.tail_keys.append(None)
        cache.tail_values.append(None)
    if cache.tail_keys[i] is None:
        cache.tail_keys[i], cache.tail_values[i] = key, value
    else:
        cache.tail_keys[i] = torch.cat((cache.tail_keys[i], key), dim=2)
        cache.tail_values[i] = torch.cat((cache.tail_values[i], value), dim=2)
    empty = torch.empty(0, dtype=torch.long, device=query.device)
    shard_pos = cache.positions if cache.positions is not None else empty
    if i < len(cache.keys):
        shard = (cache.keys[i], cache.values[i], shard_pos)
    else:
        shard = (key[:, :, :0], value[:, :, :0], empty)
    sinks = kwargs.get("s_aux", kwargs.get("sinks"))
    if sinks is not None and (not isinstance(sinks, Tensor) or sinks.dim() != 1):
        raise RingNotSupported("decoding under context parallelism: attention sinks other than one per head")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = decode_attention(
        query, shard, (cache.tail_keys[i], cache.tail_values[i], cache.tail_positions), pos, group=ctx.group,
        scale=scale, window=window, chunk=chunk, softcap=kwargs.get("softcap") or 0.0, sinks=sinks,
    )  # fmt: skip
    return out, None


# --- token mixers -------------------------------------------------------------------------------


def keep_conv(ctx: RingContext, x: Tensor, width: int) -> None:
    """Prefill: keep the last ``width`` rows of a convolution's input ``x [B, C, S_local]`` (gathered
    from the ranks that hold them)."""
    step = ctx.decode
    step.next("conv")
    prompt = step.cache.prompt
    index = ctx.cached("decode-index", lambda: ctx.layout.index(x.shape[0]))
    rows = gather_rows(x.detach(), index[ctx.rank, 0].to(x.device), prompt - width, width, ctx.group, dim=2)
    step.cache.conv.append(rows)


def conv(fn: Any, ctx: RingContext, x: Tensor, weight: Tensor, bias: Tensor | None, activation: str | None) -> Tensor:
    """Decoding: a short causal convolution of the new tokens' ``x [B, C, M]``, going on from the kept rows."""
    step = ctx.decode
    i = step.next("conv")
    cache = step.cache
    width, m = weight.shape[-1] - 1, x.shape[-1]
    if i >= len(cache.conv):  # no prefill under context parallelism: the convolution starts here
        cache.conv.append(x.new_zeros((*x.shape[:2], width)))
    full = torch.cat((cache.conv[i].to(x.dtype), x), dim=-1)
    cache.conv[i] = full[..., full.shape[-1] - width :].detach()
    return fn(full, weight, bias, activation=activation)[..., -m:]


def keep_state(ctx: RingContext, state: Tensor | None) -> None:
    """Prefill: keep a delta rule's state after the prompt's last token (``None``: a zero state)."""
    ctx.decode.next("delta")
    ctx.decode.cache.states.append(None if state is None else state.detach())


def delta(fn: Any, ctx: RingContext, query: Tensor, key: Tensor, value: Tensor, g: Tensor, beta: Tensor,
          **options: Any) -> tuple[Tensor, None]:  # fmt: skip
    """Decoding: a delta rule over the new tokens, from the kept state; the state is kept for the next."""
    step = ctx.decode
    i = step.next("delta")
    cache = step.cache
    if i >= len(cache.states):
        cache.states.append(None)
    out, state = fn(query, key, value, g=g, beta=beta, initial_state=cache.states[i], output_final_state=True,
                    **options)  # fmt: skip
    if state is None:
        from .mixers import _name

        raise RingNotSupported(f"decoding under context parallelism: {_name(fn)} returned no final state")
    cache.states[i] = state.detach()
    return out, None
