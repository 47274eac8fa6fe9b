"""The agents' section of the sidecar's settings (`agents:`): the listeners, their
authentication, and the bounds on agents and series."""

from __future__ import annotations

import dataclasses
import os

from allocator_ext.protocol.service import DEFAULT_MAX_MESSAGE_BYTES
from exporter.shared.config import (
    ConfigError,
    FileMode,
    Port,
    Section,
    check_tls_files,
    read_token,
    setting,
    shown,
)

DEFAULT_UNIX_SOCKET = "/run/allocwatch/agent.sock"


@dataclasses.dataclass(frozen=True)
class AgentsConfig(Section):
    # Unix socket in a directory shared by the training and sidecar containers; "" disables it.
    unix_socket: str = DEFAULT_UNIX_SOCKET
    # Owner and group (the pod's fsGroup) may connect; nobody else. The socket's directory,
    # which the sidecar makes its own (writable by it alone), gives search to the same users.
    socket_mode: FileMode = 0o660
    # The users whose processes may connect to the Unix socket, checked on each connection
    # (SO_PEERCRED); empty: any user the socket's mode admits.
    allowed_uids: tuple[int, ...] = setting((), parse=lambda value, path: _uids(value, path))
    # TCP listener for agents; off unless a port is given. Loopback unless configured otherwise.
    tcp_port: Port | None = None
    tcp_address: str = "127.0.0.1"
    # TLS for the TCP listener (the Unix socket is local and guarded by its mode): PEM files.
    # With tls_client_ca_file, agents must present a certificate signed by that CA (mutual TLS).
    tls_cert_file: str = ""
    tls_key_file: str = ""
    tls_client_ca_file: str = ""
    # On TCP (which any local user reaches, loopback included), agents present this bearer
    # token, unless mutual TLS identifies them. A token file that does not exist is created at
    # start with a fresh token, readable as the socket is (put it on the directory shared with
    # the training container); token_env names an environment variable holding it instead.
    token_file: str = ""
    token_env: str = ""
    # Above 64 MiB a message is no report; gRPC itself takes no more than 2 GiB.
    max_message_bytes: int = setting(DEFAULT_MAX_MESSAGE_BYTES, minimum=1024, maximum=64 << 20)
    # From a connection's accept to its agent's accepted hello: a connection that carries none
    # by then (silent, the HTTP/2 preface alone, refused streams) is closed.
    hello_timeout_seconds: float = setting(10.0, positive=True, maximum=3600)
    # Connections to the agents' listeners at once: one more closes the oldest that carries no
    # agent yet, else it is refused. Each costs three descriptors (exporter.agents.front); the
    # sidecar takes fewer where its file limit would not hold them.
    max_connections: int = setting(1100, positive=True, maximum=65536)
    # A disconnected agent's series stay this long, then disappear from /metrics.
    expiry_seconds: float = setting(60.0, positive=True, maximum=7 * 86400, reload=True)
    max_agents: int = setting(1024, positive=True, maximum=65536, reload=True)
    # Departed agents kept until their expiry; past this many, the oldest go first.
    max_departed_agents: int = setting(256, minimum=0, maximum=65536, reload=True)
    # The series all agents may show in /metrics (SERIES_PER_DEVICE a device, counted from the
    # metric table): past it, departed agents' series go first, then new agents are refused.
    max_series: int = setting(50_000, positive=True, maximum=10_000_000, reload=True)

    def validate(self, path: str) -> None:
        if self.allowed_uids and not self.unix_socket:
            raise ConfigError(f"{path}.allowed_uids: applies to the Unix socket, which is off")
        if not self.unix_socket and self.tcp_port is None:
            raise ConfigError(f"{path}: no listener: set {path}.unix_socket or {path}.tcp_port "
                              "(or both)")
        check_tls_files(self, path)
        if self.token_file and self.token_env:
            raise ConfigError(f"{path}: give token_file or token_env, not both")
        if self.tcp_port is None:
            return
        if not (self.token_file or self.token_env or self.tls_client_ca_file):
            raise ConfigError(
                f"{path}.tcp_port: agents on TCP must authenticate: set {path}.token_file (a "
                "file on the directory shared with the training container, created if absent) "
                f"or {path}.tls_client_ca_file (mutual TLS)")
        if self.token_env or os.path.exists(self.token_file):
            read_token(self, path)  # refuse now, not at the first hello


MAX_ALLOWED_UIDS = 64


def _uids(value: object, path: str) -> tuple[int, ...]:
    if not isinstance(value, list) or len(value) > MAX_ALLOWED_UIDS or not all(
            isinstance(uid, int) and not isinstance(uid, bool) and 0 <= uid < 2**32 - 1
            for uid in value):
        raise ConfigError(f"{path}: expected a list of at most {MAX_ALLOWED_UIDS} user ids "
                          f"(integers from 0 to {2**32 - 2}), got {shown(value)}")
    return tuple(value)
