"""Activation checkpointing for ring models, with checkpointed activations offloaded to host memory.

``enable_activation_checkpointing(model, offload=True)`` turns on transformers' activation
checkpointing of every decoder layer (non-reentrant ``torch.utils.checkpoint``) and, with
``offload``, keeps everything the decoder saves for backward -- above all the checkpointed layer
inputs, ``layers x tokens x hidden`` -- in host memory instead of on the device.

The recompute re-runs each layer's forward, ring attention included, in backward. Every rank
walks the layers in the same (reverse) order and each layer's ring turns the same way it did in
the forward, so the ranks' point-to-point transfers pair up exactly as they did then.

Why not ``model.activation_checkpointing_enable(offload=True)``: transformers 5 asks
``save_on_cpu`` for pinned memory, which raises on machines without an accelerator. This module
pins only when CUDA is there, and works the same on PEFT- and DDP-wrapped models. On a CPU-only
machine offloading changes nothing (the activations are in host memory already), except under
``testkit.live_tensors.LiveTensorBytes``, where offloaded tensors are copied and counted as host memory
so that the offload can be measured there too.

This module imports only torch.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["enable_activation_checkpointing", "OffloadActivations"]


def _measuring() -> bool:
    try:
        from testkit.live_tensors import LiveTensorBytes
    except ImportError:  # installed without the repository's test helpers: nothing measures
        return False

    return bool(LiveTensorBytes.active)


def _pack(tensor: torch.Tensor) -> tuple[torch.device, torch.Tensor]:
    if tensor.device.type != "cpu":
        pin = torch.cuda.is_available()
        packed = torch.empty(tensor.size(), dtype=tensor.dtype, layout=tensor.layout, pin_memory=pin)
        packed.copy_(tensor, non_blocking=pin)
        return tensor.device, packed
    if _measuring():  # measuring on a CPU-only machine: move it to "host" memory
        from testkit.live_tensors import host_allocations

        with host_allocations():
            return tensor.device, tensor.clone()
    return tensor.device, tensor


def _unpack(packed: tuple[torch.device, torch.Tensor]) -> torch.Tensor:
    device, tensor = packed
    if device.type == "cpu":
        return tensor.clone() if _measuring() else tensor  # the copy back to the "device"
    return tensor.to(device, non_blocking=tensor.is_pinned())


class OffloadActivations:
    """Forward hooks on a module (the decoder): what its forward saves for backward goes to host
    memory and comes back when backward needs it. Only while training with gradients enabled."""

    def __init__(self, module: nn.Module) -> None:
        self._stack: list[Any] = []
        self.handles = [
            module.register_forward_pre_hook(self._enter),
            module.register_forward_hook(self._exit, always_call=True),
        ]

    def _enter(self, module: nn.Module, args: Any) -> None:
        if module.training and torch.is_grad_enabled():
            hooks = torch.autograd.graph.saved_tensors_hooks(_pack, _unpack)
            hooks.__enter__()
            self._stack.append(hooks)
        else:
            self._stack.append(None)

    def _exit(self, module: nn.Module, args: Any, output: Any) -> None:
        hooks = self._stack.pop() if self._stack else None
        if hooks is not None:
            hooks.__exit__(None, None, None)

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def _causal_lm(model: nn.Module) -> nn.Module:
    for m in model.modules():
        if type(m).__module__.startswith("transformers.") and hasattr(m, "activation_checkpointing_enable"):
            return m
    raise TypeError(f"enable_activation_checkpointing: no transformers model inside {type(model).__name__}")


def enable_activation_checkpointing(model: nn.Module, *, offload: bool = False, every_n_layers: int = 1) -> nn.Module:
    """Checkpoint every ``every_n_layers``-th decoder layer of a transformers model (plain, PEFT- or
    DDP-wrapped); with ``offload``, keep what the decoder saves for backward in host memory
    (pinned when CUDA is available). Idempotent; returns ``model``."""
    lm = _causal_lm(model)
    lm.activation_checkpointing_enable(
        activation_checkpointing_kwargs={"use_reentrant": False}, every_n_layers=every_n_layers
    )
    old = getattr(lm, "_hf_ring_offload", None)
    if old is not None:
        old.remove()
        del lm._hf_ring_offload
    if offload:
        decoder = lm.get_decoder() if hasattr(lm, "get_decoder") else getattr(lm, lm.base_model_prefix)
        lm._hf_ring_offload = OffloadActivations(decoder)
    return model
