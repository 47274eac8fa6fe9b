"""The `admin:` section of the sidecar's YAML, and the bearer token it names.

    admin:
      unix_socket: /run/allocwatch/admin.sock   # default: admin.sock beside agents.unix_socket
      socket_mode: "0600"
      tcp_port: 9465                 # off by default; needs a token
      tcp_address: 127.0.0.1
      token_file: /var/run/secrets/allocwatch/token   # or token_env: ALLOCWATCH_ADMIN_TOKEN
      tls_cert_file: /etc/allocwatch/tls/tls.crt      # HTTPS on the TCP port (optional)
      tls_key_file: /etc/allocwatch/tls/tls.key
      tls_client_ca_file: /etc/allocwatch/tls/ca.crt # and client certificates (optional)
      snapshot_dir: /run/allocwatch/snapshots        # default: snapshots/ beside the socket

The token itself never enters the settings object (only where to read it), so printing or
logging the settings cannot leak it.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from exporter.admin.tls import server_tls_context
from exporter.shared.bounded_http import HttpLimits
from exporter.shared.config import (
    ConfigError,
    FileMode,
    Port,
    Section,
    check_tls_files,
    setting,
    shown,
)
from exporter.shared.config import read_token as read_secret


@dataclasses.dataclass(frozen=True)
class AdminConfig(Section):
    enabled: bool = True
    # None: admin.sock in the agents' socket directory; "": no Unix socket.
    unix_socket: str | None = None
    # Only the sidecar's user (kubectl exec into the sidecar container runs as it).
    socket_mode: FileMode = 0o600
    # TCP only with a token; loopback unless configured otherwise.
    tcp_port: Port | None = None
    tcp_address: str = "127.0.0.1"
    # A reload brings a new token without a restart; so does a rotated Secret behind the same
    # file (exporter.shared.tokens reads it again when it changes).
    token_file: str = setting("", reload=True)
    token_env: str = setting("", reload=True)
    # HTTPS on the TCP port: the token then never crosses the network in clear. With
    # tls_client_ca_file, clients must also present a certificate signed by that CA.
    tls_cert_file: str = ""
    tls_key_file: str = ""
    tls_client_ca_file: str = ""
    command_timeout_seconds: float = setting(30.0, positive=True, maximum=3600, reload=True)
    # Connections, deadlines and sizes of both listeners (exporter.shared.bounded_http). A
    # request's deadline covers waiting for the agents: it must exceed command_timeout_seconds.
    limits: HttpLimits = setting(default_factory=lambda: HttpLimits(
        max_connections=32, request_timeout_seconds=60.0))
    # Where agents write snapshots, and the only place GET /v1/snapshots/NAME reads from.
    # None: snapshots/ beside agents.unix_socket (the agents' default); "": none served.
    snapshot_dir: str | None = None

    def socket_path(self, agents_socket: str) -> str:
        return self._beside(self.unix_socket, agents_socket, "admin.sock")

    def snapshot_path(self, agents_socket: str) -> str:
        return self._beside(self.snapshot_dir, agents_socket, "snapshots")

    @staticmethod
    def _beside(given: str | None, agents_socket: str, name: str) -> str:
        if given is not None:
            return given
        return str(Path(agents_socket).parent / name) if agents_socket else ""

    def validate(self, path: str) -> None:
        if self.socket_mode & 0o007:
            raise ConfigError(f"{path}.socket_mode: {oct(self.socket_mode)} lets every user of "
                              "the machine steer training; use 0600 or 0660")
        if self.limits.request_timeout_seconds <= self.command_timeout_seconds:
            raise ConfigError(f"{path}.limits.request_timeout_seconds: "
                              f"{shown(self.limits.request_timeout_seconds)} must exceed "
                              f"{path}.command_timeout_seconds "
                              f"({shown(self.command_timeout_seconds)}): a command request "
                              "waits that long for the agents")
        if self.token_file and self.token_env:
            raise ConfigError(f"{path}: give token_file or token_env, not both")
        if self.enabled and self.tcp_port is not None:
            if not (self.token_file or self.token_env):
                raise ConfigError(f"{path}.tcp_port: the admin API listens on TCP only with a "
                                  "bearer token: set admin.token_file (e.g. a mounted Secret) "
                                  "or admin.token_env")
            read_token(self)  # refuse now, not at the first request
        check_tls_files(self, path)
        if self.tls_cert_file and self.tcp_port is None:
            raise ConfigError(f"{path}.tls_cert_file: TLS applies to the TCP listener; set "
                              f"{path}.tcp_port too")
        if self.tls_cert_file:
            try:
                server_tls_context(self.tls_cert_file, self.tls_key_file, self.tls_client_ca_file)
            except (OSError, ValueError) as err:  # ssl.SSLError is an OSError
                raise ConfigError(f"{path}.tls_cert_file / tls_key_file: not a usable "
                                  f"certificate and key: {err}") from None


def read_token(config: AdminConfig) -> bytes | None:
    """The configured token (file first, then environment), stripped; None if none configured.
    ConfigError when configured but unreadable, empty, or too short to resist guessing."""
    return read_secret(config, "admin")
