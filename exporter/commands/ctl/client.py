"""The operator's client of the sidecar's admin API (exporter.admin).

The address is `unix:///path/admin.sock` (default: /run/allocwatch/admin.sock, or
$ALLOCWATCH_ADMIN), `http://127.0.0.1:PORT` or `https://HOST:PORT`; TCP needs the bearer token
(--token-file F, or the token itself in $ALLOCWATCH_ADMIN_TOKEN), and HTTPS verifies the
sidecar's certificate (--tls-ca-file, else the system's CAs).
"""

from __future__ import annotations

import argparse
import dataclasses
import http.client
import json
import os
import socket
import ssl
import urllib.parse
from pathlib import Path
from typing import Any

DEFAULT_ADMIN = "unix:///run/allocwatch/admin.sock"
TOKEN_ENV = "ALLOCWATCH_ADMIN_TOKEN"


class CtlError(Exception):
    """A request that failed; `status` is the exit status ctl returns."""

    def __init__(self, message: str, status: int = 2):
        super().__init__(message)
        self.status = status


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float):
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(self._path)
        except OSError:
            sock.close()
            raise
        self.sock = sock


@dataclasses.dataclass(frozen=True)
class ClientTls:
    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None

    def context(self) -> ssl.SSLContext:
        """Verifies the sidecar's certificate and host name, always."""
        if bool(self.cert_file) != bool(self.key_file):
            raise CtlError("--tls-cert-file and --tls-key-file: give both or neither")
        try:
            context = ssl.create_default_context(cafile=self.ca_file)
            if self.cert_file:
                context.load_cert_chain(self.cert_file, self.key_file)
        except (OSError, ValueError) as err:
            raise CtlError(f"TLS files: {err}") from None
        return context


class AdminClient:
    def __init__(self, address: str, token: str | None = None, timeout: float = 120.0,
                 tls: ClientTls | None = None):
        url = urllib.parse.urlsplit(address)
        self._tls: ssl.SSLContext | None = None
        if url.scheme == "unix":
            self._unix = url.path or url.netloc
            self._host = ""
        elif url.scheme in ("http", "https") and url.hostname:
            self._unix, self._host = "", url.netloc
            if url.scheme == "https":
                self._tls = (tls or ClientTls()).context()
        else:
            raise CtlError(f"--admin {address!r}: expected unix:///path/admin.sock, "
                           "http://127.0.0.1:PORT or https://HOST:PORT")
        self.address = address
        self._token = token
        self._timeout = timeout

    def _connection(self) -> http.client.HTTPConnection:
        if self._unix:
            return _UnixConnection(self._unix, self._timeout)
        if self._tls is not None:
            return http.client.HTTPSConnection(self._host, timeout=self._timeout,
                                               context=self._tls)
        return http.client.HTTPConnection(self._host, timeout=self._timeout)

    def request(self, method: str, path: str, body: dict[str, Any] | None = None) -> bytes:
        headers = {"Content-Type": "application/json"}
        if self._token:
            headers["Authorization"] = f"Bearer {self._token}"
        data = json.dumps(body).encode() if body is not None else None
        connection = self._connection()
        try:
            connection.request(method, path, body=data, headers=headers)
            response = connection.getresponse()
            payload = response.read()
        except ssl.SSLError as err:  # before OSError: it is one, but not "unreachable"
            raise CtlError(f"TLS with the sidecar's admin API at {self.address} failed: "
                           f"{err.reason or err}") from None
        except OSError as err:
            raise CtlError(f"cannot reach the sidecar's admin API at {self.address}: "
                           f"{err.strerror or err}", 3) from None
        except http.client.HTTPException as err:
            raise CtlError(self._not_http(err), 3) from None
        finally:
            connection.close()
        if response.status != 200:
            try:
                message = json.loads(payload).get("error", "")
            except ValueError:
                message = payload[:200].decode(errors="replace")
            hint = (" (give --token-file FILE, or the token itself in $ALLOCWATCH_ADMIN_TOKEN)"
                    if response.status == 401 else "")
            raise CtlError(f"refused ({response.status}): {message}{hint}")
        return payload

    def _not_http(self, err: http.client.HTTPException) -> str:
        """What answered at the address is not an HTTP/1.1 server: most likely the agents'
        gRPC socket (HTTP/2), which sits beside the admin API's in the same directory."""
        line = getattr(err, "line", b"") or b""
        if isinstance(line, str):
            line = line.encode("latin-1", "replace")
        what = "a gRPC server (HTTP/2)" if line[:2] == b"\0\0" else "no HTTP/1.1 server"
        hint = ""
        if self._unix:
            hint = (f"; is it the agents' socket? The admin API's is admin.sock beside it "
                    f"(--admin unix://{Path(self._unix).with_name('admin.sock')}, as "
                    "admin.unix_socket sets it)")
        return f"{self.address} is not the sidecar's admin API: {what} answered{hint}"

    def get(self, path: str, **query: Any) -> Any:
        params = {k: v for k, v in query.items() if v is not None}
        suffix = f"?{urllib.parse.urlencode(params)}" if params else ""
        return json.loads(self.request("GET", path + suffix))

    def post(self, path: str, body: dict[str, Any]) -> Any:
        return json.loads(self.request("POST", path, body))


def read_token(args: argparse.Namespace) -> str | None:
    if args.token_file:
        try:
            token = Path(args.token_file).read_text().strip()
        except OSError as err:
            raise CtlError(f"--token-file {args.token_file}: {err.strerror}") from None
        except UnicodeDecodeError:
            raise CtlError(f"--token-file {args.token_file}: not a text file (it holds the "
                           "token the sidecar's admin.token_file holds)") from None
        if not token:
            raise CtlError(f"--token-file {args.token_file}: the file is empty (it holds the "
                           "token the sidecar's admin.token_file holds)")
        return token
    return os.environ.get(TOKEN_ENV) or None


def client_for(args: argparse.Namespace) -> AdminClient:
    address = args.admin or os.environ.get("ALLOCWATCH_ADMIN") or DEFAULT_ADMIN
    tls = ClientTls(
        ca_file=getattr(args, "tls_ca_file", None) or os.environ.get("ALLOCWATCH_ADMIN_TLS_CA"),
        cert_file=(getattr(args, "tls_cert_file", None)
                   or os.environ.get("ALLOCWATCH_ADMIN_TLS_CERT")),
        key_file=getattr(args, "tls_key_file", None) or os.environ.get("ALLOCWATCH_ADMIN_TLS_KEY"))
    return AdminClient(address, read_token(args), timeout=args.timeout, tls=tls)
