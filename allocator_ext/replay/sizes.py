"""Byte sizes as people write them: 80GiB, 1.5G, 512MiB, 123456789.

One rule: every unit is a power of 1024. K, M, G, T and KiB, MiB, GiB, TiB mean the same
(as in PyTorch's max_split_size_mb, where MB is MiB). KB, MB, GB and TB are refused: they mean
powers of 1000 to some readers and of 1024 to others (an "80GB" GPU holds 80 GiB), and a cap
off by 7 % would silently change what a replay measures.
"""

from __future__ import annotations

import re

_UNITS = {
    "": 1, "b": 1,
    "k": 1 << 10, "kib": 1 << 10,
    "m": 1 << 20, "mib": 1 << 20,
    "g": 1 << 30, "gib": 1 << 30,
    "t": 1 << 40, "tib": 1 << 40,
}
_AMBIGUOUS = {"kb": "KiB", "mb": "MiB", "gb": "GiB", "tb": "TiB"}
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str) -> int:
    """Parses a byte size; raises ValueError naming the text when it is not one."""
    m = _SIZE.match(text)
    unit = m.group(2).lower() if m else ""
    if m and unit in _AMBIGUOUS:
        raise ValueError(f"{text!r} is ambiguous (powers of 1000 or of 1024?): write "
                         f"{m.group(1)}{_AMBIGUOUS[unit]} or the number of bytes")
    if not m or unit not in _UNITS:
        raise ValueError(f"not a size: {text!r} (examples: 80GiB, 1.5G, 512MiB, 123456789)")
    return int(float(m.group(1)) * _UNITS[unit])


def format_size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"
