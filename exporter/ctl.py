"""`allocwatch ctl`: the operator's client of the sidecar's admin API (exporter.admin).

The address is `unix:///path/admin.sock` (default: /run/allocwatch/admin.sock, or
$ALLOCWATCH_ADMIN), `http://127.0.0.1:PORT` or `https://HOST:PORT`; TCP needs the bearer token
(--token-file F, or $ALLOCWATCH_ADMIN_TOKEN), and HTTPS verifies the sidecar's certificate
(--tls-ca-file, else the system's CAs).
"""

from __future__ import annotations

import argparse
import dataclasses
import http.client
import json
import os
import socket
import ssl
import sys
import urllib.parse
from pathlib import Path
from typing import Any, TextIO

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
        finally:
            connection.close()
        if response.status != 200:
            try:
                message = json.loads(payload).get("error", "")
            except ValueError:
                message = payload[:200].decode(errors="replace")
            hint = " (give --token-file or $ALLOCWATCH_ADMIN_TOKEN)" if response.status == 401 \
                else ""
            raise CtlError(f"refused ({response.status}): {message}{hint}")
        return payload

    def get(self, path: str, **query: Any) -> Any:
        params = {k: v for k, v in query.items() if v is not None}
        suffix = f"?{urllib.parse.urlencode(params)}" if params else ""
        return json.loads(self.request("GET", path + suffix))

    def post(self, path: str, body: dict[str, Any]) -> Any:
        return json.loads(self.request("POST", path, body))


# ---------------------------------------------------------------------- formatting


def human_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _table(rows: list[list[str]], out: TextIO) -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip(), file=out)


def print_agents(agents: list[dict[str, Any]], out: TextIO) -> None:
    if not agents:
        print("no agent matches", file=out)
        return
    rows = [["AGENT", "RANK", "HOST", "JOB", "BACKEND", "STATE", "DEV", "ALLOCATED", "RESERVED",
             "FRAG", "RETRIES", "OOMS", "SETTINGS"]]
    for agent in agents:
        state = "connected" if agent["connected"] else "gone"
        devices = agent["devices"] or [None]
        for device in devices:
            rows.append([
                agent["agent"], str(agent["rank"]) if agent["rank"] >= 0 else "-",
                agent["host"] or "-", agent["job"] or "-", agent["backend"] or "-", state,
                str(device["cuda_device"]) if device else "-",
                human_bytes(device["allocated_bytes"]) if device else "-",
                human_bytes(device["reserved_bytes"]) if device else "-",
                f"{device['fragmentation_ratio']:.2f}" if device else "-",
                str(device["counters"]["alloc_retries"]) if device else "-",
                str(device["counters"]["ooms"]) if device else "-",
                device["settings"]["config_string"] or "-" if device else "-"])
    _table(rows, out)


def print_results(answer: dict[str, Any], out: TextIO) -> None:
    print(f"{answer['command']}: {answer['selected']} agent(s)", file=out)
    for r in answer["results"]:
        line = f"  {r['agent']} (rank {r['rank']}, {r['host']}): {r['status']}"
        if r.get("message"):
            line += f" — {r['message']}"
        print(line, file=out)
        if answer["command"] == "reclaim" and r["status"] == "ok":
            print(f"    released {human_bytes(r['bytes_released'])} in "
                  f"{r['sync_seconds'] * 1e3:.2f} ms (device synchronisation included)", file=out)
        if "snapshot" in r:
            print(f"    snapshot {r['snapshot']['path']} ({human_bytes(r['snapshot']['bytes'])})",
                  file=out)
        for s in r.get("settings_in_force", []):
            print(f"    cuda:{s['cuda_device']} settings in force: {s['config_string'] or '-'}",
                  file=out)


# ---------------------------------------------------------------------- commands


def selectors(args: argparse.Namespace) -> dict[str, Any]:
    found = {"rank": args.rank, "host": args.host, "job": args.job, "agent": args.agent}
    return {k: v for k, v in found.items() if v is not None}


def read_token(args: argparse.Namespace) -> str | None:
    if args.token_file:
        try:
            return Path(args.token_file).read_text().strip()
        except OSError as err:
            raise CtlError(f"--token-file {args.token_file}: {err.strerror}") from None
    return os.environ.get(TOKEN_ENV) or None


def client_for(args: argparse.Namespace) -> AdminClient:
    address = args.admin or os.environ.get("ALLOCWATCH_ADMIN") or DEFAULT_ADMIN
    tls = ClientTls(
        ca_file=getattr(args, "tls_ca_file", None) or os.environ.get("ALLOCWATCH_ADMIN_TLS_CA"),
        cert_file=(getattr(args, "tls_cert_file", None)
                   or os.environ.get("ALLOCWATCH_ADMIN_TLS_CERT")),
        key_file=getattr(args, "tls_key_file", None) or os.environ.get("ALLOCWATCH_ADMIN_TLS_KEY"))
    return AdminClient(address, read_token(args), timeout=args.timeout, tls=tls)


def _emit(args: argparse.Namespace, answer: dict[str, Any], out: TextIO) -> int:
    if args.json:
        print(json.dumps(answer, indent=2), file=out)
    else:
        print_results(answer, out)
    return 0 if answer["ok"] else 1


def cmd_agents(args: argparse.Namespace, client: AdminClient, out: TextIO) -> int:
    answer = client.get("/v1/agents", **selectors(args))
    if args.json:
        print(json.dumps(answer, indent=2), file=out)
    else:
        print_agents(answer["agents"], out)
    return 0


def cmd_set(args: argparse.Namespace, client: AdminClient, out: TextIO) -> int:
    return _emit(args, client.post("/v1/settings", {"settings": args.settings,
                                                    **selectors(args)}), out)


def cmd_reclaim(args: argparse.Namespace, client: AdminClient, out: TextIO) -> int:
    mode = "all" if args.all else "gc"
    return _emit(args, client.post("/v1/reclaim", {"mode": mode, **selectors(args)}), out)


def cmd_reset_peaks(args: argparse.Namespace, client: AdminClient, out: TextIO) -> int:
    return _emit(args, client.post("/v1/reset-peaks", selectors(args)), out)


def cmd_snapshot(args: argparse.Namespace, client: AdminClient, out: TextIO) -> int:
    answer = client.post("/v1/snapshot", {"frames": args.frames, **selectors(args)})
    status = _emit(args, answer, out)
    if args.output:
        taken = [r for r in answer["results"] if "snapshot" in r]
        target = Path(args.output)
        if len(taken) > 1 and not target.is_dir():
            raise CtlError(f"-o {args.output}: {len(taken)} agents answered; give a directory "
                           "or select one agent (--rank/--host/--job/--agent)")
        for r in taken:
            data = client.request("GET", r["snapshot"]["download"])
            path = target / Path(r["snapshot"]["path"]).name if target.is_dir() else target
            path.write_bytes(data)
            print(f"  wrote {path} ({human_bytes(len(data))})", file=sys.stderr)
    return status


def cmd_diagnose(args: argparse.Namespace, client: AdminClient, out: TextIO) -> int:
    from exporter.diagnose import run_diagnosis

    return run_diagnosis(args, client, selectors(args), out)


COMMANDS = {
    "agents": cmd_agents,
    "set": cmd_set,
    "reclaim": cmd_reclaim,
    "snapshot": cmd_snapshot,
    "reset-peaks": cmd_reset_peaks,
    "diagnose": cmd_diagnose,
}


def main(args: argparse.Namespace, out: TextIO | None = None) -> int:
    out = out or sys.stdout
    try:
        return COMMANDS[args.ctl_command](args, client_for(args), out)
    except CtlError as err:
        print(f"allocwatch ctl: {err}", file=sys.stderr)
        return err.status
