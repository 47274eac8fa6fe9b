"""Summaries of paired comparisons, for the benchmarks that interleave two sides."""

from __future__ import annotations

import statistics


def mean_and_stderr(values: list[float]) -> tuple[float, float | None]:
    """The mean and its standard error (None from a single value)."""
    se = statistics.stdev(values) / len(values) ** 0.5 if len(values) > 1 else None
    return statistics.fmean(values), se
