"""Structured logs on stderr, one record per line: a JSON object, or logfmt (key=value pairs, as
Prometheus' own exporters write for a person to read), by default logfmt on a terminal and JSON
elsewhere (a container's log, which a collector parses); and a rate limit for the lines that
clients can cause at will."""

from __future__ import annotations

import json
import logging
import re
import sys
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

_RESERVED = set(vars(logging.makeLogRecord({})))


class JsonFormatter(logging.Formatter):
    """Every record as {"ts", "level", "logger", "msg", ...fields passed in extra=}."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": _timestamp(record),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in _RESERVED and not key.startswith("_"):
                entry[key] = value
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


_BARE = re.compile(r"[^\s\"=\\]+")  # a logfmt value that needs no quotes


class LogfmtFormatter(logging.Formatter):
    """Every record as `ts=… level=… logger=… msg="…" key=value …`, the fields passed in
    extra= after the four; a value with spaces, quotes or `=` is quoted, a list or mapping
    written as JSON."""

    def format(self, record: logging.LogRecord) -> str:
        pairs = [("ts", _timestamp(record)), ("level", record.levelname.lower()),
                 ("logger", record.name), ("msg", record.getMessage())]
        pairs += [(k, v) for k, v in vars(record).items()
                  if k not in _RESERVED and not k.startswith("_")]
        if record.exc_info:
            pairs.append(("exception", self.formatException(record.exc_info)))
        return " ".join(f"{key}={_logfmt_value(value)}" for key, value in pairs)


def _logfmt_value(value: Any) -> str:
    if value is None:
        return ""
    text = (json.dumps(value, default=str) if isinstance(value, (dict, list, tuple))
            else str(value).lower() if isinstance(value, bool) else str(value))
    return text if _BARE.fullmatch(text) else json.dumps(text)


def _timestamp(record: logging.LogRecord) -> str:
    return (time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z")


LOG_FORMATS = ("auto", "json", "logfmt")


def resolved_format(fmt: str) -> str:
    """`auto`: logfmt where stderr is a terminal (a person reads it), JSON elsewhere."""
    if fmt == "auto":
        return "logfmt" if sys.stderr.isatty() else "json"
    return fmt


def configure_logging(level: str = "info", fmt: str = "auto") -> None:
    """Route the `exporter` and `allocator_ext` loggers to stderr in the chosen format
    (LOG_FORMATS)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if resolved_format(fmt) == "json"
                         else LogfmtFormatter())
    root = logging.getLogger()
    for old in list(root.handlers):
        if getattr(old, "_allocwatch", False):
            root.removeHandler(old)
    handler._allocwatch = True  # type: ignore[attr-defined]
    root.addHandler(handler)
    root.setLevel(level.upper())


class RateLimitedLog:
    """Lines that clients can cause at will (refusals, collisions), rate-limited: per key, at
    most `burst` lines in any `period` seconds (a token bucket); the next line after a quiet
    spell says how many were held back ("suppressed": N)."""

    def __init__(self, burst: int = 5, period: float = 60.0,
                 clock: Callable[[], float] = time.monotonic):
        self._burst = burst
        self._period = period
        self._clock = clock
        self._lock = threading.Lock()
        # Per key: (tokens left, when they were last counted, lines held back since).
        self._buckets: dict[str, tuple[float, float, int]] = {}

    def log(self, key: str, logger: logging.Logger, message: str,
            fields: Mapping[str, Any] | Callable[[], Mapping[str, Any]] | None = None,
            level: int = logging.WARNING) -> bool:
        """Log `message` unless lines of `key` have used their share; whether it went out.
        `fields` may be a function giving them, called only for a line that goes out (fields
        that cost work to gather)."""
        now = self._clock()
        with self._lock:
            tokens, then, held = self._buckets.get(key, (float(self._burst), now, 0))
            tokens = min(float(self._burst), tokens + (now - then) * self._burst / self._period)
            if tokens < 1.0:
                self._buckets[key] = (tokens, now, held + 1)
                return False
            self._buckets[key] = (tokens - 1.0, now, 0)
        extra = dict((fields() if callable(fields) else fields) or {})
        if held:
            extra["suppressed"] = held
        logger.log(level, message, extra=extra)
        return True
