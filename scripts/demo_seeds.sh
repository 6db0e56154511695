#!/usr/bin/env bash
# The CPU demo over several seeds, one after the other (docs/demo.md's figures, from docs/demo/seeds.json):
#
#   bash scripts/demo_seeds.sh [SEED ...]     # default: 0 1 2
#   QUIET_LOAD=1.5 bash scripts/demo_seeds.sh # before each seed, wait (at most 15 minutes) for the
#                                             # 1-minute load average to fall below 1.5
#
# runs `bash scripts/demo.sh SEED` for each seed and writes, under OUT (default docs/demo):
# seeds.json (each seed's runs/tiny-cpu-demo/demo.json, and the range of each figure over the
# seeds), seed-SEED.jsonl (the logged fine-tuning steps) and, from the first seed, loss.png and
# pretrain_loss.png.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-docs/demo}
SEEDS=("$@")
[ ${#SEEDS[@]} -gt 0 ] || SEEDS=(0 1 2)
mkdir -p "$OUT"
for seed in "${SEEDS[@]}"; do
    if [ -n "${QUIET_LOAD:-}" ]; then  # a shared machine: time each seed when the others are quiet
        waited=0
        while ! awk -v l="$(cut -d' ' -f1 /proc/loadavg)" -v q="$QUIET_LOAD" 'BEGIN { exit !(l < q) }' \
              && [ "$waited" -lt 900 ]; do
            sleep 15; waited=$((waited + 15))
        done
        echo "seed $seed: load average $(cut -d' ' -f1 /proc/loadavg) after waiting $waited s"
    fi
    bash scripts/demo.sh "$seed"
    cp runs/tiny-cpu-demo/demo.json "$OUT/seed-$seed.json"
    cp runs/tiny-cpu-demo/metrics.jsonl "$OUT/seed-$seed.jsonl"
    if [ "$seed" = "${SEEDS[0]}" ]; then
        cp runs/tiny-cpu-demo/loss.png "$OUT/loss.png" 2>/dev/null || true
        cp runs/tiny-cpu-demo-pretrain/loss.png "$OUT/pretrain_loss.png" 2>/dev/null || true
    fi
done
.venv/bin/python - "$OUT" "${SEEDS[@]}" <<'PY'
import json, os, sys

out, seeds = sys.argv[1], sys.argv[2:]
runs = [json.load(open(os.path.join(out, f"seed-{s}.json"))) for s in seeds]
for s in seeds:
    os.remove(os.path.join(out, f"seed-{s}.json"))
keys = ("accuracy_before", "accuracy_after", "final_loss", "wall_seconds", "cpu_seconds")
quiet = f"QUIET_LOAD={os.environ['QUIET_LOAD']} " if os.environ.get("QUIET_LOAD") else ""
summary = {"command": f"{quiet}bash scripts/demo_seeds.sh {' '.join(seeds)}",
           "range": {k: [min(r[k] for r in runs), max(r[k] for r in runs)] for k in keys},
           "runs": runs}
json.dump(summary, open(os.path.join(out, "seeds.json"), "w"), indent=2)
for r in runs:
    print(f"seed {r['seed']}: {r['accuracy_before']:.0%} -> {r['accuracy_after']:.0%} at "
          f"{r['eval']['seq_len'] // 1024}K ({r['eval']['samples']} samples), final loss {r['final_loss']:.4f}, "
          f"wall {r['wall_seconds']:.0f} s, CPU {r['cpu_seconds']:.0f} s")
print(f"written {out}/seeds.json")
PY
