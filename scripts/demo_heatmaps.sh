#!/usr/bin/env bash
# The CPU demo's needle heatmaps, before and after ring-attention fine-tuning: the built-in passkey
# (the tiny model has no tokenizer) at 1K-16K tokens and depths 0-100 %, scored teacher-forced with
# context-parallel prefill on 4 CPU processes (CP = 4), then both side by side with accuracy vs
# length. Run it after `bash scripts/demo.sh`, which writes the two checkpoints:
#
#   bash scripts/demo_heatmaps.sh
#
# writes docs/demo/needle-before/needle.{json,png}, docs/demo/needle-after/needle.{json,png} and
# docs/demo/needle.png (each needle.json records its seconds and machine; docs/demo.md shows them). Every setting can be changed
# through the environment, e.g. BEFORE=runs/a/final AFTER=runs/b/final LENGTHS=1K,2K,...,64K.
set -euo pipefail
cd "$(dirname "$0")/.."
BEFORE=${BEFORE:-runs/tiny-cpu-demo-pretrain/final}  # the short-context model (trained at 24-256 tokens)
AFTER=${AFTER:-runs/tiny-cpu-demo/final}             # after fine-tuning at 2K and 8K with CP = 4
LENGTHS=${LENGTHS:-1K,2K,...,16K}
DEPTHS=${DEPTHS:-0,10,...,100}
SAMPLES=${SAMPLES:-4}      # keys per cell
NPROC=${NPROC:-4}          # processes = CP size (one CP group)
OUT=${OUT:-docs/demo}
PY=${PY:-.venv/bin/python}
for run in "$BEFORE" "$AFTER"; do
    [ -f "$run/config.json" ] || { echo "no checkpoint at $run: run 'bash scripts/demo.sh' first" >&2; exit 1; }
done
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
start=$(date +%s)
for stage in before after; do
    model=$BEFORE; [ "$stage" = after ] && model=$AFTER
    "$PY" -m torch.distributed.run --standalone --nproc-per-node "$NPROC" -m hf_ring.cli eval needle "$model" \
        --lengths "$LENGTHS" --depths "$DEPTHS" --samples "$SAMPLES" --out "$OUT/needle-$stage"
done
"$PY" -m hf_ring.cli eval plot "$OUT/needle-before" "$OUT/needle-after" \
    --labels "short-context model,after ring-attention fine-tuning (CP = $NPROC)" --out "$OUT/needle.png"
echo "needle heatmaps in $(($(date +%s) - start)) s: $OUT/needle.png"
