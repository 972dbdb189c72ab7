"""What every test lane shares: the CPU the suite decides for.

Whether the CPU runs bf16 natively changes what ``precision: auto`` picks, what the plan tries
and the dtype caches are filled in, and so the losses and messages the integration tests assert.
The one function that asks the CPU (``zeropipe.doctor.facts.cpu_flags``) reads
``ZEROPIPE_CPU_FLAGS`` first, so the suite describes one CPU here, a CPU without bf16 in
hardware, and passes the same on an AVX2-only machine and on one with avx512_bf16/AMX. Tests
about the other kind inject it themselves (``monkeypatch.setenv``, or a ``Hardware`` object
handed to the resolve). Set ZEROPIPE_CPU_FLAGS yourself to run the suite as another CPU.
"""

from __future__ import annotations

import os

import pytest

SUITE_CPU_FLAGS = "avx avx2 fma avx512f"


def pytest_configure(config):
    # Set at start-up, so that every process a test starts (ranks, the node's setup, the UI) inherits it.
    os.environ.setdefault("ZEROPIPE_CPU_FLAGS", SUITE_CPU_FLAGS)
    # The planner reads the speeds zeropipe calibrate saved for this machine; the suite plans with
    # the assumed ones (tests pin their figures), unless a test hands in a profile.
    os.environ.setdefault("ZEROPIPE_CALIBRATION", os.path.join(os.path.dirname(__file__), "no-calibration-profile.json"))


@pytest.fixture(autouse=True)
def _functional_linear_left_as_it_was():
    """Put back ``torch.nn.functional.linear`` after each test.

    DeepSpeed's ZeRO-3 replaces it with its memory-efficient wrapper (``zero3_linear_wrap``) for
    the rest of the process. A rank's process is its own, but a test that starts a ZeRO-3 engine
    in the pytest process (the architecture contract test) would otherwise change what every later
    test's autograd saves: the planner's activation traces among them.
    """
    import torch

    linear = torch.nn.functional.linear
    yield
    torch.nn.functional.linear = linear


# The files whose tests are independent (one per diffusion entry, nothing shared between them): spread
# over the test workers one test at a time. Every other file runs on one worker (see below).
SPREAD_FILES = {"tests/unit/diffusion/test_architecture_contract.py"}


@pytest.hookimpl(tryfirst=True, optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """Under ``--dist loadfile`` (scripts/test.sh) a test file runs on one worker, its module fixtures built
    once (a trained reference run, test_slurm.py's one SLURM cluster and munged for both its tests); the
    files in ``SPREAD_FILES`` are spread one test at a time.

    Written here rather than with xdist's ``--dist loadgroup`` and ``xdist_group`` marks: pytest-xdist 3.8
    puts the group into a test's id by assigning ``item._nodeid``, which pytest 9 no longer reads (a node's
    id is ``item._id``), so the marks were ignored and every test was spread one by one. CI then ran
    test_slurm.py's two tests on two workers, each with its own SLURM cluster starting and stopping the one
    munged: the two-node job never finished (2026-11-29)."""
    if config.getvalue("dist") != "loadfile":
        return None
    moved = sorted(path for path in SPREAD_FILES if not (config.rootpath / path).is_file())
    if moved:  # a renamed file would silently run on one worker
        raise pytest.UsageError(f"tests/conftest.py SPREAD_FILES names files that do not exist: {moved}")
    from xdist.scheduler import LoadFileScheduling

    class FileScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return nodeid if path in SPREAD_FILES else path

    return FileScheduling(config, log)
