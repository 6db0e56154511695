"""Activation offload that can be measured on a CPU-only machine.

On such a machine ``hf_ring.ops.offload.OffloadActivations`` moves nothing (the activations are in
host memory already), so a memory measurement could not see the offload. ``MeasuredOffload``
copies each saved tensor into "host" memory as ``LiveTensorBytes`` counts it
(``host_allocations``) and copies it back in backward, as a device would. Pass it as
``hf_ring.enable_activation_checkpointing(model, offload=MeasuredOffload)``.
"""

from __future__ import annotations

import torch

from hf_ring.ops.offload import OffloadActivations
from testkit.live_tensors import host_allocations


class MeasuredOffload(OffloadActivations):
    def pack(self, tensor: torch.Tensor) -> tuple[torch.device, torch.Tensor]:
        if tensor.device.type != "cpu":
            return super().pack(tensor)
        with host_allocations():
            return tensor.device, tensor.clone()

    def unpack(self, packed: tuple[torch.device, torch.Tensor]) -> torch.Tensor:
        device, tensor = packed
        if device.type != "cpu":
            return super().unpack(packed)
        return tensor.clone()  # the copy back to the "device"
