"""The sidecar's YAML settings: dataclasses with defaults, and validation that names the field.

Every section and field is listed in docs/sidecar.md. Unknown fields are errors (a typo must not
silently fall back to a default), and every error names the field's dotted path.
"""

from __future__ import annotations

import dataclasses
import os
import types
import typing
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import yaml

DEFAULT_UNIX_SOCKET = "/run/allocwatch/agent.sock"


class ConfigError(ValueError):
    """A settings file that cannot be used; the message names the field."""


@dataclasses.dataclass(frozen=True)
class AgentsConfig:
    # Unix socket in a directory shared by the training and sidecar containers; "" disables it.
    unix_socket: str = DEFAULT_UNIX_SOCKET
    # Owner and group (the pod's fsGroup) may connect; nobody else.
    socket_mode: int = 0o660
    # TCP listener for agents; off unless a port is given. Loopback unless configured otherwise.
    tcp_port: int | None = None
    tcp_address: str = "127.0.0.1"
    # TLS for the TCP listener (the Unix socket is local and guarded by its mode): PEM files.
    # With tls_client_ca_file, agents must present a certificate signed by that CA (mutual TLS).
    tls_cert_file: str = ""
    tls_key_file: str = ""
    tls_client_ca_file: str = ""
    max_message_bytes: int = 1 << 20
    hello_timeout_seconds: float = 10.0
    # A disconnected agent's series stay this long, then disappear from /metrics.
    expiry_seconds: float = 60.0
    max_agents: int = 1024


@dataclasses.dataclass(frozen=True)
class MetricsConfig:
    # Prometheus and the kubelet reach the endpoint from outside the pod: all interfaces.
    address: str = "0.0.0.0"
    port: int = 9464


@dataclasses.dataclass(frozen=True)
class NvmlConfig:
    enabled: bool = True
    # NVML figures are cached this long, so that scrapes stay cheap.
    cache_seconds: float = 1.0


@dataclasses.dataclass(frozen=True)
class LoggingConfig:
    level: str = "info"
    format: str = "json"


@dataclasses.dataclass(frozen=True)
class SidecarConfig:
    agents: AgentsConfig = dataclasses.field(default_factory=AgentsConfig)
    metrics: MetricsConfig = dataclasses.field(default_factory=MetricsConfig)
    nvml: NvmlConfig = dataclasses.field(default_factory=NvmlConfig)
    logging: LoggingConfig = dataclasses.field(default_factory=LoggingConfig)
    # Sections added by other parts of the sidecar (policy, admin: issue 5), parsed by the
    # parsers registered in EXTRA_SECTIONS.
    extra: Mapping[str, Any] = dataclasses.field(default_factory=dict)


# name -> parser(raw_value, path) returning the parsed section; raise ConfigError on bad input.
EXTRA_SECTIONS: dict[str, Callable[[Any, str], Any]] = {}

_CHOICES: dict[str, tuple[str, ...]] = {
    "logging.level": ("debug", "info", "warning", "error"),
    "logging.format": ("json", "text"),
}

_POSITIVE = {
    "agents.max_message_bytes",
    "agents.hello_timeout_seconds",
    "agents.expiry_seconds",
    "agents.max_agents",
}
_PORTS = {"agents.tcp_port", "metrics.port"}


def _type_name(value: Any) -> str:
    return type(value).__name__


def _convert(value: Any, hint: Any, path: str) -> Any:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if value is None:
            return None
        return _convert(value, args[0], path)
    if hint is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{path}: expected true or false, got {value!r}")
    if hint is int:
        if path == "agents.socket_mode" and isinstance(value, str):
            try:
                return int(value, 8)
            except ValueError:
                raise ConfigError(
                    f"{path}: expected an octal mode like '0660', got {value!r}") from None
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{path}: expected an integer, got {_type_name(value)} {value!r}")
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{path}: expected a number, got {_type_name(value)} {value!r}")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise ConfigError(f"{path}: expected a string, got {_type_name(value)} {value!r}")
        return value
    if dataclasses.is_dataclass(hint):
        return _build(hint, value, path)
    raise ConfigError(f"{path}: unsupported setting type {hint!r}")  # a bug in this module


def _check_value(path: str, value: Any) -> None:
    if path in _CHOICES and value not in _CHOICES[path]:
        raise ConfigError(f"{path}: must be one of {', '.join(_CHOICES[path])}; got {value!r}")
    if path in _POSITIVE and value <= 0:
        raise ConfigError(f"{path}: must be greater than 0, got {value!r}")
    if path in _PORTS and value is not None and not 0 <= value <= 65535:
        raise ConfigError(
            f"{path}: must be a port number 0-65535 (0: any free port), got {value!r}")
    if path == "agents.socket_mode" and not 0 <= value <= 0o777:
        raise ConfigError(f"{path}: must be a file mode between 0000 and 0777, got {oct(value)}")


def _build(cls: Any, raw: Any, path: str) -> Any:
    if raw is None:
        raw = {}
    if not isinstance(raw, Mapping):
        where = path or "the settings file"
        raise ConfigError(f"{where}: expected a mapping of settings, got {_type_name(raw)} {raw!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name for f in dataclasses.fields(cls) if f.name != "extra"}
    values: dict[str, Any] = {}
    extra: dict[str, Any] = {}
    for key, value in raw.items():
        field_path = f"{path}.{key}" if path else str(key)
        if key in fields:
            converted = _convert(value, hints[key], field_path)
            if not dataclasses.is_dataclass(hints[key]):
                _check_value(field_path, converted)
            values[key] = converted
        elif not path and key in EXTRA_SECTIONS:
            extra[key] = EXTRA_SECTIONS[key](value, field_path)
        else:
            known = sorted(fields | (set(EXTRA_SECTIONS) if not path else set()))
            raise ConfigError(f"{field_path}: unknown setting (known here: {', '.join(known)})")
    if cls is SidecarConfig:
        # A section absent from the file gets its parser's defaults (admin API on by default).
        for name, parser in EXTRA_SECTIONS.items():
            if name not in extra:
                extra[name] = parser(None, name)
        values["extra"] = extra
    return cls(**values)


def parse_config(raw: Any) -> SidecarConfig:
    """Validated settings from parsed YAML (None or an empty document: all defaults)."""
    import exporter.sections  # noqa: F401  (registers policy, admin, reload; no import cycle)

    config: SidecarConfig = _build(SidecarConfig, raw, "")
    if not config.agents.unix_socket and config.agents.tcp_port is None:
        raise ConfigError(
            "agents: no listener: set agents.unix_socket or agents.tcp_port (or both)"
        )
    check_tls_files(config.agents, "agents")
    return config


def check_tls_files(section: Any, path: str) -> None:
    """The tls_cert_file / tls_key_file / tls_client_ca_file fields of a TCP listener's
    section (agents, admin): both or neither, a client CA only with them, every file readable."""
    if bool(section.tls_cert_file) != bool(section.tls_key_file):
        raise ConfigError(f"{path}.tls_cert_file and {path}.tls_key_file: give both or neither")
    if section.tls_client_ca_file and not section.tls_cert_file:
        raise ConfigError(f"{path}.tls_client_ca_file: needs {path}.tls_cert_file and "
                          f"{path}.tls_key_file (the server's own certificate)")
    for name in ("tls_cert_file", "tls_key_file", "tls_client_ca_file"):
        file = getattr(section, name)
        if file and not os.access(file, os.R_OK):
            raise ConfigError(f"{path}.{name}: cannot read {file}")


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
