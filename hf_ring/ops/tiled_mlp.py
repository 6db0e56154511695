"""The gated MLP of every decoder layer over tiles of the sequence, saving only its input.

A gated MLP (``down(act(gate(x)) * up(x))``) keeps four ``[tokens, intermediate]`` tensors for
backward and makes two more in it; with the layer inputs checkpointed (and offloaded), that is most
of a rank's activation memory at long context (Llama-3.1-8B: intermediate 14336 = 3.5 x hidden;
``hf-ring plan`` shows the terms). ``enable_tiled_mlp(model, tile_tokens)`` runs each MLP over
tiles of ``tile_tokens`` tokens under ``no_grad`` in forward and saves only its input; backward
re-runs one tile at a time with gradients, so the MLP's working set is that of one tile. The MLP
acts on each token independently, so the result is exact; the price is one more MLP forward.
Under autocast, backward re-runs the tiles in the forward's autocast state (device, enabled, dtype):
the same activations as the forward's, and its GEMMs in the autocast dtype.

Parameter gradients are summed over the tiles (float32) and handed to autograd once, as the
gradients of the Function's inputs, so DDP's per-parameter hooks fire once per step as usual.
LoRA adapters inside the MLP (PEFT) are parameters of the MLP like any other.

``tiled_forward(module, forward, x, tile)`` is the op; ``hf_ring.enable_tiled_mlp(model)``
(``hf_ring.transformers.patches``) installs it on a model's MLPs. This module imports only torch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn

__all__ = ["tiled_forward"]


class _TiledMLP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, forward, tile, *params):  # type: ignore[override]
        device = x.device.type  # backward re-enters this autocast state for its recompute
        ctx.autocast = (device, torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
        flat = x.reshape(-1, x.shape[-1])
        out = None
        with torch.no_grad():
            for s in range(0, flat.shape[0], tile):
                y = forward(flat[s : s + tile])
                if out is None:
                    out = y.new_empty((flat.shape[0], y.shape[-1]))
                out[s : s + tile] = y
                del y
        ctx.save_for_backward(x)
        ctx.forward, ctx.tile, ctx.params = forward, tile, params
        return out.reshape(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        (x,) = ctx.saved_tensors
        params = ctx.params
        device, enabled, dtype = ctx.autocast
        want = [i for i, p in enumerate(params) if ctx.needs_input_grad[3 + i]]
        flat, g = x.reshape(-1, x.shape[-1]), grad.reshape(-1, grad.shape[-1])
        dx = torch.empty_like(flat) if ctx.needs_input_grad[0] else None
        acc = [torch.zeros(params[i].shape, dtype=torch.promote_types(params[i].dtype, torch.float32),
                           device=params[i].device) for i in want]  # fmt: skip
        for s in range(0, flat.shape[0], ctx.tile):
            xt = flat[s : s + ctx.tile].detach().requires_grad_(dx is not None)
            with torch.enable_grad(), torch.autocast(device, dtype=dtype, enabled=enabled):
                yt = ctx.forward(xt)
            inputs = ([xt] if dx is not None else []) + [params[i] for i in want]
            grads = torch.autograd.grad(yt, inputs, g[s : s + ctx.tile], allow_unused=True)
            if dx is not None:
                dx[s : s + ctx.tile] = grads[0]
                grads = grads[1:]
            for a, gp in zip(acc, grads):
                if gp is not None:
                    a += gp
        out: list[Tensor | None] = [None] * len(params)
        for i, a in zip(want, acc):
            out[i] = a.to(params[i].dtype)
        return (dx.reshape(x.shape) if dx is not None else None, None, None, *out)


def tiled_forward(
    module: nn.Module | None, forward: Callable[[Tensor], Tensor], x: Tensor, tile: int,
    params: Sequence[Tensor] | None = None,
) -> Tensor:  # fmt: skip
    """``forward(x)`` (a token-wise module's forward, ``x: [..., H]``) over tiles of ``tile`` tokens,
    saving only ``x`` for backward; gradients reach ``x`` and ``module``'s trainable parameters (or
    those of ``params``, when ``forward`` uses several modules: a norm and the MLP after it). Without
    gradients, the same tiles (no full-length temporary either)."""
    if x.shape[:-1].numel() <= tile:
        return forward(x)
    if not torch.is_grad_enabled():  # evaluation, a recompute without gradients: the tiles, nothing saved
        flat, out = x.reshape(-1, x.shape[-1]), None
        for s in range(0, flat.shape[0], tile):
            y = forward(flat[s : s + tile])
            if out is None:
                out = y.new_empty((flat.shape[0], y.shape[-1]))
            out[s : s + tile] = y
        assert out is not None
        return out.reshape(*x.shape[:-1], out.shape[-1])
    if params is None:
        assert module is not None
        params = list(module.parameters())
    params = [p for p in params if p.requires_grad]
    return _TiledMLP.apply(x, forward, tile, *params)
