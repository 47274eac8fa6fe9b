"""The allocator's settings as the core defines them (allocator_ext/csrc/core/settings_table.h,
exposed by the binding as ``allocator_ext._core.SETTINGS``): one row per key, with its values,
both defaults, whose key it is, what ``_set_allocator_settings`` does to it when unnamed, and
one line of help. ``python -m allocator_ext.settings`` prints the table docs/torch.md shows.
"""

from __future__ import annotations

from typing import Any

from allocator_ext._core import SETTINGS

KEYS: tuple[str, ...] = tuple(row["key"] for row in SETTINGS)

_ORIGIN = {"pytorch": "PyTorch's", "allocwatch": "allocwatch's"}
_UNNAMED = {"resets": "back to its default", "keeps": "kept"}


def _default(row: dict[str, Any], text: str) -> str:
    # The divisions are written per interval; all the same, they read better as one number.
    if row["range"]["kind"] == "divisions":
        values = {entry.split(":")[1] for entry in text.strip("[]").split(",")}
        if len(values) == 1:
            return f"{values.pop()} (every interval)"
    return text


def markdown() -> str:
    """The settings as a Markdown table, one row per key, in the table's order."""
    lines = ["| key | values | `native` (PyTorch's default) | allocwatch's default | whose | "
             "unnamed in `_set_allocator_settings` | what it does |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for row in SETTINGS:
        lines.append(f"| `{row['key']}` | {row['values']} | "
                     f"{_default(row, row['native_default'])} | "
                     f"{_default(row, row['default'])} | {_ORIGIN[row['origin']]} | "
                     f"{_UNNAMED[row['on_pytorch_call']]} | {row['help']} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(markdown(), end="")
