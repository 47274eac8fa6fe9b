"""Argument types the commands share: each refuses a bad value with a message naming it, so
argparse prints `allocwatch CMD: error: argument --X: ...` and exits 2, never a traceback."""

from __future__ import annotations

import argparse
import math
import textwrap
from collections.abc import Callable
from typing import TypeVar

N = TypeVar("N", int, float)


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Every command's --help: descriptions as written (their line breaks are laid out by
    hand), option help wrapped at spaces only, so that a settings string, an address or a
    path is never cut in two (argparse's own wrapping breaks long words)."""

    def _split_lines(self, text: str, width: int) -> list[str]:
        return textwrap.wrap(" ".join(text.split()), width, break_long_words=False,
                             break_on_hyphens=False) or [""]


def _parsed(text: str, convert: Callable[[str], N], what: str) -> N:
    try:
        return convert(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not {what}: {text!r}") from None


def seconds(*, zero_allowed: bool = False) -> Callable[[str], float]:
    """A finite number of seconds, above 0 (or 0 and above)."""

    def parse(text: str) -> float:
        value = _parsed(text, float, "a number of seconds")
        if not math.isfinite(value) or value < 0 or (value == 0 and not zero_allowed):
            bound = "0 or more" if zero_allowed else "above 0"
            raise argparse.ArgumentTypeError(f"{text}: give a number of seconds {bound}")
        return value

    return parse


def tcp_port(text: str) -> int:
    value = _parsed(text, int, "a port number")
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{value}: a TCP port is 1-65535 (0: any free port)")
    return value


def count(maximum: int, minimum: int = 0) -> Callable[[str], int]:
    """A whole number from `minimum` to `maximum`."""

    def parse(text: str) -> int:
        value = _parsed(text, int, "a whole number")
        if not minimum <= value <= maximum:
            raise argparse.ArgumentTypeError(
                f"{text}: give a whole number from {minimum:,} to {maximum:,}")
        return value

    return parse


def fraction(text: str) -> float:
    """A share of the device's memory, in (0, 1]."""
    value = _parsed(text, float, "a number")
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(
            f"{text}: a share of the device's memory, above 0 and at most 1 (0.9: 90 %)")
    return value
