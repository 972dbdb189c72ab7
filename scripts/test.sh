#!/usr/bin/env bash
# Set everything up, then run the whole test suite (unit and 2-rank DeepSpeed integration tests).
set -euo pipefail
cd "$(dirname "$0")/.."
# The SLURM tests (tests/integration/test_slurm.py) start a one-machine cluster of Debian's
# slurmctld/slurmd with munge. Only the test suite needs them: setup.sh installs them with its
# other system packages when they are missing and we are root; without them those tests are skipped.
if ! command -v slurmd >/dev/null 2>&1; then
    export ZEROPIPE_EXTRA_APT="slurmctld slurmd slurm-client munge"
fi
bash scripts/setup.sh
exec .venv/bin/python -m pytest "$@"
