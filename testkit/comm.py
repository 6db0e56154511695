"""Rings that send nothing, for tests and benchmarks that drive the ring op on one process.

``hf_ring.ops.ring.ring_attention(..., ring=NoCommRing(size, rank))`` runs rank ``rank``'s schedule
of a ring of ``size`` ranks -- every kernel call, merge and accumulation -- while the channels only
record what would have travelled. The buffers then hold whatever they held (the received K/V block
is this rank's own); ``NoCommRing(..., fill=...)`` lets a caller put the right blocks there.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor


class NoCommChannel:
    """A ``RingComm`` stand-in: ``send_recv``/``commit``/``wait`` move nothing (or call ``fill``)."""

    def __init__(self, tag: int, fill: Callable[[int, Tensor, Tensor], None] | None = None) -> None:
        self.tag, self.fill = tag, fill
        self.sent_bytes = 0
        self._pending: list[tuple[Tensor, Tensor]] = []

    def send_recv(self, send: Tensor, recv: Tensor, hops: int = 1) -> None:
        self._pending.append((send, recv))

    def commit(self) -> None:
        pass

    def wait(self) -> None:
        for send, recv in self._pending:
            self.sent_bytes += send.numel() * send.element_size()
            if self.fill is not None:
                self.fill(self.tag, send, recv)
        self._pending = []


class NoCommRing:
    """A ``hf_ring.ops.comm.Ring`` stand-in: rank ``rank`` of ``size``, with channels that send nothing.

    ``fill(tag, send, recv)``, when given, is called at every ``wait`` to fill ``recv``.
    """

    group = None

    def __init__(self, size: int, rank: int, fill: Callable[[int, Tensor, Tensor], None] | None = None) -> None:
        self.size, self.rank, self.fill = size, rank, fill
        self.channels: list[NoCommChannel] = []

    def channel(self, tag: int = 0) -> NoCommChannel:
        ch = NoCommChannel(tag, self.fill)
        self.channels.append(ch)
        return ch
