#!/usr/bin/env bash
# Create .venv and install ZeRO-Pipe with what its tests need. Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
# Install torch first and pinned: an unpinned torch would pull a multi-GB CUDA build where a
# CPU wheel is what this machine has. On a GPU box, install your CUDA build of torch first;
# this step then leaves it alone.
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
    .venv/bin/python -m pip install -q "torch==${TORCH_VERSION:-2.13.0}"
fi
.venv/bin/python -m pip install -q -e '.[test]'
