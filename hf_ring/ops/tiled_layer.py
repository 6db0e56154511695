"""A decoder layer's attention block over tiles of the sequence, its heads in groups: no full-length
temporary that a tile would do.

At a million tokens per rank every ``[tokens, hidden]`` tensor is gigabytes, and a plain layer holds
many at once in its recompute and backward: the norm's float32 copy of its input, q, k, v and the
attention output, their gradients, each LoRA adapter's float32 copy of its input. ``attention_block``
computes ``o_proj(attention(rope(q_proj(norm(x))), rope(k_proj(...)), v_proj(...)))`` -- everything of
the attention half of a pre-norm layer but the residual -- as one autograd Function:

- forward: for each head group (``G`` groups, GQA groups kept whole: ``ring.head_groups_of``), the
  group's q, k, v are made tile by tile (``tile`` tokens: the norm, the projections' rows of those heads,
  LoRA adapters, the per-head q/k norms, RoPE), the group's attention runs (``AttentionCall.forward``:
  the ring, a window's border or ring route, Ulysses) and its output fills the group's heads of ``out``
  ``[B, S, Hq, D]``; then ``o_proj`` runs over tiles of ``out``. Saved for backward: the input, ``out``
  (``o_proj``'s input, which the plain layer keeps too) and each group's float32 log-sum-exp.
- backward: per group, the gradient of the group's heads of ``out`` (``o_proj``'s backward restricted to
  those input columns, over tiles), the group's q, k, v again (tiles), the attention's backward
  (``AttentionCall.backward``), then the projections', norms' and RoPE's backward tile by tile (autograd
  over one tile at a time), their input gradient added to ``dx`` and every parameter's gradient summed
  in float32 and handed to autograd once.

So q, k, v, their gradients, the attention's float32 accumulators and the ring's messages exist for one
head group at a time, and norms and adapters for one tile at a time. The ring sends each group's K/V as
its own messages: the bytes per layer do not change. Exact: the same operations on the same values;
the projections run per group of output rows and ``o_proj``'s backward per group of input columns
(sums in another order). The price: the projections' forward once more in backward, ``o_proj``'s
forward in pieces.

``Linear`` is a linear layer as tensors (weight, bias, LoRA adapters with PEFT's arithmetic: the input
cast to the adapters' dtype, their output added to the base output, the sum cast back). The norm, the
per-head norms and RoPE are callables (the model's own modules and function), applied to one tile at a
time: token-wise. Under autocast the tiles run in the forward's autocast state and q, k, v are cast to
its dtype before attention, as the attention function does. This module imports only torch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor
from torch.nn.functional import linear as _mm

from .attention_call import AttentionCall
from .ring import head_groups_of
from .ulysses import kv_replication

__all__ = ["AttentionSpec", "Linear", "attention_block", "linear"]

Index = tuple[slice, ...]


@dataclass(frozen=True, eq=False)
class Linear:
    """``y = x W^T + b`` plus LoRA adapters: for each ``(A [r, in], B [out, r], scale)``,
    ``y = (y + scale * (x' A^T) B^T).to(y.dtype)`` with ``x'`` the input cast to ``A``'s dtype (PEFT's
    ``Linear.forward``; ``cast=False``: no cast)."""

    weight: Tensor
    bias: Tensor | None = None
    lora: tuple[tuple[Tensor, Tensor, float], ...] = ()
    cast: bool = True

    def tensors(self) -> list[Tensor]:
        bias = [self.bias] if self.bias is not None else []
        return [self.weight, *bias, *(t for a, b, _ in self.lora for t in (a, b))]


def linear(x: Tensor, lin: Linear, rows: slice | None = None, *, grads: _Leaves | None = None) -> Tensor:
    """``lin``'s output features ``rows`` (all: ``None``) for ``x [..., in]``. ``grads``: take the weights
    through it (leaves whose gradients it collects)."""
    take = grads.take if grads is not None else (lambda t, index: t[index])
    r = (slice(None),) if rows is None else (rows,)
    y = _mm(x, take(lin.weight, r), None if lin.bias is None else take(lin.bias, r))
    if lin.lora:
        dtype = y.dtype
        for a, b, scale in lin.lora:
            x = x.to(a.dtype) if lin.cast else x
            y = y + _mm(_mm(x, take(a, (slice(None),))), take(b, r)) * scale
        y = y.to(dtype)
    return y


def linear_columns(x: Tensor, lin: Linear, cols: slice, with_bias: bool, grads: _Leaves) -> Tensor:
    """What input features ``cols`` (``x [..., cols]``) add to ``lin``'s output, plus the bias when
    ``with_bias``: the output is the sum of this over a partition of the input features (its value in
    another summation order). For ``o_proj``'s backward one head group at a time."""
    c = (slice(None), cols)
    y = _mm(x, grads.take(lin.weight, c))
    if with_bias and lin.bias is not None:
        y = y + grads.take(lin.bias, (slice(None),))
    if lin.lora:
        dtype = y.dtype
        for a, b, scale in lin.lora:
            x = x.to(a.dtype) if lin.cast else x
            z = _mm(x, grads.take(a, c))
            y = y + _mm(z, grads.take(b, (slice(None),))) * scale
        y = y.to(dtype)
    return y


class _Leaves:
    """The parameters of one tile's autograd call: ``take(param, index)`` is ``param[index]`` as a fresh
    leaf (requiring grad when ``param`` does), recorded so that ``add`` can sum its gradient into the
    float32 accumulator of ``param`` at ``index``."""

    def __init__(self, acc: dict[int, Tensor]) -> None:
        self.acc = acc
        self.leaves: list[tuple[Tensor, Tensor, Index]] = []  # (leaf, param, index)

    def take(self, param: Tensor, index: Index) -> Tensor:
        if id(param) not in self.acc:
            return param[index]
        leaf = param.detach()[index].requires_grad_()
        self.leaves.append((leaf, param, index))
        return leaf

    def module(self, params: Sequence[Tensor]) -> list[Tensor]:
        """A module's own parameters used as they are (norms): their gradients are summed too."""
        used = [p for p in params if id(p) in self.acc]
        self.leaves.extend((p, p, (slice(None),)) for p in used)
        return used

    def inputs(self) -> list[Tensor]:
        return [leaf for leaf, _, _ in self.leaves]

    def add(self, grads: Sequence[Tensor | None]) -> None:
        for (_, param, index), g in zip(self.leaves, grads):
            if g is not None:
                self.acc[id(param)][index] += g


@dataclass(frozen=True, eq=False)
class AttentionSpec:
    """The attention half of a pre-norm decoder layer, as ``attention_block`` computes it: ``norm`` (the
    layer's input norm, token-wise; ``None``: none) with ``norm_params``; the projections ``q, k, v, o``;
    ``heads``/``kv_heads`` of ``head_dim``; per-head norms of q and k (token-wise callables on
    ``[B, t, H, D]``, Qwen3's) with ``qk_norm_params``; ``rope(q, k, cos, sin)`` on ``[B, H, t, D]`` with
    ``cos, sin [B, t, D]`` (the model's function; ``None``: no rotary embedding)."""

    q: Linear
    k: Linear
    v: Linear
    o: Linear
    heads: int
    kv_heads: int
    head_dim: int
    norm: Callable[[Tensor], Tensor] | None = None
    norm_params: tuple[Tensor, ...] = ()
    q_norm: Callable[[Tensor], Tensor] | None = None
    k_norm: Callable[[Tensor], Tensor] | None = None
    qk_norm_params: tuple[Tensor, ...] = ()
    rope: Callable[[Tensor, Tensor, Tensor, Tensor], tuple[Tensor, Tensor]] | None = None

    def trainable(self) -> list[Tensor]:
        """Every tensor of the block that requires grad, once each, in a fixed order."""
        seen: dict[int, Tensor] = {}
        for t in (*self.norm_params, *(t for lin in (self.q, self.k, self.v, self.o) for t in lin.tensors()),
                  *self.qk_norm_params):  # fmt: skip
            if t.requires_grad and id(t) not in seen:
                seen[id(t)] = t
        return list(seen.values())


def _sum_dtype(p: Tensor) -> torch.dtype:
    """Float32 sums of a parameter's gradient (float64 for a float64 parameter: oracle runs)."""
    return torch.promote_types(p.dtype, torch.float32)


def _tiles(n: int, tile: int) -> list[slice]:
    return [slice(s, min(s + tile, n)) for s in range(0, n, tile)]


class _AttentionBlock(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, sin, spec, call, tile, groups, *params):  # type: ignore[override]
        # x: (B, S, H) the layer's input; cos, sin: (B, S, D) or None
        device = x.device.type
        ctx.autocast = (device, torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
        ctx.spec, ctx.call, ctx.tile, ctx.groups = spec, call, tile, groups
        b, s, _ = x.shape
        out: Tensor | None = None
        states: list[Tensor] = []
        ctx.counts = []
        for qs, ks in head_groups_of(spec.heads, spec.kv_heads, groups):
            q, k, v = _project(ctx, x, cos, sin, qs, ks, None)
            with torch.autocast(device, enabled=False):
                o, state = call.forward(q, k, v)
            del q, k, v
            if out is None:
                out = o.new_empty(b, s, spec.heads, spec.head_dim)
            out[:, :, qs] = o
            del o
            ctx.counts.append(len(state))
            states.extend(state)
        assert out is not None
        flat = out.view(b, s, -1)
        y: Tensor | None = None
        for t in _tiles(s, tile):
            with _autocast(ctx):
                y_t = linear(flat[:, t], spec.o)
            if y is None:
                y = y_t.new_empty(b, s, y_t.shape[-1])
            y[:, t] = y_t
            del y_t
        ctx.save_for_backward(x, cos, sin, out, *states)
        return y

    @staticmethod
    def backward(ctx, dy):  # type: ignore[override]
        x, cos, sin, out, *rest = ctx.saved_tensors
        spec: AttentionSpec = ctx.spec
        call: AttentionCall = ctx.call
        params = [p for p, need in zip(spec.trainable(), ctx.needs_input_grad[7:]) if need]
        acc = {id(p): torch.zeros(p.shape, dtype=_sum_dtype(p), device=p.device) for p in params}
        b, s, _ = x.shape
        d = spec.head_dim
        dx = torch.zeros_like(x) if ctx.needs_input_grad[0] else None
        tiles = _tiles(s, ctx.tile)
        flat = out.view(b, s, -1)
        device = x.device.type
        for g, (qs, ks) in enumerate(head_groups_of(spec.heads, spec.kv_heads, ctx.groups)):
            n = ctx.counts[g]
            state, rest = tuple(rest[:n]), rest[n:]
            cols = slice(qs.start * d, qs.stop * d)
            # o_proj's backward for this group's input columns, a tile at a time
            dout = out.new_empty(b, s, qs.stop - qs.start, d)
            for t in tiles:
                leaves = _Leaves(acc)
                o_t = flat[:, t, cols].detach().requires_grad_()
                with torch.enable_grad(), _autocast(ctx):
                    y_t = linear_columns(o_t, spec.o, cols, g == 0, leaves)
                grads = torch.autograd.grad(y_t, [o_t, *leaves.inputs()], dy[:, t], allow_unused=True)
                dout[:, t] = grads[0].view(b, -1, qs.stop - qs.start, d)
                leaves.add(grads[1:])
                del y_t, o_t, grads
            q, k, v = _project(ctx, x, cos, sin, qs, ks, None)
            with torch.autocast(device, enabled=False):
                dq, dk, dv, _ = call.backward(dout, q, k, v, out[:, :, qs], state)
            del dout, q, k, v
            # the projections', norms' and RoPE's backward, a tile at a time
            for t in tiles:
                leaves = _Leaves(acc)
                x_t = x[:, t].detach().requires_grad_(dx is not None)
                with torch.enable_grad():
                    qkv = _project_tile(ctx, x_t, cos, sin, t, qs, ks, leaves)
                wrt = ([x_t] if dx is not None else []) + leaves.inputs()
                grads = torch.autograd.grad(qkv, wrt, (dq[:, t], dk[:, t], dv[:, t]), allow_unused=True)
                if dx is not None:
                    dx[:, t] += grads[0]
                    grads = grads[1:]
                leaves.add(grads)
                del qkv, x_t, grads
            del dq, dk, dv
        param_grads = [acc[id(p)].to(p.dtype) if id(p) in acc else None for p in spec.trainable()]
        return (dx, None, None, None, None, None, None, *param_grads)


class _autocast:
    """The forward's autocast state (recorded on ``ctx``), entered again."""

    def __init__(self, ctx) -> None:  # type: ignore[no-untyped-def]
        device, enabled, dtype = ctx.autocast
        self.cm = torch.autocast(device, dtype=dtype, enabled=enabled)

    def __enter__(self) -> None:
        self.cm.__enter__()

    def __exit__(self, *exc) -> None:  # type: ignore[no-untyped-def]
        self.cm.__exit__(*exc)


def _project_tile(
    ctx, x_t: Tensor, cos: Tensor | None, sin: Tensor | None, t: slice, qs: slice, ks: slice,  # type: ignore[no-untyped-def]
    leaves: _Leaves | None,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """q, k, v of heads ``qs`` / ``ks`` for the tokens ``t`` of one tile (``x_t [B, t, H]``), in the dtype
    attention runs in; through ``leaves`` when gradients are wanted."""
    spec: AttentionSpec = ctx.spec
    d = spec.head_dim
    b, n = x_t.shape[:2]
    with _autocast(ctx):
        if leaves is not None:
            leaves.module(spec.norm_params)
            leaves.module(spec.qk_norm_params)
        xn = spec.norm(x_t) if spec.norm is not None else x_t
        q = linear(xn, spec.q, slice(qs.start * d, qs.stop * d), grads=leaves).view(b, n, -1, d)
        k = linear(xn, spec.k, slice(ks.start * d, ks.stop * d), grads=leaves).view(b, n, -1, d)
        v = linear(xn, spec.v, slice(ks.start * d, ks.stop * d), grads=leaves).view(b, n, -1, d)
        del xn
        if spec.q_norm is not None:
            q = spec.q_norm(q)
        if spec.k_norm is not None:
            k = spec.k_norm(k)
        if spec.rope is not None:
            qt, kt = spec.rope(q.transpose(1, 2), k.transpose(1, 2), cos[:, t], sin[:, t])
            q, k = qt.transpose(1, 2), kt.transpose(1, 2)
    device, enabled, dtype = ctx.autocast
    if enabled:  # as the attention function under autocast: all three in the autocast dtype
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    return q, k, v


def _project(
    ctx, x: Tensor, cos: Tensor | None, sin: Tensor | None, qs: slice, ks: slice, leaves: _Leaves | None,  # type: ignore[no-untyped-def]
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """The whole shard's q, k, v of heads ``qs`` / ``ks`` ``[B, S, H, D]``, made a tile at a time (no grad)."""
    b, s, _ = x.shape
    full: list[Tensor] = []
    with torch.no_grad():
        for t in _tiles(s, ctx.tile):
            parts = _project_tile(ctx, x[:, t], cos, sin, t, qs, ks, leaves)
            if not full:
                full = [p.new_empty(b, s, *p.shape[2:]) for p in parts]
            for f, p in zip(full, parts):
                f[:, t] = p
            del parts
    q, k, v = full
    return q, k, v


def attention_block(
    x: Tensor,
    spec: AttentionSpec,
    call: AttentionCall,
    *,
    cos: Tensor | None = None,
    sin: Tensor | None = None,
    tile: int = 8192,
    head_groups: int = 1,
) -> Tensor:
    """The attention half of a pre-norm decoder layer without its residual, over tiles and head groups.

    ``x [B, S, H]``: the layer's input (this rank's shard); ``spec``: the layer's norm, projections,
    per-head norms and RoPE; ``call``: its attention (``AttentionCall``; ``head_groups`` of the call is not
    used, the block loops over ``head_groups`` itself); ``cos, sin [B, S, D]``: the rotary embedding of the
    shard's positions; ``tile``: tokens per tile. Returns ``o_proj``'s output ``[B, S, H]``, differentiable
    in ``x`` and every parameter of ``spec`` that requires grad. ``head_groups`` must divide the K/V heads;
    with Ulysses, each group's K/V heads must split over the Ulysses group as the whole layer's do (no more
    copies: ``kv_replication``).
    """
    if tile < 1:
        raise ValueError(f"attention_block: tile must be a positive number of tokens, not {tile}")
    head_groups_of(spec.heads, spec.kv_heads, head_groups, "attention_block")
    if call.ulysses and head_groups > 1:
        u = dist.get_world_size(call.ulysses_group) if dist.is_initialized() else 1
        if kv_replication(spec.kv_heads // head_groups, u) != kv_replication(spec.kv_heads, u):
            fits = [g for g in range(1, spec.kv_heads + 1) if spec.kv_heads % g == 0 and
                    kv_replication(spec.kv_heads // g, u) == kv_replication(spec.kv_heads, u)]  # fmt: skip
            raise ValueError(
                f"attention_block: head_groups={head_groups} leaves {spec.kv_heads // head_groups} K/V heads per "
                f"group, which a Ulysses group of {u} would have to repeat (more bytes on the all-to-all); pick one "
                f"of {fits}"
            )
    if (cos is None) != (spec.rope is None) or (cos is None) != (sin is None):
        raise ValueError("attention_block: pass cos and sin exactly when the spec has a rope function")
    params = spec.trainable()
    return _AttentionBlock.apply(x, cos, sin, spec, call, int(tile), int(head_groups), *params)
