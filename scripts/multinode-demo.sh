#!/usr/bin/env bash
# The quickstart on two "nodes" of this machine: 127.0.0.1 (here) and 127.0.0.2 (through a real
# sshd this script starts on a free port with a throwaway key), one CPU rank each; then the same
# config as one node with 2 ranks. Prints the node count, the world size and both runs' losses.
#   bash scripts/multinode-demo.sh                      # the whole quickstart, twice (about 10 minutes on 2 cores)
#   bash scripts/multinode-demo.sh train.max_steps=60   # shorter: any key=value override of the quickstart
# Needs OpenSSH's server (scripts/setup.sh installs it as root). SKIP_SETUP=1 skips setup.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -n "${SKIP_SETUP:-}" ] || bash scripts/setup.sh
exec "${PYTHON:-.venv/bin/python}" scripts/multinode_demo.py "$@"
