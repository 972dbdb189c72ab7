#!/usr/bin/env bash
# What only a GPU shows, in one command (on a machine with CUDA GPUs; see scripts/gpu_check.py):
#   bash scripts/gpu-check.sh [--out DIR] [--only STEP,...]
# Sets up the project's environment first, then writes DIR/report.md (default gpu-check/).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python scripts/gpu_check.py "$@"
