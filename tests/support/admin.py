"""Requests to the admin API over its real sockets (Unix or TCP), as raw HTTP: for the tests that
need to send what `allocwatch ctl` never would."""

from __future__ import annotations

import http.client
import json
import socket
from typing import Any


class UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float = 30):
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(self._path)


def connection(address: str, timeout: float = 30) -> http.client.HTTPConnection:
    """A connection to `unix:///path` or `http://host:port`."""
    if address.startswith("unix://"):
        return UnixConnection(address[len("unix://"):], timeout)
    return http.client.HTTPConnection(address[len("http://"):], timeout=timeout)


def call(address: str, method: str, path: str, body: Any = None,
         headers: dict[str, str] | None = None) -> tuple[int, Any]:
    """(status, the JSON answer or the raw bytes); `body` JSON-encoded unless bytes."""
    conn = connection(address)
    data = body if isinstance(body, bytes) else (json.dumps(body).encode() if body is not None
                                                 else None)
    conn.request(method, path, body=data, headers=headers or {})
    response = conn.getresponse()
    payload = response.read()
    conn.close()
    if (response.getheader("Content-Type") or "").startswith("application/json"):
        return response.status, json.loads(payload)
    return response.status, payload
