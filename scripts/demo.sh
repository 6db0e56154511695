#!/usr/bin/env bash
# The CPU demo, from a fresh machine: set up .venv, teach a tiny Llama passkey retrieval on short
# sequences (1 process), then fine-tune it at 2K, 4K and 8K tokens with ring attention on 4 CPU
# processes (CP = 4) and report retrieval accuracy at 8K before and after. Both runs are the
# recipe runner (recipes/train.py -> RingTrainer), as for the GPU recipes.
#
#   bash scripts/demo.sh [SEED]    # SEED (default 0): initialisation and training data of both runs
#
# writes runs/tiny-cpu-demo-pretrain/, runs/tiny-cpu-demo/ (summary.json, metrics.jsonl, loss.png)
# and runs/tiny-cpu-demo/demo.json: seed, accuracies, wall and CPU seconds of the demo.
set -euo pipefail
cd "$(dirname "$0")/.."
SEED=${1:-${SEED:-0}}
mkdir -p runs
marks=runs/.demo-marks
: > "$marks"
mark() {  # NAME: wall clock, CPU seconds of the finished children (bash's `times`) and the load, at this point
    times > "$marks.t"  # in this shell: a subshell's `times` would not count this shell's children
    echo "$1 $(date +%s.%N) $(sed -n 2p "$marks.t") $(cut -d' ' -f1 /proc/loadavg 2>/dev/null || echo 0)" >> "$marks"
}
mark start
bash scripts/setup_env.sh
mark setup
# one thread per process: on a shared 2-core machine, a second OpenMP thread waiting for a busy core
# made the same 450 steps 9x slower (37 s -> 337 s), with the same result
export OMP_NUM_THREADS=1
# the second stage's 4 processes start first: they import on the core the first stage leaves free,
# then wait for its model ($ready)
ready=runs/.demo-pretrained
rm -f "$ready"
.venv/bin/accelerate launch --config_file hf_ring/recipes/accelerate/cpu-4proc.yaml scripts/demo_finetune.py \
    "$ready" hf_ring/recipes/tiny-cpu-demo.yaml --resume_from_checkpoint no --seed "$SEED" &
launch=$!
trap 'kill "$launch" 2>/dev/null || true' EXIT  # the first stage failed: stop the waiting second one
.venv/bin/python recipes/train.py hf_ring/recipes/tiny-cpu-demo-pretrain.yaml --resume_from_checkpoint no --seed "$SEED"
mark pretrain
touch "$ready"
wait "$launch"
trap - EXIT
rm -f "$ready"
mark finetune
.venv/bin/python scripts/demo_summary.py "$SEED" "$marks"  # runs/tiny-cpu-demo/demo.json; where the time went
rm -f "$marks" "$marks.t"
