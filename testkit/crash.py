"""Kill a whole training job at a chosen point of a checkpoint write, deterministically (tests only).

Every rank calls ``arm(spec, pids, rank)`` before training: it records its process id in the folder
``pids`` and patches the writers of a checkpoint so that, at the point ``spec`` names, the job dies
as a preempted or crashed job does: ``SIGKILL`` to every rank, this one last. ``spec`` is
``"<checkpoint>:<point>"``, e.g. ``"checkpoint-4:truncate:optimizer.pt"``:

- ``truncate:<file>``: the rank that writes ``<file>`` (``torch.save`` or safetensors) writes the
  first half of its bytes, then the job dies;
- ``shard:<dir>:<rank>``: rank ``<rank>`` dies as it starts writing its shard of the distributed
  checkpoint ``<dir>`` (``torch.distributed.checkpoint``, FSDP2's sharded state), and the job with it;
- ``manifest``: every file of the checkpoint is written, the job dies before its manifest is;
- ``rotate``: the checkpoint is sealed and ``save_total_limit`` deletes an older one: the job dies
  half-way through that deletion.
"""

from __future__ import annotations

import io
import os
import signal
import time
from pathlib import Path
from typing import Any


def kill_job(pids: Path) -> None:
    """``SIGKILL`` every process recorded in ``pids``, this one last."""
    me = os.getpid()
    for f in pids.glob("*.pid"):
        pid = int(f.read_text())
        if pid != me:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    time.sleep(0.05)
    os.kill(me, signal.SIGKILL)


def _in(checkpoint: str, path: Any) -> bool:
    return f"/{checkpoint}/" in str(path).replace(os.sep, "/")


def arm(spec: str, pids: Path, rank: int) -> None:
    """Record this rank's process id under ``pids`` and make the job die at ``spec`` (see above)."""
    pids.mkdir(parents=True, exist_ok=True)
    (pids / f"{rank}.pid").write_text(str(os.getpid()))
    checkpoint, point, *rest = spec.split(":")
    if point == "truncate":
        _truncate_on(checkpoint, rest[0], pids)
    elif point == "shard":
        _shard_on(checkpoint, rest[0], int(rest[1]), rank, pids)
    elif point == "manifest":
        from hf_ring.trainer import checkpoints

        write = checkpoints._write_manifest

        def write_manifest(folder: Path, manifest: dict) -> None:
            if folder.name == checkpoint:
                kill_job(pids)
            write(folder, manifest)

        checkpoints._write_manifest = write_manifest
    elif point == "rotate":
        from hf_ring.trainer import checkpoints

        remove = checkpoints._remove

        def remove_half(folder: Path) -> None:
            sealed = (folder.parent / checkpoint / checkpoints.MANIFEST).exists()
            if folder.name != checkpoint and sealed:
                (folder / checkpoints.MANIFEST).unlink(missing_ok=True)
                for f in sorted(p for p in folder.rglob("*") if p.is_file())[::2]:
                    f.unlink()
                kill_job(pids)
            remove(folder)

        checkpoints._remove = remove_half
    else:
        raise ValueError(f"unknown kill point {spec!r}")


def _truncate_on(checkpoint: str, name: str, pids: Path) -> None:
    import safetensors.torch
    import torch

    def cut(path: Any, data: bytes) -> None:
        with open(path, "wb") as f:
            f.write(data[: len(data) // 2])
            f.flush()
            os.fsync(f.fileno())
        kill_job(pids)

    save = torch.save

    def torch_save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(f, (str, os.PathLike)) and _in(checkpoint, f) and Path(f).name == name:
            buf = io.BytesIO()
            save(obj, buf, *args, **kwargs)
            cut(f, buf.getvalue())
        return save(obj, f, *args, **kwargs)

    torch.save = torch_save

    def st_save(tensors: dict, filename: Any, metadata: Any = None) -> None:
        if _in(checkpoint, filename) and Path(filename).name == name:
            cut(filename, safetensors.torch.save(tensors, metadata=metadata))
        return original_st(tensors, filename, metadata=metadata)

    original_st = safetensors.torch.save_file
    safetensors.torch.save_file = st_save
    try:
        import peft.peft_model

        peft.peft_model.safe_save_file = st_save
    except ImportError:
        pass


def _shard_on(checkpoint: str, directory: str, victim: int, rank: int, pids: Path) -> None:
    from torch.distributed.checkpoint import FileSystemWriter

    write = FileSystemWriter.write_data

    def write_data(self: Any, plan: Any, planner: Any) -> Any:
        path = str(self.path).replace(os.sep, "/")
        if rank == victim and _in(checkpoint, path + "/") and path.endswith(f"/{directory}"):
            kill_job(pids)
        return write(self, plan, planner)

    FileSystemWriter.write_data = write_data
