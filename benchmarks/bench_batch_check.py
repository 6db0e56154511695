"""What comparing the batch across the CP group costs, against the rest of ``shard_batch``.

    python -m benchmarks.bench_batch_check --out benchmarks/results/batch_check.jsonl    # ~1 min

On 2 gloo ranks, for one sequence of N tokens (``input_ids``, ``labels``, ``position_ids``), 7
repetitions of:

* ``check``: ``check_same_batch`` (a fingerprint of every tensor, one all-gather of 16 integers);
* ``shard``: ``shard_batch`` with the check (what a training step pays for its batch in all);
* ``embed``: the lookup of the rank's N / 2 tokens in a 4096-wide bf16 embedding, the cheapest
  layer of a real model (a baseline measured in the same run).

Rows (the long table of ``benchmarks.harness``, name ``batch_check``; rank 0's): seconds of each
(providers ``check_same_batch``, ``shard_batch``, ``embedding``) and the check's ratio to the other two;
a ``machine_load`` row gives the share of the CPUs other processes used meanwhile.
"""

from __future__ import annotations

import argparse
import time

import torch

from benchmarks import harness as H

LENGTHS = (32_768, 131_072, 524_288, 1_048_576)
REPS = 7


def _times(fn) -> list[float]:
    times = []
    for _ in range(REPS):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def _rank(rank: int, size: int, lengths: tuple[int, ...]) -> list[dict]:
    """Per N, the seconds of ``REPS`` repetitions of the check, ``shard_batch`` and the embedding lookup."""
    import torch.distributed as dist

    from hf_ring import shard_batch
    from hf_ring.transformers.batch import check_same_batch

    group = dist.group.WORLD
    rows = []
    emb = torch.nn.Embedding(32_000, 4096, dtype=torch.bfloat16)
    for n in lengths:
        g = torch.Generator().manual_seed(n)
        ids = torch.randint(0, 32_000, (1, n), generator=g)
        batch = {"input_ids": ids, "labels": ids.clone(), "position_ids": torch.arange(n)[None]}
        check = _times(lambda b=batch: check_same_batch(b, group))
        shard = _times(lambda b=batch: shard_batch(dict(b), group=group))
        local = ids[:, : n // size]
        with torch.no_grad():
            embed = _times(lambda x=local: emb(x))
        rows.append({"N": n, "check_same_batch": check, "shard_batch": shard, "embedding": embed})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/results/batch_check.jsonl")
    ap.add_argument("--quick", action="store_true", help="N = 4096 only (smoke test)")
    args = ap.parse_args()
    lengths = (4096,) if args.quick else LENGTHS
    p = 2
    per_rank, load = H.launch(_rank, p, lengths, threads=1, timeout=600)
    table = H.Table({"machine": H.machine_info(), "versions": H.versions()}, lambda _: 1)
    note = f"{p} gloo ranks, 1 thread each; {REPS} repetitions"
    notes = {"shard_batch": "the check included; ", "embedding": "the rank's N / P tokens looked up in a 4096-wide "
             "bf16 embedding; "}  # fmt: skip
    names = ("check_same_batch", "shard_batch", "embedding")
    for r in per_rank[0]:
        n = r["N"]
        for name in names:
            table.add("batch_check", name, "time", p, n, H.stats(r[name]), "s", note=notes.get(name, "") + note)
        for name in ("shard_batch", "embedding"):
            ratio = [c / x for c, x in zip(r["check_same_batch"], r[name])]
            table.add("batch_check", "check_same_batch", f"ratio_to_{name}", p, n, H.stats(ratio), "x", note=note)
        print(f"N={n}: " + ", ".join(f"{k} {1e3 * H.stats(r[k])[0]:.2f} ms" for k in names), flush=True)
    table.add("machine_load", "other_processes", "foreign_cpu_fraction", p, 0, (load, load, load), "fraction", x=p,
              note="CPU used by processes outside this benchmark during the run / (wall x cores)")
    print(f"foreign CPU load during the run: {100 * load:.0f}%")
    H.write_rows(args.out, table.rows)


if __name__ == "__main__":
    main()
