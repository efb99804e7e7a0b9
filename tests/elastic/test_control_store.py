"""The control store never becomes a client of another store, and test ports stay out of the
kernel's ephemeral range (where torchrun's store port comes from)."""

import socket
from datetime import timedelta

import pytest
import torch.distributed as dist

from megadyn.elastic.control.channel import connect
from megadyn.testing.spawn import _ephemeral_low, free_port


def test_the_control_store_refuses_torchruns_store_port():
    port = free_port()
    torchruns = dist.TCPStore(
        "127.0.0.1", port, None, True, timedelta(seconds=5), wait_for_workers=False
    )
    torchruns.set("decision/10", '{"epoch": 1}')  # what an earlier attempt decided
    # torch's TCPStore would go on as a client here and read the earlier attempt's keys
    with pytest.raises(RuntimeError, match=f"--elastic-control-port {port} is torchrun's store"):
        connect("127.0.0.1", port, is_server=True, timeout_s=5, launcher_port=port)
    busy = socket.socket()
    busy.bind(("0.0.0.0", free_port()))
    busy.listen()
    with busy, pytest.raises(dist.DistNetworkError, match="address already in use"):
        connect("127.0.0.1", busy.getsockname()[1], is_server=True, timeout_s=5)
    fresh = connect("127.0.0.1", free_port(), is_server=True, timeout_s=5)
    assert not fresh.check(["decision/10"])


def test_free_ports_are_distinct_and_below_the_ephemeral_range():
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == 50
    low = _ephemeral_low()
    if low > 11000:
        assert all(10000 <= p < low for p in ports), ports


def test_a_client_gives_up_on_a_dead_server_in_its_connect_time_and_keeps_the_long_wait():
    """After a recovery re-hosts the control store, the others reach the new host within the
    recovery's time: a host that died again costs that, not the store's 300 s."""
    import time

    port = free_port()
    start = time.monotonic()
    with pytest.raises(dist.DistNetworkError):
        connect("127.0.0.1", port, is_server=False, timeout_s=300, connect_timeout_s=2)
    assert time.monotonic() - start < 30
    server = connect("127.0.0.1", port, is_server=True, timeout_s=300)
    client = connect("127.0.0.1", port, is_server=False, timeout_s=300, connect_timeout_s=2)
    assert client.timeout == timedelta(seconds=300) and server.timeout == timedelta(seconds=300)
    server.set("decision/1", "none")
    assert client.get("decision/1") == b"none"
