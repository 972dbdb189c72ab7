"""The data-preparation worker pool ends whatever signal handlers the launcher had installed."""

from __future__ import annotations

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import itertools, os, signal, sys
    from zeropipe.data import token_cache

    # The launcher's handlers while it prepares data: SIGTERM noted, not obeyed (the supervisor's
    # second-signal handler), and its Ctrl-C handler.
    signal.signal(signal.SIGTERM, lambda *_: None)
    signal.signal(signal.SIGINT, lambda *_: None)

    def work(batch):
        return (os.getpid(), str(signal.getsignal(signal.SIGTERM)), str(signal.getsignal(signal.SIGINT)), sum(batch))

    batches = ([i, i] for i in range(40))
    done = list(token_cache._map_batches(work, batches, 2))  # all of it: the workers leave on their own
    assert [d[3] for d in done] == [2 * i for i in range(40)], done
    assert {d[1:3] for d in done} == {(str(signal.SIG_DFL), str(signal.SIG_IGN))}, done
    stopped = token_cache._map_batches(work, ([i] for i in range(1000)), 2)
    first = list(itertools.islice(stopped, 3))
    stopped.close()  # a consumer that stops early (a failure, a Ctrl-C): the pool is terminated
    print("ended", len(first))
    """
)


def test_the_pool_ends_after_all_its_work_and_when_stopped_early_whatever_handlers_the_launcher_had():
    ended = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120)
    assert ended.returncode == 0, ended.stderr
    assert ended.stdout.strip() == "ended 3"
