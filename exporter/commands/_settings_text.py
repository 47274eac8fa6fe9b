"""The sidecar's settings written back as a user writes them (`allocwatch sidecar
--check-config`): YAML with the file's own keys, modes in octal, durations as 30s or 5m, sizes
with their value in KiB/MiB beside them. Reading the text back gives the same settings."""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from typing import Any

from exporter.policy.config import Rule, parse_duration
from exporter.shared.config import FileMode, Section

_DURATION_UNITS = [("h", 3600.0), ("m", 60.0), ("s", 1.0), ("ms", 0.001)]
_SIZE_UNITS = [("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)]


def duration_text(seconds: float) -> str:
    """30s, 5m, 1h, 500ms; a plain number of seconds where no unit divides it."""
    for unit, size in _DURATION_UNITS:
        count = seconds / size
        if seconds >= size and count == int(count):
            return f"{int(count)}{unit}"
    return f"{seconds:g}s" if seconds else "0s"


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def _size_comment(value: int) -> str:
    for unit, size in _SIZE_UNITS:
        if value >= size:
            return f"  # {value / size:g} {unit}"
    return ""


def _scalar(value: Any, hint: Any, field: dataclasses.Field) -> str:
    if value is None:
        return "null"
    if hint == FileMode:
        return json.dumps(f"{value:04o}")
    if field.metadata.get("parse") is parse_duration:
        return duration_text(value)
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        text = _number(value)
        return text + (_size_comment(int(value)) if field.name.endswith("_bytes") else "")
    return json.dumps(value)


def _rule_lines(rule: Rule) -> list[str]:
    entries = [("name", json.dumps(rule.name)), ("metric", rule.metric),
               (rule.direction, _number(rule.fire)), ("clear", _number(rule.clear)),
               ("for", duration_text(rule.for_seconds)),
               ("cooldown", duration_text(rule.cooldown_seconds)),
               ("max_actions_per_hour", str(rule.max_actions_per_hour)),
               ("action", rule.action)]
    entries.append(("mode", rule.mode) if rule.action == "reclaim"
                   else ("settings", json.dumps(rule.settings)))
    return [f"{'- ' if i == 0 else '  '}{key}: {value}" for i, (key, value) in enumerate(entries)]


def settings_text(section: Section, indent: str = "") -> str:
    hints = typing.get_type_hints(type(section), include_extras=True)
    lines = []
    for field in dataclasses.fields(section):
        key = field.metadata.get("key") or field.name
        value = getattr(section, field.name)
        hint = hints[field.name]
        if typing.get_origin(hint) in (typing.Union, types.UnionType):
            hint = next(a for a in typing.get_args(hint) if a is not type(None))
        if isinstance(value, Section):
            lines.append(f"{indent}{key}:")
            lines.append(settings_text(value, indent + "  "))
        elif isinstance(value, tuple):
            if not value:
                lines.append(f"{indent}{key}: []")
                continue
            lines.append(f"{indent}{key}:")
            for rule in value:
                lines += [f"{indent}  {line}" for line in _rule_lines(rule)]
        else:
            lines.append(f"{indent}{key}: {_scalar(value, hint, field)}")
    return "\n".join(lines)
