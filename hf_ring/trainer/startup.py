"""Start-up checks of a run: the output directory shared by all ranks, and what an output directory
already holds (``earlier_run``: the checkpoints and other files of an earlier run)."""

from __future__ import annotations

import os
import secrets
import socket
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist

from .checkpoints import checkpoint_dirs

__all__ = ["EarlierRun", "check_shared_output_dir", "earlier_run"]


@dataclass(frozen=True)
class EarlierRun:
    """What ``output_dir`` holds from an earlier run: its ``checkpoint-N`` folders (oldest first) and
    the names of its other entries (files and folders whose name starts with a dot are left out)."""

    checkpoints: tuple[Path, ...]
    others: tuple[str, ...]

    def __bool__(self) -> bool:
        return bool(self.checkpoints or self.others)

    def names(self, at_most: int = 4) -> str:
        """Up to ``at_most`` of its entries, for a message: ``checkpoint-40, final, summary.json, ...``."""
        names = [p.name for p in reversed(self.checkpoints)] + list(self.others)
        return ", ".join(names[:at_most]) + (", ..." if len(names) > at_most else "")


def earlier_run(output_dir: str | os.PathLike) -> EarlierRun:
    """What ``output_dir`` holds (nothing when it does not exist)."""
    root = Path(output_dir)
    if not root.is_dir():
        return EarlierRun((), ())
    checkpoints = tuple(p for _, p in checkpoint_dirs(root))
    others = tuple(sorted(p.name for p in root.iterdir() if not p.name.startswith(".") and p not in checkpoints))
    return EarlierRun(checkpoints, others)


def check_shared_output_dir(output_dir: str | os.PathLike) -> None:
    """Raise on every rank unless all ranks see the same ``output_dir``.

    Sharded checkpoints are written by every rank into one directory and read back by every rank on
    resume, so all nodes need one filesystem there. Rank 0 writes a file with a random token; after a
    barrier every rank reads it; the ranks agree on the result before anyone raises (no hang).
    """
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    rank = dist.get_rank()
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    box = [secrets.token_hex(8) if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    token = box[0]
    probe = out / f".hf_ring-shared-{token}"
    if rank == 0:
        probe.write_text(token)
    dist.barrier()
    try:
        ok = probe.read_text() == token
    except OSError:
        ok = False
    seen: list[tuple[bool, str] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(seen, (ok, socket.gethostname()))
    dist.barrier()
    if rank == 0:
        probe.unlink(missing_ok=True)
    blind = [f"rank {r} on {host}" for r, (good, host) in enumerate(seen) if not good]
    if blind:
        raise RuntimeError(
            f"output_dir {str(out)!r} is not shared by all ranks: {', '.join(blind)} cannot read what rank 0 "
            "wrote there. Checkpoints are written by every rank and read back by every rank on resume, so "
            "output_dir must be on a filesystem shared by all nodes (NFS, Lustre, ...): pass such a path "
            "as --output_dir."
        )
