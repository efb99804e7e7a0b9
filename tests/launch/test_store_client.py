"""megadyn/launch/store_client.py against a real coordinator killed and started again on its
port: calls that must not wait fail at once while it is down, a call that waits gets through
once it is back, the owner's publishers run once per return, and a write that the dead server
swallowed is made again on the new one."""

import sys
import threading
import time
from datetime import timedelta
from subprocess import PIPE, Popen

import pytest
import torch.distributed as dist

from megadyn.launch.store_client import CoordinatorDown, ReconnectingStore
from megadyn.testing import free_port


def test_a_client_reconnects_to_a_restarted_coordinator():
    port = free_port()
    cmd = [sys.executable, "-m", "megadyn.launch.coordinator", "--host", "127.0.0.1"]

    def start():
        proc = Popen([*cmd, "--port", str(port)], stdout=PIPE, text=True)
        assert "serving on" in proc.stdout.readline()
        return proc

    servers = [start()]
    try:
        timeout = timedelta(seconds=20)
        fast = ReconnectingStore("127.0.0.1", port, timeout, wait_s=0)
        patient = ReconnectingStore("127.0.0.1", port, timeout)
        published = []
        fast.on_reconnect.append(lambda: published.append(fast.set("mine", "again")))
        beats = dist.PrefixStore("heartbeat", fast)  # C++ calls the Python methods
        beats.set("0", "1")
        patient.set("k", "v")
        servers[0].kill()
        servers[0].wait()
        began = time.monotonic()
        for _ in range(3):
            with pytest.raises(CoordinatorDown):
                beats.set("0", "2")
        assert time.monotonic() - began < 2 and published == []
        threading.Timer(1.0, lambda: servers.append(start())).start()
        patient.set("k", "v2")  # waits for the new coordinator; the first write is redone
        assert patient.get("k") == b"v2" and patient.reconnects == 1
        time.sleep(0.6)  # the fast client looks again at most every half second
        beats.set("0", "3")
        assert beats.get("0") == b"3" and fast.get("mine") == b"again"
        assert published == [None] and fast.reconnects == 1 and fast.down_since is None
    finally:
        for server in servers:
            server.kill()
