"""The engine's communication log: hybridpar.parallel.comm.log.CommLog (kind, group size, bytes,
tag). p2p transfers are logged by both ends ("send" and "recv", group size 2, tag
"<phase>:dev<peer>"), so a rank's totals are its own traffic."""

from __future__ import annotations

from hybridpar.parallel.comm.log import CommLog


def p2p_tag(phase: str, peer: int) -> str:
    return f"{phase}:dev{peer}"


__all__ = ["CommLog", "p2p_tag"]
