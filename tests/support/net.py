"""A free TCP port for a server the tests start (bench.lib.ports, the one home of it)."""

from __future__ import annotations

from bench.lib.ports import free_port

__all__ = ["free_port"]
