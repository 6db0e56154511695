#!/usr/bin/env bash
# Create .venv with hf_ring and its test tools on the CPU build of torch. Idempotent.
# One line per step says what is being installed; pip itself stays quiet (-q) unless something fails.
set -euo pipefail
cd "$(dirname "$0")/.."
step() { printf 'setup_env: %s\n' "$*"; }
step "creating .venv ($(python3 --version 2>&1))"
python3 -m venv .venv
step "upgrading pip in .venv"
.venv/bin/python -m pip install -q --upgrade pip
step "installing torch $(sed -n 's/^torch==//p' constraints-cpu.txt) (CPU build, constraints-cpu.txt)"
.venv/bin/python -m pip install -q -c constraints-cpu.txt torch
step "installing hf_ring (editable) with transformers, accelerate, peft, datasets, trl and the test tools (pytest, ruff)"
.venv/bin/python -m pip install -q -c constraints-cpu.txt -e ".[dev]"
step ".venv is ready ($(.venv/bin/python -c 'from importlib.metadata import version as v
print(", ".join(f"{p} {v(p)}" for p in ("torch", "transformers", "accelerate", "trl")))'))"
