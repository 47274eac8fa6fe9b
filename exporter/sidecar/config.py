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
    parse_yaml,
    read_settings_file,
    setting,
)


@dataclasses.dataclass(frozen=True)
class MetricsConfig(Section):
    # Prometheus and the kubelet reach the endpoint from outside the pod: all interfaces.
    address: str = "0.0.0.0"
    # 9471: clear of dcgm-exporter (9400) and OpenTelemetry's Prometheus exporter (9464), which
    # share GPU nodes with training pods (docs/deploy.md#the-metrics-port).
    port: Port = 9471
    # Connections, deadlines and sizes (exporter.shared.bounded_http); a GET has no body.
    limits: HttpLimits = setting(default_factory=lambda: HttpLimits(max_body_bytes=0))


@dataclasses.dataclass(frozen=True)
class NvmlConfig(Section):
    enabled: bool = True
    # NVML figures are cached this long, so that scrapes stay cheap.
    cache_seconds: float = setting(1.0, minimum=0, maximum=3600)


@dataclasses.dataclass(frozen=True)
class LoggingConfig(Section):
    level: str = setting("info", choices=("debug", "info", "warning", "error"), reload=True)
    format: str = setting("json", choices=("json", "text"))


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
