"""Ring communication over an explicit process group: queue, commit, wait.

``Ring(group)`` is this rank's place on a ring over ``group``: its size, its rank, and channels
(``RingComm``) that send to the next rank and receive from the previous one, as one batched
point-to-point call, so the transfer runs while the caller computes. Works on gloo (CPU) and NCCL.
The ring attention op takes a ``Ring``; a benchmark or test can hand it any object with the same
``size``, ``rank``, ``group`` and ``channel(tag)`` (one that sends nothing, say). This module
imports only torch.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor


class RingComm:
    """Point-to-point neighbours of this rank on a ring over ``group``.

    >>> comm = RingComm(group)
    >>> comm.send_recv(block, next_block)  # queue: send ``block`` on, receive into ``next_block``
    >>> comm.commit()                      # launch the queued transfers
    >>> ...                                # compute on ``block``
    >>> comm.wait()                        # ``next_block`` is now filled
    """

    def __init__(self, group: dist.ProcessGroup | None, tag: int = 0) -> None:
        self.group = group
        self.size = dist.get_world_size(group)
        rank = dist.get_rank(group)
        self.rank = rank
        self.next = dist.get_global_rank(group, (rank + 1) % self.size) if group else (rank + 1) % self.size
        self.prev = dist.get_global_rank(group, (rank - 1) % self.size) if group else (rank - 1) % self.size
        self.tag = tag
        self._ops: list[dist.P2POp] = []
        self._works: list[dist.Work] = []

    def send_recv(self, send: Tensor, recv: Tensor, hops: int = 1) -> None:
        """Queue sending ``send`` to the next rank and receiving the previous rank's into ``recv``
        (``hops``: to the rank that many places on, from the one that many places back)."""
        dst, src = self.next, self.prev
        if hops != 1:
            dst, src = self._global((self.rank + hops) % self.size), self._global((self.rank - hops) % self.size)
        self._ops.append(dist.P2POp(dist.isend, send, dst, self.group, self.tag))
        self._ops.append(dist.P2POp(dist.irecv, recv, src, self.group, self.tag))

    def _global(self, rank: int) -> int:
        return dist.get_global_rank(self.group, rank) if self.group else rank

    def commit(self) -> None:
        """Launch every queued transfer."""
        if self._works:
            raise RuntimeError("RingComm.commit called twice without wait")
        self._works = dist.batch_isend_irecv(self._ops)
        self._ops = []

    def wait(self) -> None:
        """Block until the committed transfers are done."""
        for work in self._works:
            work.wait()
        self._works = []


class Ring:
    """This rank's place on a ring over ``group`` (``None``: the world group; a single rank when
    torch.distributed is not initialised). ``channel(tag)`` opens a ``RingComm`` on it."""

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.group = group
        self.size, self.rank = group_size_rank(group)

    def channel(self, tag: int = 0) -> RingComm:
        """A communicator for one stream of blocks around this ring (``tag`` keeps streams apart)."""
        return RingComm(self.group, tag)


def group_size_rank(group: dist.ProcessGroup | None) -> tuple[int, int]:
    """``(size, rank)`` of ``group``; ``(1, 0)`` when torch.distributed is not initialised."""
    if not dist.is_available() or not dist.is_initialized():
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def check_same_across_ranks(
    values: list[int], group: dist.ProcessGroup | None, what: str, names: list[str] | None = None, fix: str = ""
) -> None:
    """Raise ``ValueError`` on every rank unless all ranks of ``group`` pass the same ``values``.

    Costs one all-gather of 16 integers (``values`` holds at most 15). With ``names`` (one per value)
    the error names the first value that differs; ``fix`` ends the message (default: pass tensors of
    the same shape, dtype and options).
    """
    size, _ = group_size_rank(group)
    if size == 1:
        return
    device = torch.device("cpu")
    if dist.get_backend(group) == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    if len(values) > 15:
        raise ValueError("check_same_across_ranks takes at most 15 values")
    mine = torch.full((16,), -1, dtype=torch.int64, device=device)
    mine[0] = len(values)
    mine[1 : 1 + len(values)] = torch.tensor(values, dtype=torch.int64)
    gathered = [torch.empty_like(mine) for _ in range(size)]
    dist.all_gather(gathered, mine, group=group)
    rows = [g[1 : 1 + int(g[0])].tolist() for g in gathered]
    if all(row == rows[0] for row in rows):
        return
    if names is not None and all(len(row) == len(names) for row in rows):
        i = next(i for i in range(len(names)) if any(row[i] != rows[0][i] for row in rows))
        listing = ", ".join(f"rank {r}: {row[i]}" for r, row in enumerate(rows))
        what = f"{what}: {names[i]} differs ({listing})"
    else:
        what = f"{what} ({', '.join(f'rank {i}: {row}' for i, row in enumerate(rows))})"
    raise ValueError(
        f"ranks of the context-parallel group disagree on {what}; "
        + (fix or "every rank must pass tensors of the same shape, dtype and options, or the ring would deadlock.")
    )


_INT_VIEW = {8: torch.int32, 4: torch.int32, 2: torch.int16, 1: torch.int8}


def fingerprint(t: Tensor) -> int:
    """A cheap hash of ``t``'s shape and contents (one multiply-add pass), the same on every device and
    for every summation order: a weighted sum of its elements (floats by their bits) in wrapping int64."""
    x = t.detach()
    if x.dtype == torch.bool:
        x = x.to(torch.int8)
    if x.is_floating_point():
        x = x.contiguous().view(_INT_VIEW[x.element_size()])
    flat = x.reshape(-1).to(torch.int64)
    w = (torch.arange(flat.numel(), device=flat.device) * 2654435761 + 40503) % 2147483647 + 1
    return int((flat * w).sum()) ^ hash(tuple(t.shape)) & 0x7FFFFFFF
