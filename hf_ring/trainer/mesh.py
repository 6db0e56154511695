"""accelerate's ``ParallelismConfig`` with ``cp_size``: hf_ring's ring over that mesh.

A user whose ``TrainingArguments(parallelism_config=ParallelismConfig(cp_size=P, ...))`` or whose
accelerate launch config (``parallelism_config_cp_size: P``, read from the environment
``PARALLELISM_CONFIG_*`` that ``accelerate launch`` sets) asks for context parallelism gets
hf_ring's exact ring over CP groups of ``P`` processes instead of accelerate's torch-native one:
``adopt_parallelism_config`` takes ``cp_size`` from it and takes the config away from accelerate
(``args.parallelism_config = None``, and the launcher's switch turned off), so the batch is sharded
once (by ``shard_batch``), no attention module is hooked, and sliding-window or hybrid models that
hf_ring computes exactly are not refused. ``dp_shard_size`` then maps onto FSDP2 over the whole
DP x CP world (``fsdp="full_shard"``, as with ``cp_size`` alone). What cannot work raises one
``ValueError`` naming the field to change.
"""

from __future__ import annotations

import os
from typing import Any

__all__ = ["adopt_parallelism_config"]

_ENV = "ACCELERATE_USE_PARALLELISM_CONFIG"
_SIZES = ("dp_replicate_size", "dp_shard_size", "tp_size", "cp_size", "sp_size")


def _from_env() -> dict[str, int] | None:
    if os.environ.get(_ENV, "false").lower() != "true":
        return None
    return {k: int(os.environ.get(f"PARALLELISM_CONFIG_{k.upper()}", "1")) for k in _SIZES}


def adopt_parallelism_config(args: Any, cp_size: int | None) -> int | None:
    """``cp_size`` for ``RingTrainer``: the one of ``args.parallelism_config`` (or of the launcher's
    ``PARALLELISM_CONFIG_*`` environment) when it asks for ``cp_size > 1``, after taking that config
    away from accelerate; else ``cp_size`` unchanged.

    Raises ``ValueError`` (naming the field) for ``tp_size > 1``, ``sp_size > 1``,
    ``dp_replicate_size > 1`` (HSDP) next to ``cp_size > 1``, ``cp_backend`` other than ``"torch"``,
    and a ``cp_size`` argument that disagrees with the config's."""
    pc = getattr(args, "parallelism_config", None)
    sizes = (
        {
            k: int(getattr(pc, k, 1) or 1)
            for k in ("dp_replicate_size", "dp_shard_size", "tp_size", "cp_size", "sp_size")
        }
        if pc is not None
        else _from_env()
    )
    if not sizes or sizes["cp_size"] <= 1:
        return cp_size
    where = "TrainingArguments.parallelism_config" if pc is not None else "the accelerate config (parallelism_config)"
    for field, fix in (("tp_size", "1"), ("sp_size", "1"), ("dp_replicate_size", "1 (FSDP2 over dp_shard x cp)")):
        if sizes[field] > 1:
            raise ValueError(
                f"hf_ring: {where} has cp_size={sizes['cp_size']} and {field}={sizes[field]}; hf_ring's ring runs "
                f"the CP groups itself and takes data parallelism (FSDP2 or DDP) around them only. Set {field} to "
                f"{fix}."
            )
    if pc is not None and getattr(pc, "cp_backend", "torch") not in (None, "torch"):
        raise ValueError(f"hf_ring: {where}.cp_backend={pc.cp_backend!r}; leave it at 'torch' (hf_ring replaces it).")
    if cp_size not in (None, 1, sizes["cp_size"]):
        raise ValueError(
            f"hf_ring: cp_size={cp_size} but {where} has cp_size={sizes['cp_size']}; set one of them (or both alike)."
        )
    if pc is not None:
        args.parallelism_config = None
    os.environ[_ENV] = "false"  # accelerate's Accelerator would build the config from the environment again
    if hasattr(args, "cp_size"):
        args.cp_size = sizes["cp_size"]
    return sizes["cp_size"]
