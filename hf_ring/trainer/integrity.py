"""What a checkpoint directory must hold for a resume, and whether its files are whole, judged from
the files themselves (for checkpoints without a manifest, and when a manifest is written): the
model, optimizer, scheduler, RNG states and ``trainer_state.json``; the shards a distributed
checkpoint's ``.metadata`` names, with their extents; torch archives, safetensors files and JSON cut
short."""

from __future__ import annotations

import json
import re
import zipfile
from pathlib import Path

__all__ = ["missing_files", "rng_ranks", "shard_problems", "truncated"]

_MODEL = ("adapter_model.safetensors", "adapter_model.bin", "model.safetensors", "model.safetensors.index.json",
          "pytorch_model.bin", "pytorch_model.bin.index.json", "pytorch_model_fsdp.bin",
          "pytorch_model_fsdp_0/.metadata")  # fmt: skip
_OPTIMIZER = ("optimizer.pt", "optimizer.bin", "optimizer_0/.metadata")


def missing_files(folder: Path, files: dict[str, int], ranks: list[int] | None, optimizer: bool) -> list[str]:
    """The files a resume needs that ``files`` lacks (``ranks``: the ranks whose RNG states belong
    here, ``None`` for one process)."""
    missing = [] if "trainer_state.json" in files else ["trainer_state.json"]
    deepspeed = "latest" in files  # DeepSpeed keeps model and optimizer in its own global_step*/ layout
    model = any(f in files for f in _MODEL) or any(f.endswith("/adapter_model.safetensors") for f in files)
    if not (model or deepspeed):
        missing.append("the model (adapter_model.safetensors, model.safetensors or pytorch_model_fsdp_0/)")
    if optimizer:
        if not (deepspeed or any(f in files for f in _OPTIMIZER)):
            missing.append("the optimizer state (optimizer.pt or optimizer_0/)")
        rng = [f"rng_state_{r}.pth" for r in ranks] if ranks is not None else ["rng_state.pth"]
        missing += [f for f in ["scheduler.pt", *rng] if f not in files]
    for index in (f for f in files if f.endswith(".index.json")):
        try:
            shards = set(json.loads((folder / index).read_text()).get("weight_map", {}).values())
        except (OSError, ValueError):
            continue  # reported as unreadable by the caller's checks
        missing += sorted(s for s in shards if s not in files)
    return missing


def shard_problems(folder: Path, files: dict[str, int]) -> list[str]:
    """Missing or short shards of the distributed checkpoints (``torch.distributed.checkpoint``
    directories, FSDP2's sharded state) in ``folder``, read from their ``.metadata``."""
    from torch.distributed.checkpoint import FileSystemReader

    problems = []
    dirs = {f.rsplit("/", 1)[0] for f in files if f.endswith(".distcp") or f.endswith("/.metadata")}
    for d in sorted(dirs):
        if f"{d}/.metadata" not in files:
            problems.append(f"{d}/.metadata is missing (the sharded save did not finish)")
            continue
        try:
            meta = FileSystemReader(str(folder / d)).read_metadata()
        except Exception as e:  # noqa: BLE001 - any failure to read it means a damaged file
            problems.append(f"{d}/.metadata cannot be read ({type(e).__name__}: {e})")
            continue
        need: dict[str, int] = {}
        for info in (meta.storage_data or {}).values():
            rel = f"{d}/{info.relative_path}"
            need[rel] = max(need.get(rel, 0), int(info.offset) + int(info.length))
        for rel, size in sorted(need.items()):
            if rel not in files:
                problems.append(f"{rel} is missing")
            elif files[rel] < size:
                problems.append(f"{rel} is truncated ({files[rel]} of {size} bytes)")
    return problems


def truncated(path: Path) -> str | None:
    """Why ``path`` is cut short or unreadable, from its format alone, or ``None``."""
    name = path.name
    try:
        if name.endswith(".json"):
            json.loads(path.read_text())
        elif name.endswith(".safetensors"):
            size = path.stat().st_size
            with path.open("rb") as f:
                n = int.from_bytes(f.read(8), "little")
                if size < 8 + n:
                    return f"truncated ({size} bytes, its header alone needs {8 + n})"
                header = json.loads(f.read(n))
            end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
            if size < 8 + n + end:
                return f"truncated ({size} of {8 + n + end} bytes)"
        elif name.endswith((".pt", ".pth", ".bin")) and not path.stat().st_size:
            return "empty"
        elif name.endswith((".pt", ".pth", ".bin")) and not zipfile.is_zipfile(path):
            with path.open("rb") as f:  # torch.save writes a zip archive; a cut one lacks its directory
                head = f.read(4)
            if head[:2] == b"PK":
                return "truncated (its zip directory is missing)"
    except (OSError, ValueError, KeyError, TypeError, IndexError) as e:
        return f"unreadable ({type(e).__name__}: {e})"
    return None


def rng_ranks(files: dict[str, int], world: int) -> list[int] | None:
    """The ranks whose RNG states a manifest-less checkpoint should hold: those of the ranks found
    and of the ``world`` resuming from it (``None``: one process, ``rng_state.pth``)."""
    found = [int(m.group(1)) for f in files if (m := re.fullmatch(r"rng_state_(\d+)\.pth", f))]
    if "rng_state.pth" in files or (not found and world == 1):
        return None
    return list(range(max([*found, world - 1]) + 1))
