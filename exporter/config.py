"""The sidecar's settings file, section by section: typed dataclasses built from parsed YAML, with
errors that name the field.

A section is a frozen dataclass deriving from `Section`. `Section.parse(raw, path)` builds it by
its fields' types — bool, int, float, str, `X | None`, `Port`, `FileMode`, a nested section — or
by a field's own `parse` function. Unknown keys are errors (a typo must not silently fall back to
a default), every error names the field's dotted path, and each section's `validate` checks what
spans its fields. `setting(...)` gives a field its options; `reload=True` marks a field that a
reloaded file changes at once (any other change waits for a restart: listeners, ports).

Every section and field is listed in docs/sidecar.md.
"""

from __future__ import annotations

import dataclasses
import os
import types
import typing
from collections.abc import Callable, Iterable, Mapping
from typing import Annotated, Any, TypeVar

# Integers with a range of their own (still plain ints to a type checker):
Port = Annotated[int, "port"]            # 0-65535, 0 meaning any free port
FileMode = Annotated[int, "file mode"]   # 0000-0777: an octal string ("0660") or a number

S = TypeVar("S", bound="Section")


class ConfigError(ValueError):
    """A settings file that cannot be used; the message names the field."""


def setting(default: Any = dataclasses.MISSING, *, default_factory: Any = dataclasses.MISSING,
            key: str | None = None, parse: Callable[[Any, str], Any] | None = None,
            choices: Iterable[str] = (), positive: bool = False, reload: bool = False) -> Any:
    """A section's field with options: `key`, its name in the file (default: the field's);
    `parse(value, path)`, its own conversion; `choices`, the values allowed; `positive`, greater
    than 0; `reload`, applied by a reload without a restart."""
    metadata = {"key": key, "parse": parse, "choices": tuple(choices), "positive": positive,
                "reload": reload}
    if default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def _key(field: dataclasses.Field) -> str:
    return field.metadata.get("key") or field.name


def _type_name(value: Any) -> str:
    return type(value).__name__


@dataclasses.dataclass(frozen=True)
class Section:
    """Base of every section of the settings file."""

    @classmethod
    def parse(cls: type[S], raw: Any, path: str = "") -> S:
        """The section from its parsed YAML (None: every default); ConfigError naming the field
        on bad input."""
        if raw is None:
            raw = {}
        if not isinstance(raw, Mapping):
            where = path or "the settings file"
            raise ConfigError(f"{where}: expected a mapping of settings, got {_type_name(raw)} "
                              f"{raw!r}")
        fields = {_key(f): f for f in dataclasses.fields(cls)}
        hints = typing.get_type_hints(cls, include_extras=True)
        values: dict[str, Any] = {}
        for key, value in raw.items():
            where = f"{path}.{key}" if path else str(key)
            field = fields.get(key)
            if field is None:
                raise ConfigError(f"{where}: unknown setting (known here: "
                                  f"{', '.join(sorted(fields))})")
            values[field.name] = _check(field, _convert(value, hints[field.name], field, where),
                                        where)
        section = cls(**values)
        section.validate(path)
        return section

    def validate(self, path: str) -> None:
        """Checks that span the section's fields; ConfigError naming the field."""


def _convert(value: Any, hint: Any, field: dataclasses.Field, path: str) -> Any:
    parse = field.metadata.get("parse")
    if parse is not None:
        return parse(value, path)
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        if value is None:
            return None
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    if hint is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{path}: expected true or false, got {value!r}")
    if hint == FileMode:
        if isinstance(value, str):
            try:
                value = int(value, 8)
            except ValueError:
                raise ConfigError(f"{path}: expected an octal mode like '{field.default:04o}', "
                                  f"got {value!r}") from None
        mode = _convert(value, int, field, path)
        if not 0 <= mode <= 0o777:
            raise ConfigError(f"{path}: must be a file mode between 0000 and 0777, got {oct(mode)}")
        return mode
    if hint == Port:
        port = _convert(value, int, field, path)
        if not 0 <= port <= 65535:
            raise ConfigError(f"{path}: must be a port number 0-65535 (0: any free port), "
                              f"got {port!r}")
        return port
    if hint is int:
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
    if isinstance(hint, type) and issubclass(hint, Section):
        return hint.parse(value, path)
    raise ConfigError(f"{path}: unsupported setting type {hint!r}")  # a bug in a section


def _check(field: dataclasses.Field, value: Any, path: str) -> Any:
    choices = field.metadata.get("choices")
    if choices and value not in choices:
        raise ConfigError(f"{path}: must be one of {', '.join(choices)}; got {value!r}")
    if field.metadata.get("positive") and value <= 0:
        raise ConfigError(f"{path}: must be greater than 0, got {value!r}")
    return value


def apply_reload(old: S, new: S, path: str = "") -> tuple[S, list[str]]:
    """The settings in force after a reload from `old` to `new`, and the changed fields that only
    a restart applies (by dotted path), which keep their old values until then. Fields marked
    `reload` take their new value; nested sections are merged field by field."""
    changes: dict[str, Any] = {}
    restart: list[str] = []
    for field in dataclasses.fields(old):
        before, after = getattr(old, field.name), getattr(new, field.name)
        if before == after:
            continue
        where = f"{path}.{_key(field)}" if path else _key(field)
        if field.metadata.get("reload"):
            changes[field.name] = after
        elif isinstance(before, Section):
            changes[field.name], needs_restart = apply_reload(before, after, where)
            restart += needs_restart
        else:
            restart.append(where)
    return dataclasses.replace(old, **changes), restart


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
