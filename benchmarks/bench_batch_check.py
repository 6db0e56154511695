"""What comparing the batch across the CP group costs, against the rest of ``shard_batch``.

    python -m benchmarks.bench_batch_check --out benchmarks/results/batch_check.jsonl    # ~1 min

On 2 gloo ranks, for one sequence of N tokens (``input_ids``, ``labels``, ``position_ids``), the
median over 7 repetitions of:

* ``check``: ``check_same_batch`` (a fingerprint of every tensor, one all-gather of 16 integers);
* ``shard``: ``shard_batch`` with the check (what a training step pays for its batch in all);
* ``embed``: the lookup of the rank's N / 2 tokens in a 4096-wide bf16 embedding, the cheapest
  layer of a real model (a baseline measured in the same run).

Rows give seconds and ``check`` as a share of ``shard`` and of ``embed``.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from benchmarks import harness as H

LENGTHS = (32_768, 131_072, 524_288, 1_048_576)
REPS = 7


def _median(fn) -> float:
    times = []
    for _ in range(REPS):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[REPS // 2]


def _rank(rank: int, size: int, lengths: tuple[int, ...]) -> list[dict]:
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
        check = _median(lambda b=batch: check_same_batch(b, group))
        shard = _median(lambda b=batch: shard_batch(dict(b), group=group))
        local = ids[:, : n // size]
        with torch.no_grad():
            embed = _median(lambda x=local: emb(x))
        rows.append({"N": n, "P": size, "check_s": check, "shard_s": shard, "embed_s": embed,
                     "check_over_shard": check / shard, "check_over_embed": check / embed})  # fmt: skip
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/results/batch_check.jsonl")
    ap.add_argument("--quick", action="store_true", help="N = 4096 only (smoke test)")
    args = ap.parse_args()
    lengths = (4096,) if args.quick else LENGTHS
    per_rank, load = H.launch(_rank, 2, lengths, threads=1, timeout=600)
    rows = [{**r, "foreign_load": load, "machine": H.machine_info(), "versions": H.versions()} for r in per_rank[0]]
    print("| N | check ms | shard_batch ms | embedding ms | check / shard_batch | check / embedding |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['N']} | {1e3 * r['check_s']:.2f} | {1e3 * r['shard_s']:.2f} | {1e3 * r['embed_s']:.2f} "
              f"| {r['check_over_shard']:.2f} | {r['check_over_embed']:.2f} |")  # fmt: skip
    print(f"foreign CPU load during the run: {100 * load:.0f}%")
    with open(args.out, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)


if __name__ == "__main__":
    main()
