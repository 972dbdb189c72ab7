"""Evidence of the kernel's OOM killer, where the machine lets us read it.

A rank killed with SIGKILL was killed by the OOM killer only sometimes: a user's ``kill -9``,
a job scheduler's hard limit or a container runtime send it too. Two records tell them
apart: the cgroup's count of OOM kills (cgroup v2 ``memory.events``, v1 ``memory.oom_control``)
and the kernel log (``/dev/kmsg``), which names the pid it killed. Either may be unreadable
(permissions, containers); then the diagnosis falls back on how close host RAM came to full.
"""

from __future__ import annotations

import errno
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
KERNEL_LOG = "/dev/kmsg"
KILLED = [re.compile(r"Killed process (\d+)"), re.compile(r"oom-kill:.*\bpid=(\d+)")]
MAX_KERNEL_RECORDS = 200_000


@dataclass
class OomEvidence:
    """What the supervisor could learn about OOM kills during the run."""

    killed_pids: set[int] | None = None  # pids the kernel log says the OOM killer killed; None: log unreadable
    cgroup_kills: int | None = None  # OOM kills in our cgroup during the run; None: unreadable
    memory_limit_bytes: int | None = None  # the cgroup's memory limit when lower than the host's RAM
    sources: list[str] = field(default_factory=list)

    def verdict(self, pid: int) -> bool | None:
        """True: an OOM kill (of this pid, or in our cgroup); False: the records show none; None: no record readable."""
        if self.killed_pids is not None and pid in self.killed_pids:
            return True
        if self.cgroup_kills:
            return True
        if self.killed_pids is not None or self.cgroup_kills is not None:
            return False
        return None


def memory_cgroup() -> tuple[Path, str] | None:
    """(directory, version) of this process's memory cgroup, when mounted where we can read it."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            directory = CGROUP_ROOT / "memory" / path.lstrip("/")
            if directory.is_dir():
                return directory, "v1"
    for line in lines:
        if line.startswith("0::"):
            directory = CGROUP_ROOT / line[3:].lstrip("/")
            if (directory / "memory.events").is_file():
                return directory, "v2"
    return None


def cgroup_oom_kills() -> int | None:
    """How many processes of our cgroup the OOM killer has killed so far (None when unreadable)."""
    found = memory_cgroup()
    if found is None:
        return None
    directory, version = found
    name = "memory.events" if version == "v2" else "memory.oom_control"
    try:
        for line in (directory / name).read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
    except (OSError, ValueError):
        return None
    return None


def cgroup_memory_limit() -> int | None:
    """The cgroup's memory limit in bytes, or None when there is none (or it cannot be read)."""
    found = memory_cgroup()
    if found is None:
        return None
    directory, version = found
    try:
        text = (directory / ("memory.max" if version == "v2" else "memory.limit_in_bytes")).read_text().strip()
    except OSError:
        return None
    if not text.isdigit() or int(text) >= 2**62:
        return None  # "max", or v1's page-rounded 2^63
    return int(text)


def kernel_oom_killed_pids() -> set[int] | None:
    """Pids the kernel log records as killed by the OOM killer (None when the log is unreadable)."""
    try:
        fd = os.open(KERNEL_LOG, os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return None
    pids: set[int] = set()
    try:
        for _ in range(MAX_KERNEL_RECORDS):
            try:
                record = os.read(fd, 16384).decode(errors="replace")
            except BlockingIOError:
                break  # read to the end
            except OSError as err:
                if err.errno == errno.EPIPE:
                    continue  # a record overwritten while we read: skip it
                return None
            if not record:
                break
            for pattern in KILLED:
                match = pattern.search(record)
                if match:
                    pids.add(int(match.group(1)))
    finally:
        os.close(fd)
    return pids


def gather(cgroup_kills_at_start: int | None, host_ram_total_bytes: int) -> OomEvidence:
    """What the records say now, for a run that began with ``cgroup_kills_at_start`` OOM kills."""
    evidence = OomEvidence()
    evidence.killed_pids = kernel_oom_killed_pids()
    if evidence.killed_pids is not None:
        evidence.sources.append("the kernel log")
    now = cgroup_oom_kills()
    if now is not None and cgroup_kills_at_start is not None:
        evidence.cgroup_kills = now - cgroup_kills_at_start
        evidence.sources.append("the cgroup's OOM-kill count")
    limit = cgroup_memory_limit()
    if limit is not None and limit < host_ram_total_bytes:
        evidence.memory_limit_bytes = limit
    return evidence
