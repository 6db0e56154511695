"""Activation offload: what a module's forward saves for backward goes to host memory.

``OffloadActivations(module)`` installs forward hooks on ``module`` (the decoder of a model whose
layers are checkpointed): while it runs in training with gradients enabled, every tensor autograd
saves -- above all the checkpointed layer inputs, ``layers x tokens x hidden`` -- is packed into
host memory (pinned when CUDA is available) and unpacked back to its device when backward needs
it. On a CPU-only machine the activations are in host memory already, and nothing is copied.

On CUDA the copies run on a side stream, so that they overlap the compute stream's kernels instead
of waiting in line with them (about 1 GiB per layer input at 128K tokens x 4096 bf16):

* device -> host: the side stream waits for an event recorded on the compute stream where the
  tensor is ready, copies it into pinned memory and records an event; the device tensor is kept
  until that event completes (so its memory is not reused while the copy still reads it). At most
  ``max_in_flight_bytes`` wait to leave (beyond, pack waits for the oldest): the copies may not
  fall behind the compute by more than that much device memory.
* host -> device: the side stream waits for the compute stream where the destination is
  allocated, copies, records an event; the compute stream waits for that event before it reads the
  tensor. Unpacking a tensor also starts the copy of the one packed before it (backward needs them
  in about the reverse order of forward), so that it is on its way while this one is used.

Recomputed instead of stored (``recompute_from(output, source, fn)``): a tensor that ``fn`` makes again
from another saved tensor -- the next layer's input from this layer's input, by running this layer once
more -- is kept as that recipe, not copied to the host; in backward its unpacking fetches the source (and
keeps it for its own unpacking, as a prefetch does) and runs ``fn`` on it without gradients. Every other
layer's input recomputed halves the host memory for one more forward of half the layers
(``hf_ring.enable_tiled_layers(..., offload_every=2)``).

``StreamOps`` (CUDA) is what the offload asks of the device; a stand-in with the same methods
(``testkit.offload.FakeStreams``) checks the ordering on CPU. ``pack``/``unpack`` are methods so that
a measuring tool can count the host side of the offload on a CPU-only machine
(``testkit.offload.MeasuredOffload``). The recompute of a checkpointed layer re-runs its forward,
ring attention included; every rank walks the layers in the same order and each layer's ring turns
as it did in the forward, so the point-to-point transfers pair up.
``hf_ring.enable_activation_checkpointing(model, offload=True)`` installs it on a transformers
model. This module imports only torch.
"""

from __future__ import annotations

import collections
import contextlib
import weakref
from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["OffloadActivations", "StreamOps"]


class StreamOps:
    """The device operations of the offload, on CUDA: streams, events, buffers, asynchronous copies."""

    def streamed(self, tensor: Tensor) -> bool:
        """Whether ``tensor`` is offloaded through streams (CUDA tensors)."""
        return tensor.is_cuda

    def current_stream(self, device: torch.device) -> Any:
        return torch.cuda.current_stream(device)

    def new_stream(self, device: torch.device) -> Any:
        return torch.cuda.Stream(device)

    def stream(self, stream: Any) -> contextlib.AbstractContextManager:
        """Context in which work is issued on ``stream``."""
        return torch.cuda.stream(stream)

    def event(self) -> Any:
        return torch.cuda.Event()

    def host_buffer(self, tensor: Tensor) -> Tensor:
        return torch.empty(tensor.size(), dtype=tensor.dtype, layout=tensor.layout, pin_memory=True)

    def device_buffer(self, host: Tensor, device: torch.device) -> Tensor:
        return torch.empty(host.size(), dtype=host.dtype, layout=host.layout, device=device)

    def copy(self, dst: Tensor, src: Tensor) -> None:
        """``dst.copy_(src)``, issued on the current stream without waiting for it."""
        dst.copy_(src, non_blocking=True)

    def record_stream(self, tensor: Tensor, stream: Any) -> None:
        """``tensor``'s memory is not reused before the work issued on ``stream`` so far is done."""
        tensor.record_stream(stream)


class _Transfer:
    """One saved tensor in host memory: ``host``, with the event ``left`` of its device -> host copy; in
    backward the device copy on its way (``fetched``, event ``landed``) and whether backward has had it
    (``unpacked``); ``prev``: the transfer packed before it on the same device (a weak reference: what
    backward likely needs next)."""

    __slots__ = ("host", "left", "fetched", "landed", "unpacked", "prev", "__weakref__")

    def __init__(self, host: Tensor, left: Any, prev: weakref.ref | None) -> None:
        self.host, self.left, self.prev = host, left, prev
        self.fetched: Tensor | None = None
        self.landed: Any = None
        self.unpacked = False


def _key(t: Tensor) -> tuple:
    """What identifies a tensor's values while it is alive: its memory, view and type."""
    return (t.device, t.dtype, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride())


class _Recipe:
    """A saved tensor kept as ``fn(source)``: ``source`` the payload of another packed tensor."""

    __slots__ = ("source", "fn")

    def __init__(self, source: Any, fn: Any) -> None:
        self.source, self.fn = source, fn


class OffloadActivations:
    """Forward hooks on ``module``: what its forward saves for backward lives in host memory until
    backward needs it. Only while ``module.training`` and gradients are enabled.

    ``side_stream=False`` issues the CUDA copies on the compute stream (for comparison: each copy then
    waits in line with the kernels). ``streams``: the device operations (default ``StreamOps()``)."""

    def __init__(
        self,
        module: nn.Module,
        *,
        side_stream: bool = True,
        max_in_flight_bytes: int = 2 * 2**30,
        streams: StreamOps | None = None,
    ) -> None:
        self.ops = streams if streams is not None else StreamOps()
        self.side_stream, self.max_in_flight_bytes = side_stream, max_in_flight_bytes
        self._sides: dict[torch.device, Any] = {}
        self._leaving: collections.deque[tuple[Any, Tensor]] = collections.deque()  # (event, device tensor)
        self._leaving_bytes = 0
        self._last: dict[torch.device, weakref.ref] = {}
        self._stack: list[Any] = []
        self._recipes: dict[tuple, tuple[Tensor, Any]] = {}  # output key -> (source, fn), this forward
        self._packed: dict[tuple, Any] = {}  # key of a tensor packed in this forward -> its payload
        self.handles = [
            module.register_forward_pre_hook(self._enter),
            module.register_forward_hook(self._exit, always_call=True),
        ]

    def recompute_from(self, output: Tensor, source: Tensor, fn: Any) -> None:
        """When ``output`` is saved for backward in this forward, keep ``fn`` instead of a copy: in backward
        ``fn(source)`` (no gradients) makes it again. ``source`` must be saved (packed) before ``output`` is;
        otherwise ``output`` is copied as usual. Only while the offload's hooks are on (its module's forward)."""
        if self._stack and self._stack[-1] is not None:
            self._recipes[_key(output)] = (source, fn)

    def _pack_entry(self, tensor: Tensor) -> Any:
        key = _key(tensor)
        recipe = self._recipes.get(key)
        if recipe is not None:
            source = self._packed.get(_key(recipe[0]))
            if source is not None:
                return _Recipe(source, recipe[1])
        packed = self.pack(tensor)
        self._packed[key] = packed
        return packed

    def _unpack_entry(self, packed: Any) -> Tensor:
        if isinstance(packed, _Recipe):
            source = self.peek(packed.source)
            with torch.no_grad():
                return packed.fn(source)
        return self.unpack(packed)

    def peek(self, packed: tuple[torch.device, Any]) -> Tensor:
        """``packed``'s tensor back on its device, kept for its own unpacking (which then copies nothing)."""
        device, payload = packed
        if isinstance(payload, _Transfer):
            if payload.fetched is None:
                self._fetch(payload, device)
            self.ops.current_stream(device).wait_event(payload.landed)
            return payload.fetched  # type: ignore[return-value]
        return self.unpack(packed)

    def pack(self, tensor: Tensor) -> tuple[torch.device, Any]:
        """A saved tensor -> ``(its device, its host copy)`` (itself when it is in host memory already;
        a ``_Transfer`` for a copy on a side stream)."""
        if self.ops.streamed(tensor):
            return tensor.device, self._pack_streamed(tensor)
        if tensor.device.type == "cpu":
            return tensor.device, tensor
        pin = torch.cuda.is_available()
        packed = torch.empty(tensor.size(), dtype=tensor.dtype, layout=tensor.layout, pin_memory=pin)
        packed.copy_(tensor, non_blocking=pin)
        return tensor.device, packed

    def unpack(self, packed: tuple[torch.device, Any]) -> Tensor:
        """The inverse of ``pack``: the tensor back on its device."""
        device, payload = packed
        if isinstance(payload, _Transfer):
            return self._unpack_streamed(device, payload)
        if device.type == "cpu":
            return payload
        return payload.to(device, non_blocking=payload.is_pinned())

    # --- the copies on a side stream --------------------------------------------------------------

    def _side(self, device: torch.device) -> Any:
        if not self.side_stream:
            return self.ops.current_stream(device)
        if device not in self._sides:
            self._sides[device] = self.ops.new_stream(device)
        return self._sides[device]

    def _release_left(self) -> None:
        """Drop the device tensors whose copy to the host has completed."""
        while self._leaving and self._leaving[0][0].query():
            self._forget_oldest()

    def _forget_oldest(self) -> None:
        _, tensor = self._leaving.popleft()
        self._leaving_bytes -= tensor.numel() * tensor.element_size()

    def _pack_streamed(self, tensor: Tensor) -> _Transfer:
        ops, device = self.ops, tensor.device
        self._release_left()
        side = self._side(device)
        ready = ops.event()
        ready.record(ops.current_stream(device))  # the tensor is complete here
        side.wait_event(ready)
        host = ops.host_buffer(tensor)
        with ops.stream(side):
            ops.copy(host, tensor)
        left = ops.event()
        left.record(side)
        self._leaving.append((left, tensor))  # not freed (nor its memory reused) before the copy leaves
        self._leaving_bytes += tensor.numel() * tensor.element_size()
        while self._leaving_bytes > self.max_in_flight_bytes and len(self._leaving) > 1:
            self._leaving[0][0].synchronize()
            self._forget_oldest()
        transfer = _Transfer(host, left, self._last.get(device))
        self._last[device] = weakref.ref(transfer)
        return transfer

    def _fetch(self, t: _Transfer, device: torch.device) -> None:
        """Start ``t``'s copy back to ``device`` on the side stream."""
        ops = self.ops
        compute, side = ops.current_stream(device), self._side(device)
        dst = ops.device_buffer(t.host, device)  # allocated in the compute stream's order
        free = ops.event()
        free.record(compute)
        side.wait_event(free)
        with ops.stream(side):
            ops.copy(dst, t.host)  # the same stream as the copy to the host: ordered after it
        ops.record_stream(dst, side)  # dropped unused (a wrong guess), its memory waits for the copy
        t.landed = ops.event()
        t.landed.record(side)
        t.fetched = dst

    def _unpack_streamed(self, device: torch.device, t: _Transfer) -> Tensor:
        self._release_left()
        if t.fetched is None:
            self._fetch(t, device)
        dst, landed = t.fetched, t.landed
        t.fetched, t.landed, t.unpacked = None, None, True  # the caller owns it; unpacking again copies again
        self.ops.current_stream(device).wait_event(landed)  # compute reads it after the copy lands
        prev = t.prev() if t.prev is not None else None
        if prev is not None and prev.fetched is None and not prev.unpacked:
            self._fetch(prev, device)  # on its way while this one is used
        return dst

    # --- hooks ---------------------------------------------------------------------------------------

    def _enter(self, module: nn.Module, args: Any) -> None:
        if module.training and torch.is_grad_enabled():
            hooks = torch.autograd.graph.saved_tensors_hooks(self._pack_entry, self._unpack_entry)
            hooks.__enter__()
            self._stack.append(hooks)
        else:
            self._stack.append(None)

    def _exit(self, module: nn.Module, args: Any, output: Any) -> None:
        hooks = self._stack.pop() if self._stack else None
        if hooks is not None:
            hooks.__exit__(None, None, None)
        self._release_left()
        if not self._stack:
            self._last.clear()  # a new forward starts a new chain for prefetching
            self._recipes.clear()
            self._packed.clear()

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
