"""The sidecar's YAML settings: `SidecarConfig` and its sections, with defaults.

Built by exporter.shared.config's `Section.parse`: unknown fields are errors and every error
names the field's dotted path. The agents', admin and policy sections live beside the code they
configure (exporter.agents.config, exporter.admin.config, exporter.policy.config); every section
and field is listed in docs/sidecar.md.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from exporter.admin.config import AdminConfig
from exporter.agents.config import AgentsConfig
from exporter.policy.config import PolicyConfig
from exporter.shared.bounded_http import HttpLimits
from exporter.shared.config import (
    ConfigError,
    Port,
    Section,
    check_tls_files,
    parse_yaml,
    read_settings_file,
    read_token,
    setting,
    shown,
)
from exporter.shared.logs import LOG_FORMATS


@dataclasses.dataclass(frozen=True)
class MetricsConfig(Section):
    # Prometheus and the kubelet reach the endpoint from outside the pod: all interfaces.
    address: str = "0.0.0.0"
    # 9471: clear of dcgm-exporter (9400) and OpenTelemetry's Prometheus exporter (9464), which
    # share GPU nodes with training pods (docs/deploy.md#the-metrics-port).
    port: Port = 9471
    # Connections, deadlines and sizes (exporter.shared.bounded_http); a GET has no body.
    limits: HttpLimits = setting(default_factory=lambda: HttpLimits(max_body_bytes=0))
    # Who may scrape, off by default: with a token, /metrics and / ask for
    # `Authorization: Bearer TOKEN` (a PodMonitor's `authorization`); /healthz and /readyz stay
    # open to the kubelet's probes. A rotated Secret behind the file takes effect at the next
    # scrape.
    token_file: str = ""
    token_env: str = ""
    # HTTPS (a PodMonitor's `scheme: https` and `tlsConfig`): PEM files, renewed ones served
    # from the next handshake; with tls_client_ca_file, scrapers present a certificate signed
    # by that CA.
    tls_cert_file: str = ""
    tls_key_file: str = ""
    tls_client_ca_file: str = ""
    # Where the exposition is served (--web.telemetry-path); /healthz, /readyz and / stay.
    path: str = setting("/metrics", parse=lambda value, where: telemetry_path(value, where))

    def validate(self, path: str) -> None:
        check_tls_files(self, path)
        if self.token_file and self.token_env:
            raise ConfigError(f"{path}: give token_file or token_env, not both")
        if self.token_file or self.token_env:
            read_token(self, path)  # refuse now, not at the first scrape


@dataclasses.dataclass(frozen=True)
class NvmlConfig(Section):
    enabled: bool = True
    # NVML figures are cached this long, so that scrapes stay cheap.
    cache_seconds: float = setting(1.0, minimum=0, maximum=3600)


@dataclasses.dataclass(frozen=True)
class LoggingConfig(Section):
    level: str = setting("info", choices=("debug", "info", "warning", "error"), reload=True)
    # auto: logfmt on a terminal, JSON elsewhere (exporter.shared.logs).
    format: str = setting("auto", choices=LOG_FORMATS)


@dataclasses.dataclass(frozen=True)
class ReloadConfig(Section):
    """Watching the file given with --config (exporter.sidecar.reload)."""

    enabled: bool = True
    interval_seconds: float = setting(5.0, positive=True, maximum=86400, reload=True)


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


RESERVED_PATHS = ("/", "/healthz", "/readyz")


def telemetry_path(value: Any, where: str) -> str:
    """The exposition's path: absolute, one of its own; ConfigError naming `where`."""
    if not isinstance(value, str) or not value.startswith("/") or any(
            c.isspace() or c in "?#" for c in value):
        raise ConfigError(f"{where}: expected a path such as /metrics, not {shown(value)}")
    if value in RESERVED_PATHS:
        raise ConfigError(f"{where}: {value} is the sidecar's own ({', '.join(RESERVED_PATHS)} "
                          "are the landing page and the probes)")
    return value


@dataclasses.dataclass(frozen=True)
class Flags:
    """What `allocwatch sidecar`'s command line sets over the settings file, as other
    exporters' flags do: the metrics listener's address and path, the logs' format and level.
    Applied to the file's settings at start and to each reload of them, so that a reload never
    undoes a flag (nor reports a flag's listener as a change that needs a restart)."""

    listen_address: tuple[str, int] | None = None
    telemetry_path: str | None = None
    log_format: str | None = None
    log_level: str | None = None

    def apply(self, config: SidecarConfig) -> SidecarConfig:
        metrics, log = config.metrics, config.logging
        if self.listen_address is not None:
            host, port = self.listen_address
            metrics = dataclasses.replace(metrics, address=host, port=port)
        if self.telemetry_path is not None:
            metrics = dataclasses.replace(metrics, path=self.telemetry_path)
        if self.log_format is not None:
            log = dataclasses.replace(log, format=self.log_format)
        if self.log_level is not None:
            log = dataclasses.replace(log, level=self.log_level)
        return dataclasses.replace(config, metrics=metrics, logging=log)


def parse_config(raw: Any) -> SidecarConfig:
    """Validated settings from parsed YAML (None or an empty document: all defaults)."""
    return SidecarConfig.parse(raw)


def config_from_bytes(data: bytes) -> SidecarConfig:
    """Validated settings from a settings file's bytes (at most exporter.shared.config's
    MAX_FILE_BYTES); ConfigError for anything that cannot be used, memory exhausted included."""
    try:
        return parse_config(parse_yaml(data))
    except MemoryError:
        pass  # raised below, once the handler has let go of what was built
    raise ConfigError("the settings exhausted the memory")


def load_config(path: str | Path | None) -> SidecarConfig:
    """Settings from a YAML file; defaults when path is None."""
    if path is None:
        return parse_config(None)
    data = read_settings_file(path)
    try:
        return config_from_bytes(data)
    except ConfigError as err:
        raise ConfigError(f"{path}: {err}") from None
