"""A TCP port for a server that must be told its port in advance (a sidecar process, a
Prometheus server)."""

from __future__ import annotations

import socket


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
