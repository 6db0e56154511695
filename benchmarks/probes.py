"""Probes: what a benchmark measures inside hf_ring's ops, without patching hf_ring.

* ``TimedKernel`` and ``TimedRing`` wrap a block kernel and a ring (passed to ``ring_attention`` as
  ``backend=`` and ``ring=``) and add the time spent in kernel calls and in ``wait`` to a ``Probe``;
  each also opens a ``torch.profiler.record_function`` range (``hf_ring.kernel.forward|backward``,
  ``hf_ring.comm.commit|wait``).
* ``CommBytes`` counts the bytes this process sends through ``torch.distributed``'s collectives.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass

__all__ = ["CommBytes", "Probe", "TimedChannel", "TimedKernel", "TimedRing"]


@dataclass
class Probe:
    """Wall seconds summed by the timed wrappers since the last ``reset``."""

    wait: float = 0.0  # inside the ring channels' wait
    kernel: float = 0.0  # inside block kernel calls
    kernel_calls: int = 0

    def reset(self) -> None:
        self.wait = self.kernel = 0.0
        self.kernel_calls = 0


class TimedKernel:
    """A block kernel that adds the wall time of every forward/backward call of ``inner`` to
    ``probe.kernel`` (two ``perf_counter`` calls each), inside a profiler range ``hf_ring.kernel.<call>``."""

    def __init__(self, inner, probe: Probe) -> None:
        self.inner, self.probe = inner, probe
        self.name, self.heads_major = inner.name, inner.heads_major

    def _timed(self, which: str, *a, **kw):
        import torch

        t0 = time.perf_counter()
        with torch.profiler.record_function(f"hf_ring.kernel.{which}"):
            r = getattr(self.inner, which)(*a, **kw)
        self.probe.kernel += time.perf_counter() - t0
        self.probe.kernel_calls += 1
        return r

    def forward(self, *a, **kw):
        return self._timed("forward", *a, **kw)

    def backward(self, *a, **kw):
        return self._timed("backward", *a, **kw)


class TimedChannel:
    """A ring channel whose ``wait`` adds its wall time to ``probe.wait``; ``commit`` and ``wait`` run
    inside profiler ranges ``hf_ring.comm.commit`` / ``hf_ring.comm.wait``."""

    def __init__(self, inner, probe: Probe) -> None:
        self.inner, self.probe = inner, probe

    def send_recv(self, send, recv, **kw) -> None:
        self.inner.send_recv(send, recv, **kw)

    def commit(self) -> None:
        import torch

        with torch.profiler.record_function("hf_ring.comm.commit"):
            self.inner.commit()

    def wait(self) -> None:
        import torch

        t0 = time.perf_counter()
        with torch.profiler.record_function("hf_ring.comm.wait"):
            self.inner.wait()
        self.probe.wait += time.perf_counter() - t0


class TimedRing:
    """``inner`` (a ``hf_ring.ops.comm.Ring`` or a stand-in such as ``testkit.comm.NoCommRing``) with
    every channel a ``TimedChannel``: pass it to ``ring_attention(..., ring=...)``."""

    def __init__(self, inner, probe: Probe) -> None:
        self.inner, self.probe = inner, probe
        self.size, self.rank, self.group = inner.size, inner.rank, inner.group

    def channel(self, tag: int = 0) -> TimedChannel:
        """``inner.channel(tag)``, timed."""
        return TimedChannel(self.inner.channel(tag), self.probe)


class CommBytes:
    """Counts the bytes this process sends through ``torch.distributed``'s collectives, by kind.

    Made once per worker process, it wraps ``torch.distributed``'s ``all_gather``,
    ``all_gather_into_tensor``, ``all_reduce``, ``reduce_scatter_tensor``, ``all_to_all_single``,
    ``send`` and ``isend`` (hf_ring's ops call them through the module, so they see the wrappers;
    hf_ring is not patched). Only calls inside ``with counting(kind):`` are counted; ``take()``
    returns ``{kind: bytes, "total": bytes}`` and starts again. Bytes sent by this rank: an
    all-gather sends its input to each of the other ``P - 1`` ranks; an all-reduce or a
    reduce-scatter ``2 (P - 1) / P`` or ``(P - 1) / P`` of its tensor (the ring algorithms'); an
    all-to-all the rows it sends to other ranks; a send its tensor."""

    def __init__(self) -> None:
        import torch.distributed as dist

        self.kind: str | None = None
        self.sent: dict[str, int] = {}
        for name, size_of in (
            ("all_gather", lambda world, _out, t, *a, **k: (world - 1) * t.nbytes),
            ("all_gather_into_tensor", lambda world, _out, t, *a, **k: (world - 1) * t.nbytes),
            ("all_reduce", lambda world, t, *a, **k: 2 * (world - 1) * t.nbytes // world),
            ("reduce_scatter_tensor", lambda world, _out, t, *a, **k: (world - 1) * t.nbytes // world),
            ("all_to_all_single", self._all_to_all),
            ("send", lambda world, t, *a, **k: t.nbytes),
            ("isend", lambda world, t, *a, **k: t.nbytes),
        ):
            inner = getattr(dist, name)
            if getattr(inner, "_counted", False):
                continue
            setattr(dist, name, self._wrap(inner, size_of))

    @staticmethod
    def _all_to_all(world, out, t, output_split_sizes=None, input_split_sizes=None, group=None, **_):
        import torch.distributed as dist

        rank = dist.get_rank(group)
        if input_split_sizes is None:
            return t.nbytes * (world - 1) // world
        row = t.nbytes // max(t.shape[0], 1)
        return row * sum(s for d, s in enumerate(input_split_sizes) if d != rank)

    def _wrap(self, inner, size_of):
        import functools

        import torch.distributed as dist

        @functools.wraps(inner)
        def counted(*a, **k):
            if self.kind is not None:
                world = dist.get_world_size(k.get("group"))
                self.sent[self.kind] = self.sent.get(self.kind, 0) + int(size_of(world, *a, **k))
            return inner(*a, **k)

        counted._counted = True  # type: ignore[attr-defined]
        return counted

    @contextlib.contextmanager
    def counting(self, kind: str) -> Iterator[None]:
        """Count the collectives called inside the block as ``kind``."""
        before, self.kind = self.kind, kind
        try:
            yield
        finally:
            self.kind = before

    def take(self) -> dict[str, int]:
        """The bytes counted since the last ``take``, by kind, and their ``total``."""
        out, self.sent = self.sent, {}
        out["total"] = sum(out.values())
        return out
