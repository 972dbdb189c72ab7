#!/usr/bin/env bash
# Set everything up, then run the whole test suite: the unit, integration (2-rank DeepSpeed runs
# on CPU) and e2e (web UI in a real browser) lanes, one pytest each, with each lane's time printed
# so that CI's growth is visible. Any failing lane fails the script; the others still run.
# Each lane writes its per-test durations (test-results/<lane>.xml, JUnit); at the end the slowest
# 30 tests across lanes are printed with their lane, and all of them are in test-results/test-durations.txt.
# With arguments, run just `pytest "$@"` (e.g. `bash scripts/test.sh tests/unit -k plan`).
set -euo pipefail
cd "$(dirname "$0")/.."
# The SLURM tests (tests/integration/test_slurm.py) start a one-machine cluster of Debian's
# slurmctld/slurmd with munge. Only the test suite needs them: setup.sh installs them with its
# other system packages when they are missing and we are root; without them those tests are skipped.
if ! command -v slurmd >/dev/null 2>&1; then
    export ZEROPIPE_EXTRA_APT="slurmctld slurmd slurm-client munge"
fi
bash scripts/setup.sh
if [ $# -gt 0 ]; then
    exec .venv/bin/python -m pytest "$@"
fi

# A Ctrl-C ends the script, not just the lane that was running.
trap 'echo "test.sh: interrupted" >&2; exit 130' INT TERM
failed=()
summary=()
suite_started=$SECONDS
rm -rf test-results
mkdir -p test-results
# DeepSpeed's CPU ops (its shared-memory collective, CPU Adam) are built on first use: once here,
# before two test workers could race to build them.
.venv/bin/python scripts/build_ds_ops.py 2>&1 | grep "DeepSpeed op" || true
for lane in unit integration e2e gpu; do
    started=$SECONDS
    rc=0
    # The unit lane runs on two workers (pytest-xdist), a test file at a time per worker (the diffusion
    # contract's per-entry tests one at a time: tests/conftest.py): many of its tests wait
    # (on files, subprocesses, DeepSpeed's start-up), so two files at a time use both cores.
    # The integration lane runs on two workers too. Its ranks are forked from their launcher
    # (tests/integration/conftest.py, zeropipe/launch/fork_start.py), so a run no longer spends most
    # of its CPU on each rank's imports, and its single-process phases (planning, caching, export,
    # sampling) leave a core idle. Measured on an idle 2-core machine (2026-11-29): the whole lane took
    # 1,305 s with new rank interpreters on one worker, 825 s forked on one worker (1.27 cores busy),
    # 662 s forked on two. ZEROPIPE_INTEGRATION_WORKERS=1 runs it in one process (rendezvous ports
    # cannot collide on two: the launcher holds the port it picks).
    workers=()
    case "$lane" in
        unit) count="${ZEROPIPE_UNIT_WORKERS:-2}" ;;
        integration) count="${ZEROPIPE_INTEGRATION_WORKERS:-2}" ;;
        *) count=1 ;;
    esac
    if [ "$count" -gt 1 ]; then
        workers=(-n "$count" --dist loadfile)
    fi
    .venv/bin/python -m pytest "tests/$lane" "${workers[@]}" --junitxml "test-results/$lane.xml" || rc=$?
    took=$((SECONDS - started))
    # Exit code 5 is "no tests collected" (an empty lane, or one that -k/-m deselected entirely): not a failure.
    if [ "$rc" -eq 5 ]; then
        outcome="no tests"
    elif [ "$rc" -eq 0 ]; then
        outcome="passed"
    else
        outcome="FAILED: pytest exit $rc"
        failed+=("$lane")
    fi
    echo "lane $lane: $took s ($outcome)"
    summary+=("lane $lane: $took s ($outcome)")
done
.venv/bin/python scripts/slowest_tests.py test-results 30 || true
echo "================ test.sh summary ================"
for line in "${summary[@]}"; do
    echo "$line"
done
echo "total: $((SECONDS - suite_started)) s"
if [ ${#failed[@]} -gt 0 ]; then
    echo "failed lanes: ${failed[*]}"
    exit 1
fi
echo "all lanes passed"
