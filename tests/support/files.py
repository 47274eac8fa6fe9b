"""Writing a file that another thread or process is watching."""

from __future__ import annotations

import os
from pathlib import Path


def replace_text(path: Path, text: str) -> None:
    """Write `text` to a sibling and rename it over `path`: a watcher sees the old content or
    the new, never the empty or cut file that `Path.write_text` (truncate, then write) shows
    for a moment. Tests that mean to show a watcher a write in progress feed it the readings
    themselves."""
    staged = path.with_name(f".{path.name}.staged")
    staged.write_text(text)
    os.replace(staged, path)
