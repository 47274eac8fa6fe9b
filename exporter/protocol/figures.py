"""Figures derived from an allocator's counters, computed the same way wherever they are shown
(the Prometheus series, the admin API, the policy engine's rules)."""

from __future__ import annotations


def fragmentation_ratio(reserved: int, allocated: int) -> float:
    """(reserved - allocated) / reserved: the share of the cache unused right now; 0 when
    nothing is reserved."""
    return (reserved - allocated) / reserved if reserved > 0 else 0.0
