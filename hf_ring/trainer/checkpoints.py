"""Checkpoints that a kill cannot break.

``Trainer`` writes ``checkpoint-N`` file by file, from every rank (under FSDP2 each rank its shard).
Here a directory counts as a checkpoint only once it holds its manifest, ``hf_ring_checkpoint.json``:
every file in it with its size (and its SHA-256 with ``checkpoint_checksums``), written by the
saving process after all ranks have finished writing, under a temporary name renamed into place.
A save first clears what an earlier attempt left under the same name and marks the directory as in
progress (``.hf_ring_incomplete``), so a kill at any point leaves either a complete checkpoint or
one that is recognisably incomplete.

Resuming (``resolve_resume``) takes the newest directory that holds together: a manifest whose
files are all there with their sizes (and checksums, when recorded). A directory without a manifest
and without the in-progress mark was written by ``Trainer`` or an older hf_ring: it is accepted
when the files a resume needs are there and none is truncated (torch archives, safetensors, JSON and
the shards named in a distributed checkpoint's ``.metadata`` are checked for that). Every rank checks
the directories and the ranks agree before any of them loads anything.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pickle
import re
import shutil
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist

from .integrity import missing_files, rng_ranks, shard_problems, truncated

__all__ = ["MANIFEST", "CheckpointError", "Scope", "checkpoint_dirs", "inspect", "resolve_resume"]

logger = logging.getLogger("hf_ring.trainer")

MANIFEST = "hf_ring_checkpoint.json"
IN_PROGRESS = ".hf_ring_incomplete"
_FORMAT = "hf_ring.checkpoint/1"
_NAME = re.compile(r"^checkpoint-(\d+)$")
_ADVICE = (
    "Resume from an earlier checkpoint (resume_from_checkpoint=<its path>), or move this directory away "
    "and resume from the last one (resume_from_checkpoint='last')."
)


class CheckpointError(ValueError):
    """A checkpoint that cannot be resumed from; the message names it, what is wrong and what to do."""


@dataclass(frozen=True)
class Scope:
    """The ranks that write (and read back) one checkpoint directory: all ranks on a filesystem
    shared by all nodes, the ranks of one node with ``save_on_each_node``; ``writer``: this rank
    writes the files that only one process writes (``Trainer``'s ``should_save``)."""

    rank: int = 0
    world: int = 1
    peers: tuple[int, ...] = (0,)
    writer: bool = True

    @classmethod
    def of(cls, args: Any) -> Scope:
        """This rank's scope under ``args`` (``TrainingArguments``); collective when distributed."""
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return cls()
        rank, world = dist.get_rank(), dist.get_world_size()
        node = rank - args.local_process_index if args.save_on_each_node else 0
        nodes: list[Any] = [None] * world
        dist.all_gather_object(nodes, node)
        return cls(rank, world, tuple(r for r in range(world) if nodes[r] == node), bool(args.should_save))

    @property
    def share(self) -> tuple[int, int]:
        """``(index, count)``: this rank's place among ``peers``, to split work over them (``(0, 1)``
        when this process is alone)."""
        if not (dist.is_available() and dist.is_initialized()):
            return 0, 1
        return self.peers.index(self.rank), len(self.peers)


def checkpoint_dirs(output_dir: str | os.PathLike) -> list[tuple[int, Path]]:
    """The ``checkpoint-N`` directories of ``output_dir`` as ``(N, path)``, oldest first."""
    root = Path(output_dir)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _NAME.match(p.name)) and p.is_dir()]
    return sorted(found)


# --------------------------------------------------------------------------------------- writing
def _gather(obj: Any) -> list[Any]:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _raise_if_any(error: str | None) -> None:
    """Raise the first error any rank had, on every rank (all ranks call it: nobody is left waiting)."""
    first = next((e for e in _gather(error) if e), None)
    if first:
        raise CheckpointError(first)


def _remove(folder: Path) -> None:
    """Delete a checkpoint directory, its manifest first: a kill half-way leaves it incomplete."""
    (folder / MANIFEST).unlink(missing_ok=True)
    shutil.rmtree(folder, ignore_errors=True)


def begin(folder: str | os.PathLike, scope: Scope) -> None:
    """Before a save into ``folder`` (every rank): clear what an earlier attempt left there and mark
    the directory as in progress, then wait for every rank."""
    folder = Path(folder)
    if scope.writer:
        if folder.exists():
            _remove(folder)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / IN_PROGRESS).write_text("a save into this directory has not finished\n")
    if dist.is_initialized():
        dist.barrier()


def _listing(folder: Path) -> dict[str, int]:
    files = {}
    for path in sorted(folder.rglob("*")):
        rel = path.relative_to(folder).as_posix()
        if path.is_file() and rel not in (MANIFEST, IN_PROGRESS) and not rel.endswith(".tmp"):
            files[rel] = path.stat().st_size
    return files


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def _write_manifest(folder: Path, manifest: dict[str, Any]) -> None:
    tmp = folder / f"{MANIFEST}.tmp"
    with tmp.open("w") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, folder / MANIFEST)
    try:  # make the rename itself durable
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass
    (folder / IN_PROGRESS).unlink(missing_ok=True)


def seal(folder: str | os.PathLike, scope: Scope, *, optimizer: bool, checksums: bool = False) -> None:
    """After every rank has written its part of ``folder`` (every rank calls it): the writer lists
    the files with their sizes (checksums: each rank of ``scope`` hashes its share), checks that what
    a resume needs is there, and writes the manifest. Raises ``CheckpointError`` on every rank when
    the save left out something a resume needs."""
    folder = Path(folder)
    if dist.is_initialized():
        dist.barrier()
    files = _listing(folder) if scope.writer else None
    sums: dict[str, str] = {}
    if checksums:  # every rank hashes its share of the files its writer listed
        listings = _gather(files)
        listed = next(x for r, x in enumerate(listings) if r in scope.peers and x is not None)
        i, n = scope.share
        for part in _gather({rel: _sha256(folder / rel) for k, rel in enumerate(listed) if k % n == i}):
            sums.update(part or {})
    error = None
    if files is not None:
        ranks = list(scope.peers) if scope.world > 1 else None
        missing = missing_files(folder, files, ranks, optimizer)
        if missing:
            error = (f"{folder}: the save did not write {', '.join(missing)}, which a resume needs; the "
                     "directory is left without a manifest (not a checkpoint).")  # fmt: skip
        else:
            manifest = {"format": _FORMAT, "ranks": ranks, "optimizer": optimizer, "files": files}
            if checksums:
                manifest["sha256"] = {rel: sums[rel] for rel in files}
            _write_manifest(folder, manifest)
    _raise_if_any(error)


def rotate(run_dir: str | os.PathLike, limit: int | None, best: str | None = None) -> None:
    """``save_total_limit`` for complete checkpoints: keep the newest ``limit`` complete ones (and
    ``best``); delete every other ``checkpoint-N`` older than the newest complete one (complete,
    interrupted, or written by ``Trainer``); never touch a newer one."""
    if not limit or limit <= 0:
        return
    dirs = checkpoint_dirs(run_dir)
    complete = [p for _, p in dirs if (p / MANIFEST).is_file() or not (p / IN_PROGRESS).exists()]
    sealed = [p for _, p in dirs if (p / MANIFEST).is_file()]
    if not sealed:
        return
    newest = sealed[-1]
    upto = complete.index(newest) + 1
    keep = set(complete[max(0, upto - limit) : upto])
    if best is not None:
        keep.add(Path(best))
    for _, path in dirs:
        if path == newest:
            break
        if path not in keep:
            logger.info("Deleting older checkpoint %s (save_total_limit=%s)", path, limit)
            _remove(path)


# --------------------------------------------------------------------------------------- checking
def inspect(
    folder: str | os.PathLike,
    *,
    optimizer: bool = True,
    checksums: bool = True,
    share: tuple[int, int] = (0, 1),
    world: int = 1,
) -> tuple[str, list[str]]:
    """What ``folder`` is and what is wrong with it, as ``(kind, problems)``: ``kind`` is
    ``"complete"`` (it has a manifest), ``"incomplete"`` (a save that did not finish) or
    ``"unsealed"`` (no manifest: ``Trainer``'s or an older hf_ring's). ``problems`` (empty when it
    can be resumed from): missing files, wrong sizes, checksums (``checksums``: this rank checks its
    ``share = (index, count)`` of the files), unreadable or truncated files. ``optimizer=False``
    (``save_only_model``): optimizer, scheduler and RNG states are not needed. Without a manifest,
    the RNG states of ranks ``0 .. world - 1`` (the processes resuming) are needed."""
    folder = Path(folder)
    if not folder.is_dir():
        return "missing", ["no such directory"]
    if not (folder / MANIFEST).exists():
        files = _listing(folder)
        if (folder / IN_PROGRESS).exists():
            return "incomplete", ["the save into it did not finish (no manifest)"]
        ranks = rng_ranks(files, world)
        problems = [f"{f} is missing" for f in missing_files(folder, files, ranks, optimizer)]
        problems += shard_problems(folder, files)
        for rel in files:
            why = None if rel.endswith(".distcp") else truncated(folder / rel)
            if why:
                problems.append(f"{rel} is {why}")
        return "unsealed", problems
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
        listed: dict[str, int] = manifest["files"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        return "complete", [f"{MANIFEST} is unreadable ({type(e).__name__}: {e})"]
    problems = []
    for rel, size in listed.items():
        path = folder / rel
        if not path.is_file():
            problems.append(f"{rel} is missing")
        elif path.stat().st_size != size:
            problems.append(f"{rel} is truncated or changed ({path.stat().st_size} bytes, written as {size})")
    if not problems:
        why = truncated(folder / "trainer_state.json")
        problems += [f"trainer_state.json is {why}"] if why else []
    sums = manifest.get("sha256") if checksums else None
    if sums and not problems:
        i, n = share
        problems += [f"{rel} does not match its SHA-256 (the file changed after it was written)"
                     for k, rel in enumerate(sums) if k % n == i and _sha256(folder / rel) != sums[rel]]  # fmt: skip
    return "complete", problems


# --------------------------------------------------------------------------------------- resuming
def _agreed(folder: Path, scope: Scope, optimizer: bool) -> tuple[str, list[str]]:
    """``inspect`` on every rank of the job, the problems of all ranks together."""
    kind, problems = inspect(folder, optimizer=optimizer, share=scope.share, world=scope.world)
    merged: list[str] = []
    for _, found in _gather((kind, problems)):
        merged += [p for p in found if p not in merged]
    return kind, merged


def resolve_resume(
    resume: str | bool | None, output_dir: str | os.PathLike, scope: Scope, *, optimizer: bool = True
) -> str | None:
    """The checkpoint to resume from (every rank calls it; all get the same answer).

    ``None``/``False``: none. A path: that checkpoint, or ``CheckpointError`` naming what is wrong
    with it. ``True`` or ``"last"``: the newest checkpoint in ``output_dir`` that holds together;
    the ones skipped on the way are logged as warnings with the reason. When none holds together:
    ``"last"`` starts from scratch if the skipped ones were only interrupted saves, ``True``
    raises ``ValueError`` (``Trainer``'s behaviour), and a damaged one (a manifest whose files are
    missing or changed) raises ``CheckpointError`` rather than start over.
    """
    if resume is None or resume is False:
        return None
    last = resume is True or (isinstance(resume, str) and resume.lower() == "last")
    if not last:
        kind, problems = _agreed(Path(resume), scope, optimizer)
        if problems:
            what = {
                "complete": "is damaged",
                "incomplete": "is incomplete",
                "unsealed": "cannot be resumed from",
                "missing": "cannot be read",
            }
            raise CheckpointError(f"Checkpoint {resume} {what[kind]}: {'; '.join(problems)}. {_ADVICE}")
        return str(resume)
    skipped: list[str] = []
    damaged = False
    chosen = None
    names: set[str] = set()
    for seen in _gather([p.name for _, p in checkpoint_dirs(output_dir)]):  # the same list on every rank
        names.update(seen)
    for name in sorted(names, key=lambda n: int(n.rsplit("-", 1)[1]), reverse=True):
        folder = Path(output_dir) / name
        kind, problems = _agreed(folder, scope, optimizer)
        if not problems:
            chosen = str(folder)
            if kind == "unsealed" and scope.rank == 0:
                logger.warning("Resuming from %s, which has no %s (written by Trainer or an older hf_ring): its "
                               "files were checked for presence and truncation only.", folder, MANIFEST)  # fmt: skip
            break
        damaged = damaged or kind in ("complete", "unsealed")
        skipped.append(f"{folder.name} ({'; '.join(problems)})")
    if skipped and scope.rank == 0:
        logger.warning("Skipped checkpoint(s) in %s that cannot be resumed from: %s. Resuming from %s.",
                       output_dir, ", ".join(skipped), chosen or "scratch (no complete checkpoint)")  # fmt: skip
    if chosen is None and damaged:
        raise CheckpointError(f"No checkpoint in {output_dir} can be resumed from: {', '.join(skipped)}. Repair or "
                              "move them away, or start over with resume_from_checkpoint=False.")  # fmt: skip
    if chosen is None and resume is True:
        why = f": {', '.join(skipped)}" if skipped else ""
        raise ValueError(f"No valid checkpoint found in output directory ({output_dir}){why}")
    return chosen


_DAMAGED = re.compile(
    r"PytorchStreamReader|zip archive|central directory|unexpected EOF|invalid header|"
    r"incomplete metadata|truncated|corrupt",
    re.IGNORECASE,
)


def _damaged_file(e: BaseException) -> bool:
    """Whether ``e`` is what loading a damaged file raises (not a timeout, not a model that differs
    from the checkpoint's: those keep their own message)."""
    damaged = (OSError, EOFError, pickle.UnpicklingError, zipfile.BadZipFile, json.JSONDecodeError, UnicodeDecodeError)
    if isinstance(e, damaged):
        return not isinstance(e, TimeoutError)
    if type(e).__name__ in ("SafetensorError", "CheckpointException"):
        return True
    return isinstance(e, (RuntimeError, ValueError)) and bool(_DAMAGED.search(str(e)))


@contextmanager
def load_errors(folder: str | os.PathLike | None) -> Iterator[None]:
    """Name the checkpoint and what to do when loading from ``folder`` fails on a damaged file
    (a truncated archive, bad JSON, a short safetensors file, ...); other errors pass unchanged."""
    try:
        yield
    except BaseException as e:
        if folder is None or isinstance(e, CheckpointError) or not _damaged_file(e):
            raise
        raise CheckpointError(
            f"Checkpoint {folder} could not be loaded: {type(e).__name__}: {str(e)[:500]}. A file in it is "
            f"damaged (truncated or overwritten). {_ADVICE}"
        ) from e
