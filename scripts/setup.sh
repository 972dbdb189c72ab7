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
# The browser tests (tests/e2e) drive Debian's Chromium through Playwright's executablePath;
# Playwright's own browser download is never used. Installed here when missing and we are root;
# without it those tests are skipped.
if [ ! -x /usr/bin/chromium ] && [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
    apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium >/dev/null \
        || echo "setup.sh: could not install chromium; the browser tests will be skipped" >&2
fi
# The multi-node tests (tests/integration/test_multinode.py) and scripts/multinode-demo.sh start a
# real OpenSSH server on loopback as a second "node". Installed here when missing and we are root;
# without it those tests are skipped.
if [ ! -x /usr/sbin/sshd ] && [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
    apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q openssh-server >/dev/null \
        || echo "setup.sh: could not install openssh-server; the multi-node tests will be skipped" >&2
fi
