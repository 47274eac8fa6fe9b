"""A TCP port for a server that must be told its port in advance (a sidecar process, a
Prometheus server): the benchmarks' sidecars and the tests' servers draw theirs here."""

from __future__ import annotations

import errno
import random
import socket
from pathlib import Path

# Ports the kernel never hands an outgoing connection: below its ephemeral range. A port taken
# from bind(("", 0)) comes from that range, where a client's connect() (a gRPC stream, a
# scrape) in another test may take it between the probe's close and the server's bind.
_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_SPAN = 10000


def _below_ephemeral() -> range:
    try:
        low = int(_RANGE_FILE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768  # Linux's default range starts here
    return range(max(1024, low - _SPAN), low)


def free_port() -> int:
    """A port no socket holds now, on any address, drawn at random below the ephemeral range."""
    ports = _below_ephemeral()
    draw = random.SystemRandom()
    for _ in range(200):
        port = draw.choice(ports)
        with socket.socket() as s:
            try:
                s.bind(("", port))  # all addresses: a server on 127.0.0.1:port conflicts too
            except OSError as e:
                if e.errno != errno.EADDRINUSE:
                    raise
                continue
            return port
    raise RuntimeError(f"no free port found in {ports.start}-{ports.stop - 1}")
