"""Clients the listeners refuse, counted by reason (allocwatch_refused_total{reason}), and the
warnings they cause, rate-limited.

A client refused thousands of times a second (a wrong token in a loop, a stream flood) must
not fill the log, nor the disk of the node under it: per reason, at most `burst` lines go out in
any `period` seconds; the next line after a quiet spell says how many were held back
("suppressed": N). Every refusal is counted all the same.

Reasons: `agent_token` (an agent's stream on TCP without the right token), `admin_token` (an
admin API request on TCP without it), `metrics_token` (a scrape without it, where
metrics.token_file is set), `peer_user` (a connection to the agents' Unix socket from a user
agents.allowed_uids does not name), `health_watch_limit` (a gRPC health Watch past the limit).
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Mapping
from typing import Any

from exporter.shared.logs import RateLimitedLog


class Refusals:
    def __init__(self, lines: RateLimitedLog | None = None):
        self._lines = lines or RateLimitedLog()
        self._lock = threading.Lock()
        self._counts: collections.Counter[str] = collections.Counter()

    def refuse(self, reason: str, logger: logging.Logger, message: str,
               fields: Mapping[str, Any] | None = None) -> None:
        """Count a refusal and warn about it (rate-limited)."""
        with self._lock:
            self._counts[reason] += 1
        self._lines.log(reason, logger, message, fields)

    def warn(self, key: str, logger: logging.Logger, message: str,
             fields: Mapping[str, Any] | None = None, level: int = logging.WARNING) -> None:
        """Log `message` (rate-limited by `key`), counting nothing."""
        self._lines.log(key, logger, message, fields, level)

    def counts(self) -> list[tuple[str, int]]:
        """Refusals so far, by reason (for the collector)."""
        with self._lock:
            return sorted(self._counts.items())
