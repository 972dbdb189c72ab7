"""``zeropipe doctor``: what on this machine will break a run, and what to do about it.

``gather_facts`` finds out versions, GPUs, the CUDA toolkit, memory and disk (and tries to
build DeepSpeed's CPU Adam); ``examine`` judges those facts into findings, each ok /
warning / error / info with its fix. ``run_doctor`` does both.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass

from zeropipe.doctor.checks import Finding, examine
from zeropipe.doctor.facts import MachineFacts, gather_facts

__all__ = ["DoctorReport", "Finding", "MachineFacts", "examine", "gather_facts", "run_doctor"]


@dataclass
class DoctorReport:
    findings: list[Finding]
    facts: MachineFacts

    @property
    def has_errors(self) -> bool:
        return any(finding.status == "error" for finding in self.findings)

    def to_dict(self) -> dict:
        return {"findings": [finding.to_dict() for finding in self.findings], "facts": asdict(self.facts)}


def run_doctor(runs_dir: str | os.PathLike = "runs", trial_build: bool = True, build_timeout_seconds: float = 900) -> DoctorReport:
    """Examine this machine.

    Args:
        runs_dir: where run directories will be written (its free space is checked).
        trial_build: build DeepSpeed's CPU Adam in a child process (about a minute the first time).
        build_timeout_seconds: give up on the trial build after this long.
    """
    facts = gather_facts(runs_dir, trial_build=trial_build, build_timeout_seconds=build_timeout_seconds)
    return DoctorReport(examine(facts), facts)
