"""Byte sizes as people write them: 80GiB, 1.5G, 512MiB, 123456789B.

One rule: every unit is a power of 1024. K, M, G, T and KiB, MiB, GiB, TiB mean the same
(as in PyTorch's max_split_size_mb, where MB is MiB). KB, MB, GB and TB are refused: they mean
powers of 1000 to some readers and of 1024 to others (an "80GB" GPU holds 80 GiB), and a cap
off by 7 % would silently change what a replay measures. A number without a unit is refused
too: "80" meant as 80 GiB, or "1.03" meant as a multiple, must not become a cap of 80 bytes or
1 byte; bytes are written with B (123456789B), and are whole.
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
LARGEST = (1 << 64) - 1  # what a size_t holds: the core's sizes


class SizeWithoutUnit(ValueError):
    """A number alone, where a size needs its unit; `number` is the text of the number."""

    def __init__(self, message: str, number: str):
        super().__init__(message)
        self.number = number


def parse_size(text: str) -> int:
    """Parses a byte size; raises ValueError naming the text when it is not one."""
    m = _SIZE.match(text)
    unit = m.group(2).lower() if m else None
    if m and unit in _AMBIGUOUS:
        raise ValueError(f"{text!r} is ambiguous (powers of 1000 or of 1024?): write "
                         f"{m.group(1)}{_AMBIGUOUS[unit]}, or the bytes with B")
    if m is None or unit not in _UNITS:
        raise ValueError(f"not a size: {text!r} (examples: 80GiB, 1.5G, 512MiB, 123456789B)")
    number = m.group(1)
    if unit == "":
        bytes_too = "" if "." in number else f", or {number}B if bytes are meant"
        raise SizeWithoutUnit(f"{text!r} has no unit: write {number}G, {number}GiB, {number}M, "
                              f"… (powers of 1024){bytes_too}", number)
    if unit == "b" and "." in number:
        raise ValueError(f"{text!r}: a number of bytes is whole")
    whole, _, decimals = number.partition(".")
    # Exact arithmetic: a float would round sizes above 2**53 bytes.
    size = (int(whole) * _UNITS[unit] + int(decimals or "0") * _UNITS[unit]
            // 10 ** len(decimals or "0"))
    if size > LARGEST:
        raise ValueError(f"{text!r} is more than any device holds (at most 16 EiB)")
    return size


def format_size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"
