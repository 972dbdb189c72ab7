#!/usr/bin/env bash
# Set everything up, then train the quickstart model on 2 CPU ranks under ZeRO-3 (a few minutes).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/zeropipe train examples/quickstart.yaml "run.name=quickstart-$(date +%Y%m%d-%H%M%S)" "$@"
