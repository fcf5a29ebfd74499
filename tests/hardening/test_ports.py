"""A local world's rendezvous port is drawn below the kernel's ephemeral range, where no outgoing
connection (gloo's own pair connections among them) can take it before rank 0 binds it: a suite run
lost a test to EADDRINUSE at TCPStore creation with a port from bind(0)."""

import socket

import pytest

from hybridpar.ports import _ephemeral_floor
from hybridpar.train.launch import free_port


def test_rendezvous_ports_are_outside_the_ephemeral_range():
    floor = _ephemeral_floor()
    if floor <= 20100:
        pytest.skip(f"ephemeral range starts at {floor}: no room below it")
    ports = [free_port() for _ in range(20)]
    assert all(p < floor for p in ports), ports
    with socket.socket() as s:  # and it binds
        s.bind(("127.0.0.1", ports[0]))
