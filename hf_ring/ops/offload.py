"""Activation offload: what a module's forward saves for backward goes to host memory.

``OffloadActivations(module)`` installs forward hooks on ``module`` (the decoder of a model whose
layers are checkpointed): while it runs in training with gradients enabled, every tensor autograd
saves -- above all the checkpointed layer inputs, ``layers x tokens x hidden`` -- is packed into
host memory (pinned when CUDA is available) and unpacked back to its device when backward needs
it. On a CPU-only machine the activations are in host memory already, and nothing is copied.

``pack``/``unpack`` are methods so that a measuring tool can count the host side of the offload
on a CPU-only machine (``testkit.offload.MeasuredOffload``). The recompute of a checkpointed
layer re-runs its forward, ring attention included; every rank walks the layers in the same order
and each layer's ring turns as it did in the forward, so the point-to-point transfers pair up.
``hf_ring.enable_activation_checkpointing(model, offload=True)`` installs it on a transformers
model. This module imports only torch.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["OffloadActivations"]


class OffloadActivations:
    """Forward hooks on ``module``: what its forward saves for backward lives in host memory until
    backward needs it. Only while ``module.training`` and gradients are enabled."""

    def __init__(self, module: nn.Module) -> None:
        self._stack: list[Any] = []
        self.handles = [
            module.register_forward_pre_hook(self._enter),
            module.register_forward_hook(self._exit, always_call=True),
        ]

    def pack(self, tensor: torch.Tensor) -> tuple[torch.device, torch.Tensor]:
        """A saved tensor -> ``(its device, a host copy)`` (itself when it is in host memory already)."""
        if tensor.device.type == "cpu":
            return tensor.device, tensor
        pin = torch.cuda.is_available()
        packed = torch.empty(tensor.size(), dtype=tensor.dtype, layout=tensor.layout, pin_memory=pin)
        packed.copy_(tensor, non_blocking=pin)
        return tensor.device, packed

    def unpack(self, packed: tuple[torch.device, torch.Tensor]) -> torch.Tensor:
        """The inverse of ``pack``: the tensor back on its device."""
        device, tensor = packed
        if device.type == "cpu":
            return tensor
        return tensor.to(device, non_blocking=tensor.is_pinned())

    def _enter(self, module: nn.Module, args: Any) -> None:
        if module.training and torch.is_grad_enabled():
            hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)
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
