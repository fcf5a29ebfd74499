"""A free TCP port on 127.0.0.1 for a local world's rendezvous (rank 0's TCPStore).

The usual `bind(("127.0.0.1", 0))` hands out a port from the kernel's ephemeral range and frees it at
once; until rank 0 binds it, any outgoing connection may take it, and gloo's own pair connections
(this world's or another's) are exactly such connections: a suite run here lost a test to
"EADDRINUSE" at TCPStore creation. A port drawn below the ephemeral range is never handed to an
outgoing connection, so only another explicit bind can race for it.
"""

from __future__ import annotations

import random
import socket

_LOW = 20000  # the draw's floor: above the well-known and most registered service ports


def _ephemeral_floor() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A port that binds now, below the ephemeral range where the kernel says where that is; else one
    the kernel picks."""
    floor = _ephemeral_floor()
    if floor > _LOW + 100:
        rng = random.SystemRandom()
        for _ in range(64):
            port = rng.randrange(_LOW, floor)
            if _bindable(port):
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
