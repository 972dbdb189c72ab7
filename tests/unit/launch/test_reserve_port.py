"""The launcher's rendezvous port is held from the moment it is chosen: no other run can be handed it."""

from __future__ import annotations

import datetime
import socket

import pytest
from torch.distributed import TCPStore

from zeropipe.launch.supervisor import reserve_port


def test_a_reserved_port_is_never_handed_out_and_rank_0_can_still_listen_on_it():
    port, held = reserve_port()
    with held:
        # What another run's pick (bind to port 0) and a plain bind to the port get while it is held.
        picked = set()
        for _ in range(2000):
            with socket.socket() as other:
                other.bind(("127.0.0.1", 0))
                picked.add(other.getsockname()[1])
        assert port not in picked
        with socket.socket() as other, pytest.raises(OSError):
            other.bind(("127.0.0.1", port))
        # Rank 0's TCPStore (both of torch's backends) binds and serves on it all the same.
        for use_libuv in (True, False):
            store = TCPStore("127.0.0.1", port, 1, is_master=True, timeout=datetime.timedelta(seconds=30), use_libuv=use_libuv)
            store.set("rendezvous", "ok")
            assert store.get("rendezvous") == b"ok"
            del store
