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
import math
import os
import types
import typing
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Annotated, Any, TypeVar

import yaml

from allocator_ext.protocol.files import MAX_TOKEN_BYTES, read_regular_file

# Integers with a range of their own (still plain ints to a type checker):
Port = Annotated[int, "port"]            # 0-65535, 0 meaning any free port
FileMode = Annotated[int, "file mode"]   # 0000-0777: an octal string ("0660") or a number

S = TypeVar("S", bound="Section")


MAX_FILE_BYTES = 1 << 20
_SHOWN_CHARACTERS = 80
MIN_TOKEN_BYTES = 16


class ConfigError(ValueError):
    """A settings file that cannot be used; the message names the field."""


def shown(value: Any) -> str:
    """`value` as an error message shows it: a few dozen characters whatever its size (a
    message never holds the repr of a whole structure)."""
    if isinstance(value, Mapping):
        return f"a mapping of {len(value)} key{'s' if len(value) != 1 else ''}"
    if isinstance(value, (list, tuple, set)):
        return f"a list of {len(value)} item{'s' if len(value) != 1 else ''}"
    if isinstance(value, str):
        if len(value) <= _SHOWN_CHARACTERS:
            return repr(value)
        return f"{value[:_SHOWN_CHARACTERS]!r}... ({len(value)} characters)"
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 128:
        return f"an integer of {value.bit_length()} bits"
    if value is None or isinstance(value, (bool, int, float)):
        return repr(value)
    return f"a {type(value).__name__}"


def described(value: Any) -> str:
    """What a value of the wrong type is: its type and short value ("str 'x'")."""
    if isinstance(value, (Mapping, list, tuple, set)):
        return shown(value)
    return f"{_type_name(value)} {shown(value)}"


def setting(default: Any = dataclasses.MISSING, *, default_factory: Any = dataclasses.MISSING,
            key: str | None = None, parse: Callable[[Any, str], Any] | None = None,
            choices: Iterable[str] = (), positive: bool = False, minimum: float | None = None,
            maximum: float | None = None, reload: bool = False) -> Any:
    """A section's field with options: `key`, its name in the file (default: the field's);
    `parse(value, path)`, its own conversion; `choices`, the values allowed; `positive`, greater
    than 0; `minimum` / `maximum`, the range allowed (inclusive); `reload`, applied by a reload
    without a restart."""
    metadata = {"key": key, "parse": parse, "choices": tuple(choices), "positive": positive,
                "minimum": minimum, "maximum": maximum, "reload": reload}
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
    def parse(cls: type[S], raw: Any, path: str = "", base: S | None = None) -> S:
        """The section from its parsed YAML (None: every default), the fields it leaves out
        taken from `base` where given (a nested section's own defaults), else the class's;
        ConfigError naming the field on bad input."""
        if raw is None:
            raw = {}
        if not isinstance(raw, Mapping):
            where = path or "the settings file"
            raise ConfigError(f"{where}: expected a mapping of settings, got {described(raw)}")
        fields = {_key(f): f for f in dataclasses.fields(cls)}
        hints = typing.get_type_hints(cls, include_extras=True)
        values: dict[str, Any] = {}
        for key, value in raw.items():
            name = key if isinstance(key, str) and len(key) <= _SHOWN_CHARACTERS else shown(key)
            where = f"{path}.{name}" if path else name
            field = fields.get(key)
            if field is None:
                raise ConfigError(f"{where}: unknown setting (known here: "
                                  f"{', '.join(sorted(fields))})")
            values[field.name] = _check(field, _convert(value, hints[field.name], field, where),
                                        where)
        section = dataclasses.replace(base, **values) if base is not None else cls(**values)
        section.validate(path)
        return section

    def validate(self, path: str) -> None:
        """Checks that span the section's fields; ConfigError naming the field."""


def _convert(value: Any, hint: Any, field: dataclasses.Field, path: str) -> Any:
    if isinstance(value, str) and "\0" in value:  # no path, name or settings string holds one
        raise ConfigError(f"{path}: a NUL character (\\0) cannot be part of a setting")
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
        raise ConfigError(f"{path}: expected true or false, got {shown(value)}")
    if hint == FileMode:
        if isinstance(value, str):
            try:
                value = int(value, 8)
            except ValueError:
                raise ConfigError(f"{path}: expected an octal mode like '{field.default:04o}', "
                                  f"got {shown(value)}") from None
        mode = _convert(value, int, field, path)
        if not 0 <= mode <= 0o777:
            raise ConfigError(f"{path}: must be a file mode between 0000 and 0777, got "
                              f"{oct(mode) if mode.bit_length() <= 64 else shown(mode)}")
        return mode
    if hint == Port:
        port = _convert(value, int, field, path)
        if not 0 <= port <= 65535:
            raise ConfigError(f"{path}: must be a port number 0-65535 (0: any free port), "
                              f"got {shown(port)}")
        return port
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{path}: expected an integer, got {described(value)}")
        return value
    if hint is float:
        return finite_number(value, path)
    if hint is str:
        if not isinstance(value, str):
            raise ConfigError(f"{path}: expected a string, got {described(value)}")
        return value
    if isinstance(hint, type) and issubclass(hint, Section):
        return hint.parse(value, path, base=_default(field))
    raise ConfigError(f"{path}: unsupported setting type {hint!r}")  # a bug in a section


def _default(field: dataclasses.Field) -> Any:
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return None if field.default is dataclasses.MISSING else field.default


def finite_number(value: Any, path: str) -> float:
    """A number of the file as a float; ConfigError for anything else, NaN and ±Inf
    included (NaN passes every comparison, so no range check could catch it later)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{path}: expected a number, got {described(value)}")
    try:
        number = float(value)
    except OverflowError:  # an integer beyond any float
        number = math.inf
    if not math.isfinite(number):
        raise ConfigError(f"{path}: expected a finite number, got {shown(value)}")
    return number


def _check(field: dataclasses.Field, value: Any, path: str) -> Any:
    choices = field.metadata.get("choices")
    if choices and value not in choices:
        raise ConfigError(f"{path}: must be one of {', '.join(choices)}; got {shown(value)}")
    if field.metadata.get("positive") and value <= 0:
        raise ConfigError(f"{path}: must be greater than 0, got {shown(value)}")
    minimum, maximum = field.metadata.get("minimum"), field.metadata.get("maximum")
    if minimum is not None and value < minimum:
        raise ConfigError(f"{path}: must be at least {shown(minimum)}, got {shown(value)}")
    if maximum is not None and value > maximum:
        raise ConfigError(f"{path}: must be at most {shown(maximum)}, got {shown(value)}")
    return value


class _SettingsLoader(yaml.SafeLoader):
    """PyYAML's safe loader without aliases (settings need none, and they are how a few hundred
    bytes expand into gigabytes) and without duplicate keys (which would silently keep the
    last), and nested no deeper than MAX_NESTING (the settings nest four levels; deeper
    nesting is only slow to parse)."""

    MAX_NESTING = 32

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise yaml.composer.ComposerError(
                None, None, f"found the alias *{event.anchor}: YAML aliases are refused in a "
                "settings file", event.start_mark)
        self._depth = getattr(self, "_depth", 0) + 1
        try:
            if self._depth > self.MAX_NESTING:
                raise yaml.composer.ComposerError(
                    None, None, f"nested deeper than {self.MAX_NESTING} levels",
                    self.peek_event().start_mark)
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_mapping(self, node: Any, deep: bool = False) -> Any:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            try:
                duplicate = key in seen
            except TypeError:  # unhashable: the base class says so
                continue
            if duplicate:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {shown(key)}", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep)


def parse_yaml(text: bytes | str) -> Any:
    """The settings file's YAML, parsed; ConfigError for what cannot be used, whatever its
    content: bad YAML, aliases, duplicate keys, nesting too deep, memory exhausted."""
    # The error is raised after the handler: until then its traceback holds what the parser
    # built, and a parse that exhausted the memory needs that memory back to say so.
    try:
        return yaml.load(text, Loader=_SettingsLoader)  # noqa: S506 (a safe loader)
    except yaml.YAMLError as err:
        why = str(err)
    except RecursionError:
        why = "nested too deeply"
    except MemoryError:
        why = "parsing it exhausted the memory"
    except ValueError as err:  # an integer of more digits than Python converts
        why = str(err)
    raise ConfigError(f"not valid YAML: {why}")


def read_settings_file(path: str | Path) -> bytes:
    """A settings file's bytes; ConfigError when unreadable, no regular file or larger than
    MAX_FILE_BYTES."""
    try:
        data = read_regular_file(path, MAX_FILE_BYTES)
    except OSError as err:
        raise ConfigError(f"cannot read settings file {path}: {err.strerror}") from None
    if len(data) > MAX_FILE_BYTES:
        raise ConfigError(f"{path}: the file is larger than {MAX_FILE_BYTES} bytes")
    return data


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
        if not file:
            continue
        try:
            read_regular_file(file, 0)
        except OSError as err:
            raise ConfigError(f"{path}.{name}: cannot read {shown(file)}: {err.strerror}"
                              ) from None


def read_token(section: Any, path: str) -> bytes | None:
    """The bearer token a section's `token_file` / `token_env` name (file first), stripped;
    None if neither is set. ConfigError when set but unreadable, empty, or too short to resist
    guessing."""
    if section.token_file:
        try:
            raw = read_regular_file(section.token_file, MAX_TOKEN_BYTES)
        except OSError as err:
            raise ConfigError(f"{path}.token_file: cannot read {shown(section.token_file)}: "
                              f"{err.strerror}") from None
        where = f"{path}.token_file"
    elif section.token_env:
        raw = os.environb.get(section.token_env.encode(), b"")
        where = f"{path}.token_env (${section.token_env})"
    else:
        return None
    token = raw.strip()
    if len(token) > MAX_TOKEN_BYTES:
        raise ConfigError(f"{where}: the token is longer than {MAX_TOKEN_BYTES} bytes")
    if len(token) < MIN_TOKEN_BYTES:
        raise ConfigError(f"{where}: the token is empty or shorter than {MIN_TOKEN_BYTES} "
                          "bytes (generate one: openssl rand -hex 32)")
    return token
