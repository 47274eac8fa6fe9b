"""How many agents' connections the sidecar's file limit holds.

Each connection to the agents' listeners costs three descriptors (the front's two ends, the gRPC
server's own: exporter.agents.front); the HTTP listeners' connections one each, up to their
limits; RESERVED are kept for everything else (listeners, gRPC's own, the settings and token
files, NVML, logs). The agents' share is what remains, so that no crowd of connections, of any
listener, can run the process out of descriptors.
"""

from __future__ import annotations

import logging
import resource

log = logging.getLogger("exporter.sidecar")

PER_AGENT_CONNECTION = 3
RESERVED = 64


def agent_connections(wanted: int, *http_limits: int) -> int:
    """`wanted`, or fewer where the soft file limit would not hold them beside `http_limits`
    (logged); at least 1."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return wanted
    room = max(1, (soft - RESERVED - sum(http_limits)) // PER_AGENT_CONNECTION)
    if room < wanted:
        log.warning("the file limit holds fewer agents' connections than "
                    "agents.max_connections", extra={
                        "file_limit": soft, "agents_max_connections": wanted,
                        "held": room, "hint": "raise the limit (ulimit -n, LimitNOFILE)"})
        return room
    return wanted
