"""Activation offload that can be measured on a CPU-only machine.

On such a machine ``hf_ring.ops.offload.OffloadActivations`` moves nothing (the activations are in
host memory already), so a memory measurement could not see the offload. ``MeasuredOffload``
copies each saved tensor into "host" memory as ``LiveTensorBytes`` counts it
(``host_allocations``) and copies it back in backward, as a device would. Pass it as
``hf_ring.enable_activation_checkpointing(model, offload=MeasuredOffload)``.

``FakeStreams`` stands in for CUDA streams (``hf_ring.ops.offload.StreamOps``) on CPU, with side-stream
copies deferred until something waits for them, so that the offload's ordering can be checked: a
tensor is never read before its copy lands, never freed before its copy leaves.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from typing import Any

import torch

from hf_ring.ops.offload import OffloadActivations
from testkit.live_tensors import host_allocations


class _Held:
    """One offloaded tensor: its host copy, its copy back once fetched, the one packed before it."""

    __slots__ = ("host", "fetched", "prev", "unpacked", "__weakref__")

    def __init__(self, host: torch.Tensor, prev: weakref.ref | None) -> None:
        self.host, self.prev = host, prev
        self.fetched: torch.Tensor | None = None
        self.unpacked = False


class MeasuredOffload(OffloadActivations):
    """The offload as a device would do it, on a CPU-only machine: each saved tensor copied into "host"
    memory (``host_allocations``) and copied back in backward; unpacking one also copies back the one
    packed before it (``OffloadActivations``' prefetch on CUDA), which is then device memory until
    backward takes it."""

    _prev: weakref.ref | None = None

    def pack(self, tensor: torch.Tensor) -> tuple[torch.device, object]:
        if tensor.device.type != "cpu":
            return super().pack(tensor)
        with host_allocations():
            held = _Held(tensor.clone(), self._prev)
        self._prev = weakref.ref(held)
        return tensor.device, held

    def unpack(self, packed: tuple[torch.device, object]) -> torch.Tensor:
        device, held = packed
        if not isinstance(held, _Held):
            return super().unpack(packed)  # type: ignore[arg-type]
        out = held.fetched if held.fetched is not None else held.host.clone()  # the copy back to the "device"
        held.fetched, held.unpacked = None, True
        prev = held.prev() if held.prev is not None else None
        if prev is not None and prev.fetched is None and not prev.unpacked:
            prev.fetched = prev.host.clone()  # on its way while this one is used
        return out

    def peek(self, packed: tuple[torch.device, object]) -> torch.Tensor:
        device, held = packed
        if not isinstance(held, _Held):
            return super().peek(packed)  # type: ignore[arg-type]
        if held.fetched is None:
            held.fetched = held.host.clone()  # on the "device" until its own unpacking takes it
        return held.fetched

    def _exit(self, module: torch.nn.Module, args: object, output: object) -> None:
        super()._exit(module, args, output)
        if not self._stack:
            self._prev = None  # a new forward starts a new chain


# --- the CUDA stream ordering of the offload, on CPU ------------------------------------------------


class FakeEvent:
    def __init__(self, streams: FakeStreams) -> None:
        self.streams, self.stream, self.done = streams, None, False
        self.name = f"e{len(streams.events)}"
        streams.events.append(self)

    def record(self, stream: FakeStream) -> None:
        self.stream, self.done = stream, False
        stream.enqueue(self._complete, f"record {self.name}")

    def _complete(self) -> None:
        self.done = True

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        """The host waits: the event's stream runs up to it."""
        if self.stream is not None:
            self.stream.run(until=self)


class FakeStream:
    """A queue of work. The compute stream (``eager``) is the Python program order: its work runs when
    issued. A side stream's work runs only when something waits for it (or the test calls ``run``)."""

    def __init__(self, streams: FakeStreams, name: str, eager: bool) -> None:
        self.streams, self.name, self.eager = streams, name, eager
        self.queue: list[tuple[Any, str]] = []

    def enqueue(self, job, what: str) -> None:
        self.streams.log.append(("issue", self.name, what))
        self.queue.append((job, what))
        if self.eager:
            self.run()

    def run(self, until: FakeEvent | None = None) -> None:
        while self.queue and not (until is not None and until.done):
            job, what = self.queue.pop(0)
            job()
            self.streams.log.append(("run", self.name, what))

    def wait_event(self, event: FakeEvent) -> None:
        """Later work on this stream waits for ``event``: on the eager compute stream, that means the
        event's stream runs up to it now; a side stream runs its queue in order anyway, after the
        compute stream's events (complete as soon as recorded)."""
        if self.eager:
            event.synchronize()
        self.enqueue(lambda: self._check(event), f"wait {event.name}")

    def _check(self, event: FakeEvent) -> None:
        if not event.done:
            self.streams.errors.append(f"{self.name} passed wait {event.name} before it completed")


class FakeStreams:
    """``hf_ring.ops.offload.StreamOps`` on CPU, where every tensor counts as a device tensor: copies
    on the side stream are deferred until something waits for them, so that what the offload does in
    between shows. A queued copy holds its device-side tensors only weakly (as a CUDA kernel does not
    keep memory alive): one freed before its copy ran is an error; buffers start as NaN, so a tensor
    read before its copy landed shows. ``log`` records issue and run order, ``errors`` the violations,
    ``tags`` names tensors (by ``id``) in the log."""

    def __init__(self) -> None:
        self.log: list[tuple[str, ...]] = []
        self.errors: list[str] = []
        self.events: list[FakeEvent] = []
        self.tags: dict[int, str] = {}
        self.compute = FakeStream(self, "compute", eager=True)
        self.sides: list[FakeStream] = []
        self.current = self.compute
        self._host: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # id -> host buffer
        self._kept: list[torch.Tensor] = []

    def streamed(self, tensor: torch.Tensor) -> bool:
        return True

    def current_stream(self, device: torch.device) -> FakeStream:
        return self.current

    def new_stream(self, device: torch.device) -> FakeStream:
        self.sides.append(FakeStream(self, f"side{len(self.sides)}", eager=False))
        return self.sides[-1]

    @contextlib.contextmanager
    def stream(self, stream: FakeStream) -> Iterator[None]:
        before, self.current = self.current, stream
        try:
            yield
        finally:
            self.current = before

    def event(self) -> FakeEvent:
        return FakeEvent(self)

    def host_buffer(self, tensor: torch.Tensor) -> torch.Tensor:
        host = torch.full(tensor.shape, float("nan"), dtype=tensor.dtype) if tensor.is_floating_point() else (
            torch.full(tensor.shape, -7, dtype=tensor.dtype))  # fmt: skip
        self._host[id(host)] = host
        self.tags[id(host)] = self.tags.get(id(tensor), "?")
        return host

    def device_buffer(self, host: torch.Tensor, device: torch.device) -> torch.Tensor:
        out = torch.full_like(host, float("nan")) if host.is_floating_point() else torch.full_like(host, -7)
        self.tags[id(out)] = self.tags.get(id(host), "?")
        return out

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        to_host = self._host.get(id(dst)) is dst
        kind, tag = ("d2h" if to_host else "h2d"), self.tags.get(id(src), "?")
        ref_dst = (lambda d=dst: d) if to_host else weakref.ref(dst)  # device memory: held weakly
        ref_src = weakref.ref(src) if to_host else (lambda s=src: s)

        def job() -> None:
            d, s = ref_dst(), ref_src()
            if d is None or s is None:
                self.errors.append(f"{kind} {tag}: its device tensor was freed before the copy ran")
                return
            d.copy_(s)

        self.current.enqueue(job, f"{kind} {tag}")

    def record_stream(self, tensor: torch.Tensor, stream: FakeStream) -> None:
        """Keep ``tensor`` until the work issued on ``stream`` so far has run."""
        self._kept.append(tensor)

        def release(t: torch.Tensor = tensor) -> None:
            self._kept = [k for k in self._kept if k is not t]

        stream.enqueue(release, f"release {self.tags.get(id(tensor), '?')}")

    def run_side(self) -> None:
        for s in self.sides:
            s.run()

    def runs(self, what: str) -> int:
        """Position in ``log`` where ``what`` ran (``-1``: not yet)."""
        return next((i for i, e in enumerate(self.log) if e[0] == "run" and e[2] == what), -1)
