"""Start-up checks of a distributed run."""

from __future__ import annotations

import os
import secrets
import socket
from pathlib import Path

import torch.distributed as dist

__all__ = ["check_shared_output_dir"]


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
