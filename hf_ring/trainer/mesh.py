"""accelerate's ``ParallelismConfig`` with ``cp_size``: hf_ring's ring over that mesh.

A user whose ``TrainingArguments(parallelism_config=ParallelismConfig(cp_size=P, ...))`` or whose
accelerate launch config (``parallelism_config_cp_size: P``, read from the environment
``PARALLELISM_CONFIG_*`` that ``accelerate launch`` sets) asks for context parallelism gets
hf_ring's exact ring over CP groups of ``P`` processes instead of accelerate's torch-native one:
``adopt_parallelism_config`` takes ``cp_size`` from it and takes the config away from accelerate
(``args.parallelism_config = None``, and the launcher's switch turned off), so the batch is sharded
once (by ``shard_batch``), no attention module is hooked, and sliding-window or hybrid models that
hf_ring computes exactly are not refused. ``dp_shard_size`` then maps onto FSDP2 over the whole
DP x CP world: FSDP2 (enabled as for any run: ``fsdp="full_shard"`` with ``fsdp_config={"version": 2}``,
or an accelerate FSDP2 launch config) shards every parameter over all ``dp_shard_size x cp_size``
processes and averages the gradients over them, which the ring's loss scale expects (tested equal to
one process at ``dp_shard_size=2, cp_size=2``: tests/test_mesh.py). What cannot work raises one
``ValueError`` naming the field to change (``check_layout`` once the trainer knows whether FSDP is on).
"""

from __future__ import annotations

import os
from typing import Any

from ..ledger import LEDGER

__all__ = ["adopt_parallelism_config", "check_layout", "parallelism_sizes"]

_ENV = "ACCELERATE_USE_PARALLELISM_CONFIG"
_SIZES = ("dp_replicate_size", "dp_shard_size", "tp_size", "cp_size", "sp_size")


def _from_env() -> dict[str, int] | None:
    if os.environ.get(_ENV, "false").lower() != "true":
        return None
    return {k: int(os.environ.get(f"PARALLELISM_CONFIG_{k.upper()}", "1")) for k in _SIZES}


def parallelism_sizes(args: Any) -> dict[str, int] | None:
    """The sizes (``dp_replicate_size``, ``dp_shard_size``, ``tp_size``, ``cp_size``, ``sp_size``) of
    ``args.parallelism_config`` or of the launcher's environment, when they ask for ``cp_size > 1``;
    else ``None``."""
    pc = getattr(args, "parallelism_config", None)
    sizes = {k: int(getattr(pc, k, 1) or 1) for k in _SIZES} if pc is not None else _from_env()
    return sizes if sizes and sizes["cp_size"] > 1 else None


def _where(args: Any) -> str:
    if getattr(args, "parallelism_config", None) is not None:
        return "TrainingArguments.parallelism_config"
    return "the accelerate config (parallelism_config)"


def adopt_parallelism_config(args: Any, cp_size: int | None) -> int | None:
    """``cp_size`` for ``RingTrainer``: the one of ``args.parallelism_config`` (or of the launcher's
    ``PARALLELISM_CONFIG_*`` environment) when it asks for ``cp_size > 1``, after taking that config
    away from accelerate; else ``cp_size`` unchanged.

    Raises ``ValueError`` (naming the field) for ``tp_size > 1``, ``sp_size > 1``,
    ``dp_replicate_size > 1`` together with ``dp_shard_size > 1`` (HSDP) next to ``cp_size > 1``,
    ``cp_backend`` other than ``"torch"``, and a ``cp_size`` argument that disagrees with the config's."""
    sizes = parallelism_sizes(args)
    if sizes is None:
        return cp_size
    pc = getattr(args, "parallelism_config", None)
    where = _where(args)
    cp = sizes["cp_size"]
    refused = [("tp_size", "1"), ("sp_size", "1")]
    if sizes["dp_shard_size"] > 1:
        refused.append(("dp_replicate_size", "1 (FSDP2 shards over dp_shard_size x cp_size; HSDP is not supported)"))
    for field, fix in refused:
        if sizes[field] > 1:
            raise ValueError(
                f"hf_ring: {where} has cp_size={cp} and {field}={sizes[field]}; hf_ring's ring runs the CP groups "
                f"itself and takes data parallelism (FSDP2 or DDP) around them only. Set {field} to {fix}."
            )
    if pc is not None and getattr(pc, "cp_backend", "torch") not in (None, "torch"):
        raise ValueError(f"hf_ring: {where}.cp_backend={pc.cp_backend!r}; leave it at 'torch' (hf_ring replaces it).")
    if cp_size not in (None, 1, cp):
        raise ValueError(f"hf_ring: cp_size={cp_size} but {where} has cp_size={cp}; set one of them (or both alike).")
    why = "hf_ring adopts accelerate's ParallelismConfig(cp_size=...) as its own CP (accelerate must not shard again)"
    if pc is not None:
        LEDGER.set_attr(args, "parallelism_config", None, why=why, scope="model")
    # accelerate's Accelerator would build the config from the environment again
    LEDGER.set_env(_ENV, "false", why=why)
    if hasattr(args, "cp_size"):
        args.cp_size = cp  # hf_ring's own field of RingTrainingArguments
    return cp


def check_layout(
    sizes: dict[str, int] | None, world_size: int, fsdp: bool, fsdp_asked: bool = False, distributed_type: str = ""
) -> None:
    """After the trainer is built: the adopted ``sizes`` (``parallelism_sizes``) against the launched
    ``world_size`` and whether FSDP is on (``fsdp``; ``fsdp_asked``: the arguments or the launcher asked for it;
    ``distributed_type``: accelerate's). ``dp_shard_size > 1`` needs FSDP and ``dp_shard_size x cp_size``
    processes; ``dp_replicate_size > 1`` (DDP replicas) needs FSDP off and ``dp_replicate_size x cp_size``
    processes. Raises ``ValueError`` naming the field."""
    if sizes is None:
        return
    cp, shard, rep = sizes["cp_size"], sizes["dp_shard_size"], sizes["dp_replicate_size"]
    where = "parallelism_config"
    if shard > 1 and not fsdp and fsdp_asked:
        # accelerate's AcceleratorState turns FSDP on for GPU-type distributed types only (MULTI_GPU, MULTI_XPU,
        # MULTI_NPU, ...; accelerate/state.py), never for MULTI_CPU (gloo)
        raise ValueError(
            f"hf_ring: {where}.dp_shard_size={shard} shards the model with FSDP2, and FSDP was asked for, but "
            f"accelerate did not turn it on: it enables FSDP only on GPU-type backends, and this run is "
            f"{distributed_type or 'not on one'} (on CPU processes, gloo). Run on GPUs, or set dp_shard_size to 1 "
            "(DDP over the CP groups)."
        )
    if shard > 1 and not fsdp:
        raise ValueError(
            f"hf_ring: {where}.dp_shard_size={shard} shards the model with FSDP2, which this run does not enable: "
            'set fsdp="full_shard" and fsdp_config={"version": 2} in the TrainingArguments (or launch with an '
            "accelerate FSDP2 config), or set dp_shard_size to 1 (DDP over the CP groups)."
        )
    if rep > 1 and fsdp:
        raise ValueError(
            f"hf_ring: {where}.dp_replicate_size={rep} with FSDP on: FSDP2 shards over every process here (HSDP is "
            f"not supported); set dp_shard_size to {rep} and dp_replicate_size to 1, or turn FSDP off (DDP)."
        )
    total = cp * max(shard, rep)
    if (shard > 1 or rep > 1) and total != world_size:
        field = "dp_shard_size" if shard > 1 else "dp_replicate_size"
        raise ValueError(
            f"hf_ring: {where} has {field}={max(shard, rep)} x cp_size={cp} = {total} processes, but {world_size} "
            f"were launched; set {field} to {world_size // cp} (world size / cp_size)."
        )
