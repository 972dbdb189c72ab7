#!/usr/bin/env bash
# Set everything up, then run the whole test suite (unit and 2-rank DeepSpeed integration tests).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# The SLURM tests (tests/integration/test_slurm.py) start a one-machine cluster of Debian's
# slurmctld/slurmd with munge. Only the test suite needs them: installed here when missing and
# we are root; without them those two tests are skipped.
if ! command -v slurmd >/dev/null 2>&1 && [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
    apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q slurmctld slurmd slurm-client munge >/dev/null \
        || echo "test.sh: could not install slurm; the SLURM tests will be skipped" >&2
fi
exec .venv/bin/python -m pytest "$@"
