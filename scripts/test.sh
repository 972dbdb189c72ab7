#!/usr/bin/env bash
# Set everything up, then run the whole test suite (unit and 2-rank DeepSpeed integration tests).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest "$@"
