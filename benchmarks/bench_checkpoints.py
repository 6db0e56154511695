"""What sealing and checking a checkpoint costs, against writing it.

    python -m benchmarks.bench_checkpoints --out benchmarks/results/checkpoints.jsonl    # ~1 min

For synthetic checkpoints of 64 MiB, 256 MiB and 1 GiB (an adapter, an optimizer state of twice
its size, a scheduler, two RNG states and ``trainer_state.json``, written with ``torch.save`` as
``Trainer`` does), in one process on a local disk, the median over 5 repetitions of:

* ``write``: writing the files (the baseline: what a save costs anyway);
* ``seal``: the manifest (listing, sizes, ``hf_ring_checkpoint.json`` written and renamed);
* ``seal_checksums``: the same with SHA-256 of every file (``checkpoint_checksums=True``);
* ``inspect``: the check at resume (sizes and ``trainer_state.json``);
* ``inspect_checksums``: the same with the checksums verified.

Rows give seconds and the ratio to ``write``. The files were just written, so reads come from the
page cache: on a network filesystem the checksums cost more (one more read of the checkpoint per
save, split over the ranks of a job).
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import torch

from benchmarks import harness as H
from hf_ring.trainer import checkpoints as ck

SIZES_MIB = (64, 256, 1024)


def write_checkpoint(folder: Path, mib: int) -> None:
    """Files shaped like a 2-rank LoRA checkpoint of ``mib`` MiB in all."""
    folder.mkdir(parents=True)
    adapter = mib // 3
    torch.save({"w": torch.zeros(adapter * 2**18)}, folder / "adapter_model.bin")
    torch.save({"exp_avg": torch.zeros((mib - adapter) * 2**18)}, folder / "optimizer.pt")
    torch.save({"last_epoch": 4}, folder / "scheduler.pt")
    for r in range(2):
        torch.save({"cpu": torch.random.get_rng_state()}, folder / f"rng_state_{r}.pth")
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": 4, "log_history": []}))


def timed(fn, *args, **kwargs) -> float:
    t = time.perf_counter()
    fn(*args, **kwargs)
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/results/checkpoints.jsonl")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--dir", default=None, help="where to write the checkpoints (default: a temporary folder)")
    args = ap.parse_args()
    meta = {"machine": H.machine_info(), "versions": H.versions()}
    table = H.Table(meta, lambda p: torch.get_num_threads())
    scope = ck.Scope(rank=0, world=2, peers=(0, 1))
    root = Path(tempfile.mkdtemp(prefix="hf_ring_ckpt_", dir=args.dir))
    try:
        for mib in SIZES_MIB:
            names = ("write", "seal", "seal_checksums", "inspect", "inspect_checksums")
            times: dict[str, list[float]] = {k: [] for k in names}
            for rep in range(args.reps):
                folder = root / f"checkpoint-{rep}"
                times["write"].append(timed(write_checkpoint, folder, mib))
                times["seal"].append(timed(ck.seal, folder, scope, optimizer=True))
                times["inspect"].append(timed(ck.inspect, folder, checksums=False))
                (folder / ck.MANIFEST).unlink()
                times["seal_checksums"].append(timed(ck.seal, folder, scope, optimizer=True, checksums=True))
                times["inspect_checksums"].append(timed(ck.inspect, folder, checksums=True))
                assert ck.inspect(folder) == ("complete", [])
                shutil.rmtree(folder)
            base = H.stats(times["write"])[0]
            for name, xs in times.items():
                table.add("checkpoint", name, "seconds", 1, mib, H.stats(xs), "s", note=f"{mib} MiB")
                table.add("checkpoint", name, "ratio_to_write", 1, mib, H.stats([x / base for x in xs]), "x")
                print(f"{mib:5d} MiB {name:18s} {H.stats(xs)[0] * 1e3:9.1f} ms  ({H.stats(xs)[0] / base:.3f} x write)")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    H.write_rows(args.out, table.rows)


if __name__ == "__main__":
    main()
