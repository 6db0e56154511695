#!/usr/bin/env bash
# Set up the environment and run the CPU demo.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
.venv/bin/python examples/ring_attention_cpu.py "$@"
