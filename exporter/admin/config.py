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

The token itself never enters the settings object (only where to read it), so printing or
logging the settings cannot leak it.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from exporter.admin.tls import server_tls_context
from exporter.sidecar.config import ConfigError, _build, check_tls_files

MAX_TOKEN_BYTES = 4096
MIN_TOKEN_BYTES = 16


@dataclasses.dataclass(frozen=True)
class AdminConfig:
    enabled: bool = True
    # None: admin.sock in the agents' socket directory; "": no Unix socket.
    unix_socket: str | None = None
    # Only the sidecar's user (kubectl exec into the sidecar container runs as it).
    socket_mode: int = 0o600
    # TCP only with a token; loopback unless configured otherwise.
    tcp_port: int | None = None
    tcp_address: str = "127.0.0.1"
    token_file: str = ""
    token_env: str = ""
    # HTTPS on the TCP port: the token then never crosses the network in clear. With
    # tls_client_ca_file, clients must also present a certificate signed by that CA.
    tls_cert_file: str = ""
    tls_key_file: str = ""
    tls_client_ca_file: str = ""
    command_timeout_seconds: float = 30.0

    def socket_path(self, agents_socket: str) -> str:
        if self.unix_socket is not None:
            return self.unix_socket
        return str(Path(agents_socket).parent / "admin.sock") if agents_socket else ""


def read_token(config: AdminConfig) -> bytes | None:
    """The configured token (file first, then environment), stripped; None if none configured.
    ConfigError when configured but unreadable, empty, or too short to resist guessing."""
    if config.token_file:
        try:
            raw = Path(config.token_file).read_bytes()[:MAX_TOKEN_BYTES + 1]
        except OSError as err:
            raise ConfigError(f"admin.token_file: cannot read {config.token_file}: "
                              f"{err.strerror}") from None
        where = "admin.token_file"
    elif config.token_env:
        raw = os.environb.get(config.token_env.encode(), b"")
        where = f"admin.token_env (${config.token_env})"
    else:
        return None
    token = raw.strip()
    if len(token) > MAX_TOKEN_BYTES:
        raise ConfigError(f"{where}: the token is longer than {MAX_TOKEN_BYTES} bytes")
    if len(token) < MIN_TOKEN_BYTES:
        raise ConfigError(f"{where}: the token is empty or shorter than {MIN_TOKEN_BYTES} "
                          "bytes (generate one: openssl rand -hex 32)")
    return token


def parse_admin_section(raw: Any, path: str = "admin") -> AdminConfig:
    if raw is None:
        return AdminConfig()
    if isinstance(raw, Mapping) and isinstance(raw.get("socket_mode"), str):
        raw = dict(raw)
        try:
            raw["socket_mode"] = int(raw["socket_mode"], 8)
        except ValueError:
            raise ConfigError(f"{path}.socket_mode: expected an octal mode like '0600', "
                              f"got {raw['socket_mode']!r}") from None
    config: AdminConfig = _build(AdminConfig, raw, path)
    if not 0 <= config.socket_mode <= 0o777:
        raise ConfigError(f"{path}.socket_mode: must be a file mode between 0000 and 0777")
    if config.socket_mode & 0o007:
        raise ConfigError(f"{path}.socket_mode: {oct(config.socket_mode)} lets every user of "
                          "the machine steer training; use 0600 or 0660")
    if config.tcp_port is not None and not 0 <= config.tcp_port <= 65535:
        raise ConfigError(f"{path}.tcp_port: must be a port number 0-65535, got {config.tcp_port}")
    if config.command_timeout_seconds <= 0:
        raise ConfigError(f"{path}.command_timeout_seconds: must be greater than 0")
    if config.token_file and config.token_env:
        raise ConfigError(f"{path}: give token_file or token_env, not both")
    if config.enabled and config.tcp_port is not None:
        if not (config.token_file or config.token_env):
            raise ConfigError(f"{path}.tcp_port: the admin API listens on TCP only with a bearer "
                              "token: set admin.token_file (e.g. a mounted Secret) or "
                              "admin.token_env")
        read_token(config)  # refuse now, not at the first request
    _check_tls(config, path)
    return config


def _check_tls(config: AdminConfig, path: str) -> None:
    check_tls_files(config, path)
    if config.tls_cert_file and config.tcp_port is None:
        raise ConfigError(f"{path}.tls_cert_file: TLS applies to the TCP listener; set "
                          f"{path}.tcp_port too")
    if config.tls_cert_file:
        try:
            server_tls_context(config.tls_cert_file, config.tls_key_file,
                               config.tls_client_ca_file)
        except (OSError, ValueError) as err:  # ssl.SSLError is an OSError
            raise ConfigError(f"{path}.tls_cert_file / tls_key_file: not a usable certificate "
                              f"and key: {err}") from None
