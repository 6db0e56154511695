#!/usr/bin/env bash
# Set up the environment and run the whole test suite (ruff, then pytest).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
.venv/bin/ruff check .
.venv/bin/python -m pytest -q "$@"
