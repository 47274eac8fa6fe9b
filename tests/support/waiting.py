"""Waiting for what another thread or process does, with a deadline and a message that says
what never happened."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable
from typing import Any


def wait_for(predicate: Callable[[], Any], timeout: float = 10.0, interval: float = 0.05,
             what: str = "condition") -> Any:
    """predicate()'s first true value; AssertionError after `timeout` seconds (an exception
    from predicate, e.g. a connection refused while a server starts, counts as not yet)."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = predicate()
        except Exception as err:
            last = err
        else:
            if last:
                return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout} s waiting for {what} (last: {last!r})")


def terminate(process: subprocess.Popen, timeout: float = 10.0) -> None:
    """SIGTERM, then SIGKILL where the process is not gone within `timeout` seconds; returns
    once it has exited."""
    process.terminate()
    try:
        process.wait(timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
