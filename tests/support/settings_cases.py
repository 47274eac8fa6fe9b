"""Values to try for every allocator setting, made from the settings table the binding exposes
(allocator_ext._core.SETTINGS, from allocator_ext/csrc/core/settings_table.h): values a setting
takes, with how items() writes them back, and values it refuses, with what the refusal must
name. The tests of every setting walk these, so a new row of the table is tested without a
test naming it.

Also loaded by path (runpy) from the scenario scripts that run in processes of their own."""

from __future__ import annotations

from typing import Any

from allocator_ext._core import SETTINGS

Row = dict[str, Any]
ROWS: tuple[Row, ...] = tuple(SETTINGS)
KEYS: tuple[str, ...] = tuple(row["key"] for row in ROWS)


def _first_allowed(r: dict[str, Any]) -> int:
    """The least whole number the range allows besides 0."""
    start = max(r["min"], 1)
    return -(-start // r["multiple"]) * r["multiple"]


def good_values(row: Row) -> list[tuple[str, str | None]]:
    """(value, how items() writes it, None where only the round trip is checked). The first
    value differs from PyTorch's default wherever the setting has more than one value."""
    r, key = row["range"], row["key"]
    kind = r["kind"]
    if kind == "bool":
        return [("True", "True"), ("False", "False"), ("true", "True"), ("0", "False")]
    if kind == "whole":
        if r["power_of_two"]:
            values = [r["max"] or 64, 2, 1]
        else:
            least = _first_allowed(r)
            values = [least + 2 * r["multiple"] * 10, least] + ([0] if r["zero"] else [])
        return [(str(v), str(v)) for v in values]
    if kind == "real":
        low, high = r["above"], r["below"]
        values = [low + (high - low) / 4, low + (high - low) * 0.8]
        return [(repr(v), repr(v)) for v in values]
    if kind == "divisions":
        every = "[" + ",".join(f"{1 << i}:4" for i in range(16)) + "]"
        return [("4", every), ("[256:1,512:2,>:8]", None), ("[64:8,128:2,>:1]", None)]
    if kind == "choice":
        return [(row["native_default"], row["native_default"])]
    raise AssertionError(f"{key}: no values for a setting of kind {kind!r}: add them here")


def bad_values(row: Row) -> list[tuple[str, str]]:
    """(value, what the refusal must name: the key with the value, or with the part of a list
    that is wrong)."""
    r, key = row["range"], row["key"]
    kind = r["kind"]
    if kind == "bool":
        values = ["yes", "2", "Truee", ""]
    elif kind == "whole":
        values = ["abc", "-2", "1.5", "99999999999999999999999"]
        least = _first_allowed(r)
        below = r["min"] - 1
        if below >= 0 and not (below == 0 and r["zero"]):
            values.append(str(below))
        if r["multiple"] > 1:
            values.append(str(least + 1))
        if r["max"]:
            values.append(str(r["max"] * 2))
        if r["power_of_two"]:
            values.append("3")
        if r["unit"] == "MiB":
            values.append(str((1 << 64) // (1 << 20) + 2))  # more bytes than a size_t holds
    elif kind == "real":
        values = [repr(r["above"]), repr(r["below"]), repr(r["below"] + 0.5), "nan", "inf", "x"]
    elif kind == "divisions":
        return [("3", f"{key}:3"), ("0", f"{key}:0"), ("[256:3]", f"{key}:3"),
                ("[3:1]", f"{key}:3"), ("x", f"{key}:x")]
    elif kind == "choice":
        values = ["cudaMallocAsync", "other"]
    else:
        raise AssertionError(f"{key}: no bad values for a setting of kind {kind!r}: add them here")
    return [(value, f"{key}:{value}" if value else f"{key}: missing") for value in values]


def other_value(row: Row) -> str | None:
    """A value unlike PyTorch's default, or None where the setting has only one value."""
    value, _ = good_values(row)[0]
    return None if value == row["native_default"] else value


def busy_settings() -> str:
    """A settings string that gives every setting that can differ a value unlike PyTorch's
    default."""
    return "native," + ",".join(f"{row['key']}:{other_value(row)}" for row in ROWS
                                if other_value(row) is not None)
