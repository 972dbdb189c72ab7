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
.venv/bin/python -m pip install -q -e '.[test,qlora]'
# System packages, installed when missing and we are root (without them the tests that need them
# are skipped): Debian's Chromium for the browser tests (tests/e2e drive it through Playwright's
# executablePath; Playwright's own browser download is never used) and OpenSSH's server for the
# multi-node tests and scripts/multinode-demo.sh (a real sshd on loopback as a second "node").
# scripts/test.sh adds SLURM's packages through ZEROPIPE_EXTRA_APT. One apt-get update for all.
missing=()
[ -x /usr/bin/chromium ] || missing+=(chromium)
[ -x /usr/sbin/sshd ] || missing+=(openssh-server)
for package in ${ZEROPIPE_EXTRA_APT:-}; do missing+=("$package"); done
if [ ${#missing[@]} -gt 0 ] && [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
    export DEBIAN_FRONTEND=noninteractive
    if apt-get update -q >/dev/null; then
        # All at once; if that fails, one by one so one missing package does not cost the others.
        apt-get install -y -q "${missing[@]}" >/dev/null || for package in "${missing[@]}"; do
            apt-get install -y -q "$package" >/dev/null || echo "setup.sh: could not install $package; the tests that need it will be skipped" >&2
        done
    else
        echo "setup.sh: apt-get update failed; not installed: ${missing[*]} (the tests that need them will be skipped)" >&2
    fi
fi
