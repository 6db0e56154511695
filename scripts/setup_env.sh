#!/usr/bin/env bash
# Create .venv with hf_ring and its test tools on the CPU build of torch. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -c constraints-cpu.txt torch
.venv/bin/python -m pip install -q -c constraints-cpu.txt -e ".[dev]"
