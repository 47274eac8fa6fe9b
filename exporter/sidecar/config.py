"""The sidecar's YAML settings: `SidecarConfig` and its sections, with defaults.

Built by exporter.config's `Section.parse`: unknown fields are errors and every error names the
field's dotted path. The admin and policy sections live beside the code they configure
(exporter.admin.config, exporter.policy.config); every section and field is listed in
docs/sidecar.md.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import yaml

from exporter.admin.config import AdminConfig
from exporter.config import ConfigError, FileMode, Port, Section, check_tls_files, setting
from exporter.policy.config import PolicyConfig
from exporter.protocol.service import DEFAULT_MAX_MESSAGE_BYTES

DEFAULT_UNIX_SOCKET = "/run/allocwatch/agent.sock"


@dataclasses.dataclass(frozen=True)
class AgentsConfig(Section):
    # Unix socket in a directory shared by the training and sidecar containers; "" disables it.
    unix_socket: str = DEFAULT_UNIX_SOCKET
    # Owner and group (the pod's fsGroup) may connect; nobody else.
    socket_mode: FileMode = 0o660
    # TCP listener for agents; off unless a port is given. Loopback unless configured otherwise.
    tcp_port: Port | None = None
    tcp_address: str = "127.0.0.1"
    # TLS for the TCP listener (the Unix socket is local and guarded by its mode): PEM files.
    # With tls_client_ca_file, agents must present a certificate signed by that CA (mutual TLS).
    tls_cert_file: str = ""
    tls_key_file: str = ""
    tls_client_ca_file: str = ""
    max_message_bytes: int = setting(DEFAULT_MAX_MESSAGE_BYTES, positive=True)
    hello_timeout_seconds: float = setting(10.0, positive=True)
    # A disconnected agent's series stay this long, then disappear from /metrics.
    expiry_seconds: float = setting(60.0, positive=True, reload=True)
    max_agents: int = setting(1024, positive=True, reload=True)

    def validate(self, path: str) -> None:
        if not self.unix_socket and self.tcp_port is None:
            raise ConfigError(f"{path}: no listener: set {path}.unix_socket or {path}.tcp_port "
                              "(or both)")
        check_tls_files(self, path)


@dataclasses.dataclass(frozen=True)
class MetricsConfig(Section):
    # Prometheus and the kubelet reach the endpoint from outside the pod: all interfaces.
    address: str = "0.0.0.0"
    # 9471: clear of dcgm-exporter (9400) and OpenTelemetry's Prometheus exporter (9464), which
    # share GPU nodes with training pods (docs/deploy.md#the-metrics-port).
    port: Port = 9471


@dataclasses.dataclass(frozen=True)
class NvmlConfig(Section):
    enabled: bool = True
    # NVML figures are cached this long, so that scrapes stay cheap.
    cache_seconds: float = 1.0


@dataclasses.dataclass(frozen=True)
class LoggingConfig(Section):
    level: str = setting("info", choices=("debug", "info", "warning", "error"), reload=True)
    format: str = setting("json", choices=("json", "text"))


@dataclasses.dataclass(frozen=True)
class ReloadConfig(Section):
    """Watching the file given with --config (exporter.sidecar.reload)."""

    enabled: bool = True
    interval_seconds: float = setting(5.0, positive=True, reload=True)


@dataclasses.dataclass(frozen=True)
class SidecarConfig(Section):
    agents: AgentsConfig = setting(default_factory=AgentsConfig)
    metrics: MetricsConfig = setting(default_factory=MetricsConfig)
    nvml: NvmlConfig = setting(default_factory=NvmlConfig)
    logging: LoggingConfig = setting(default_factory=LoggingConfig)
    # The rules are applied whole: a reload installs the new ones.
    policy: PolicyConfig = setting(default_factory=PolicyConfig, reload=True)
    admin: AdminConfig = setting(default_factory=AdminConfig)
    reload: ReloadConfig = setting(default_factory=ReloadConfig)


def parse_config(raw: Any) -> SidecarConfig:
    """Validated settings from parsed YAML (None or an empty document: all defaults)."""
    return SidecarConfig.parse(raw)


def load_config(path: str | Path | None) -> SidecarConfig:
    """Settings from a YAML file; defaults when path is None."""
    if path is None:
        return parse_config(None)
    try:
        text = Path(path).read_text()
    except OSError as err:
        raise ConfigError(f"cannot read settings file {path}: {err.strerror}") from None
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML: {err}") from None
    try:
        return parse_config(raw)
    except ConfigError as err:
        raise ConfigError(f"{path}: {err}") from None
