"""Scrapes first: while a /metrics answer is being built, the sidecar's listeners (the metrics
endpoint, the admin API, the agents' front) leave new connections in the kernel's accept queue.

Every listener shares the sidecar's event loop, and the build shares the interpreter's lock with
it: a crowd of clients connecting over and over (requests refused at once, preface-only or
health-check connections evicted and opened again) makes the loop take that lock between its
accepts, hand-overs and closes, and the build waits its turn each time. Left in the queue for the
length of a build, those newcomers cost nothing, and clients that reconnect as fast as they are
refused wait there too; connections already open (the agents' streams, kept-alive scrapers) are
served as before.

Bounded, so that clients scraping without end cannot stop the accepts: a deferral lasts while a
scrape is being built and at most `longest` seconds, and after one ends the listeners accept for
at least as long as it lasted before the next can begin (they accept at least half the time). A
probe or an agent that connects meanwhile waits at most `longest` in the queue.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import Callable, Iterator

LONGEST_DEFERRAL_SECONDS = 0.25


class Precedence:
    """Used on the event loop only. The metrics endpoint marks each build with `scrape()`; a
    listener asks `defers(resume)` before it accepts, and when told to wait stops reading its
    listening socket until `resume` is called."""

    def __init__(self, longest: float = LONGEST_DEFERRAL_SECONDS):
        self.longest = longest
        self._scrapes = 0
        self._since: float | None = None  # when the deferral in force began (loop clock)
        self._open_until = -math.inf  # no deferral begins before this
        self._resumes: list[Callable[[], None]] = []
        self._timer: asyncio.TimerHandle | None = None

    @contextlib.contextmanager
    def scrape(self) -> Iterator[None]:
        """A /metrics body is being built meanwhile."""
        self._scrapes += 1
        try:
            yield
        finally:
            self._scrapes -= 1
            if not self._scrapes:
                self._end()

    def defers(self, resume: Callable[[], None]) -> bool:
        """Whether the listener asking should leave its queue alone for now; if so, `resume`
        is called once it may accept again."""
        if not self._scrapes:
            return False
        if self._since is None:
            loop = asyncio.get_running_loop()
            now = loop.time()
            if now < self._open_until:
                return False
            self._since = now
            self._timer = loop.call_at(now + self.longest, self._end)
        self._resumes.append(resume)
        return True

    def _end(self) -> None:
        if self._since is None:
            return
        now = asyncio.get_running_loop().time()
        self._open_until = now + (now - self._since)
        self._since = None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        resumes, self._resumes = self._resumes, []
        for resume in resumes:
            resume()
