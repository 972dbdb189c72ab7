"""A rank dies with its launcher: by the kernel's parent-death signal, or by its own watchdog."""

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

# A stand-in launcher: starts one "rank" that calls die_with_launcher, prints its pid, waits.
LAUNCHER = """
import os, subprocess, sys, time
env = dict(os.environ, ZEROPIPE_LAUNCHER_PID=str(os.getpid()))
rank = subprocess.Popen([sys.executable, "-c", sys.argv[1]], env=env, start_new_session=True)
print(rank.pid, flush=True)
time.sleep(60)
"""
RANK = """
import sys, time
{prelude}
from zeropipe.launch.rank import die_with_launcher
die_with_launcher()
time.sleep(60)
"""


@pytest.mark.parametrize(
    "prelude",
    [
        "",  # Linux: prctl(PR_SET_PDEATHSIG) and the watchdog
        "sys.platform = 'darwin'",  # where prctl does not exist: the watchdog alone
    ],
    ids=["prctl", "watchdog-only"],
)
def test_a_rank_dies_within_a_second_of_its_launcher(prelude):
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, RANK.format(prelude=prelude)], stdout=subprocess.PIPE, text=True, env=dict(os.environ))
    rank = int(launcher.stdout.readline())
    time.sleep(1.5)  # the rank is up and watching
    assert psutil.pid_exists(rank)
    launcher.send_signal(signal.SIGKILL)
    launcher.wait()
    deadline = time.monotonic() + 10  # generous for a loaded machine: left alone the rank sleeps a minute
    while time.monotonic() < deadline:
        try:
            if psutil.Process(rank).status() == psutil.STATUS_ZOMBIE:
                break
        except psutil.NoSuchProcess:
            break
        time.sleep(0.05)
    else:
        os.kill(rank, signal.SIGKILL)
        raise AssertionError("the rank outlived its launcher by 10 s")
