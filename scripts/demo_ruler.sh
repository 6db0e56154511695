#!/usr/bin/env bash
# RULER on the CPU demo's model, before and after ring-attention fine-tuning: niah_single_1 (one needle
# in a noise haystack, the answer generated) in the demo's passkey token ids (the tiny model has no
# tokenizer), at 1K-8K tokens, with context-parallel prefill and greedy decoding over a KV cache
# sharded across 4 CPU processes (CP = 4). Run it after `bash scripts/demo.sh`, which writes the two
# checkpoints:
#
#   bash scripts/demo_ruler.sh
#
# writes docs/demo/ruler-before/ruler.{json,png} and docs/demo/ruler-after/ruler.{json,png} (each
# ruler.json records its samples, outputs, seconds and machine; docs/demo.md shows them). Every setting
# can be changed through the environment, e.g. BEFORE=runs/a/final LENGTHS=1K,2K,...,16K SAMPLES=32.
set -euo pipefail
cd "$(dirname "$0")/.."
BEFORE=${BEFORE:-runs/tiny-cpu-demo-pretrain/final}  # the short-context model (trained at 24-256 tokens)
AFTER=${AFTER:-runs/tiny-cpu-demo/final}             # after fine-tuning at 2K-8K with CP = 4
LENGTHS=${LENGTHS:-1K,2K,4K,8K}
SAMPLES=${SAMPLES:-16}     # samples per length
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
    "$PY" -m torch.distributed.run --standalone --nproc-per-node "$NPROC" -m hf_ring.cli eval ruler "$model" \
        --mode passkey --tasks niah_single_1 --lengths "$LENGTHS" --samples "$SAMPLES" --out "$OUT/ruler-$stage"
done
echo "RULER before and after in $(($(date +%s) - start)) s: $OUT/ruler-before/ruler.json, $OUT/ruler-after/ruler.json"
