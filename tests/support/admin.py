"""Requests to the sidecar's HTTP listeners (the admin API's Unix socket or TCP port, the metrics
endpoint) over their real sockets, as raw HTTP: for the tests that need to send what
`allocwatch ctl` or a scraper never would."""

from __future__ import annotations

import http.client
import json
import socket
import time
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
    try:
        conn.request(method, path, body=data, headers=headers or {})
    except BrokenPipeError:
        # http.client sends the body after the headers; the sidecar answers a refusal without
        # waiting for a body and closes, so the body may meet a closed Unix socket. The answer
        # is already there to read.
        pass
    response = conn.getresponse()
    payload = response.read()
    conn.close()
    if (response.getheader("Content-Type") or "").startswith("application/json"):
        return response.status, json.loads(payload)
    return response.status, payload


def raw_socket(address: str, timeout: float = 10) -> socket.socket:
    """A plain connected socket to `unix:///path` or `http://host:port`."""
    if address.startswith("unix://"):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout)
        sock.connect(address[len("unix://"):])
        return sock
    host, port = address[len("http://"):].rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=timeout)


def read_until_closed(sock: socket.socket) -> bytes:
    """All the peer sends until it closes (a reset counts as closed)."""
    data = b""
    try:
        while chunk := sock.recv(1 << 16):
            data += chunk
    except ConnectionResetError:
        pass
    return data


def exchange(address: str, request: bytes, timeout: float = 10) -> tuple[int, bytes]:
    """Send `request` as it is and read the one answer: (status, body); status 0 when the
    server closed without answering."""
    with raw_socket(address, timeout) as sock:
        sock.sendall(request)
        response = http.client.HTTPResponse(sock, method=request.split(b" ", 1)[0].decode())
        try:
            response.begin()
            return response.status, response.read()
        except (http.client.RemoteDisconnected, ConnectionResetError):
            return 0, b""


def closed_within(sock: socket.socket, seconds: float, send: bytes = b"") -> float | None:
    """How long until the server closes `sock` (None if still open after `seconds`), sending
    `send` a byte at a time meanwhile, 0.2 s apart (a client trickling its request)."""
    started = time.monotonic()
    sock.settimeout(0.2)
    pending = send
    while time.monotonic() - started < seconds:
        try:
            if pending:
                sock.send(pending[:1])
                pending = pending[1:]
            if sock.recv(1 << 16) == b"":
                return time.monotonic() - started
        except TimeoutError:
            continue
        except (ConnectionResetError, BrokenPipeError):
            return time.monotonic() - started
    return None


def closed_now(sock: socket.socket) -> bool:
    """Whether the server has closed `sock` already (nothing is read from it)."""
    sock.setblocking(False)
    try:
        return sock.recv(1, socket.MSG_PEEK) == b""
    except BlockingIOError:
        return False
    except (ConnectionResetError, BrokenPipeError):
        return True
    finally:
        sock.setblocking(True)
