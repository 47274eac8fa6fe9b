"""`allocwatch ctl` prints what agents chose (keys, hosts, jobs, backends, settings, messages,
paths) with every character a terminal could act on escaped: an ESC sequence, a carriage
return, a bell or a bidi override from an agent forges no row and hides no text. The answers
come from an admin API on a real Unix socket that relays such text (the sidecar itself now
refuses it from agents; ctl trusts neither)."""

from __future__ import annotations

import json
import socketserver
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import pytest
from support.paths import REPO

HOSTILE = "node\x1b[2J\x1b[1;1H\rforged row\x07\u202egnp.\x9b31m"

AGENT = {
    "agent": f"{HOSTILE}/1/rank0/0f0f0f0f", "connected": True, "series_slot": 1, "rank": 0,
    "local_rank": 0, "world_size": 1, "host": HOSTILE, "pid": 1, "job": HOSTILE, "pod": "",
    "backend": HOSTILE, "protocol": "1.2", "reports_received": 1, "report_sequence": 1,
    "report_timestamp": 0.0,
    "devices": [{"cuda_device": 0, "gpu_uuid": "GPU-x", "allocated_bytes": 1, "reserved_bytes": 2,
                 "peak_fragmentation_ratio": 0.5, "counters": {"alloc_retries": 0, "ooms": 0},
                 "settings": {"config_string": HOSTILE}}],
}
RESULT = {"command": "set_config", "selector": {}, "selected": 1, "ok": True, "results": [{
    "agent": AGENT["agent"], "rank": 0, "host": HOSTILE, "status": "ok", "message": HOSTILE,
    "bytes_released": 0, "sync_seconds": 0.0,
    "settings_in_force": [{"cuda_device": 0, "config_string": HOSTILE}]}]}


class _Api(BaseHTTPRequestHandler):
    def _send(self, payload: object) -> None:
        body = json.dumps(payload).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:  # noqa: N802
        self._send({"agents": [AGENT]})

    def do_POST(self) -> None:  # noqa: N802
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self._send(RESULT)

    def address_string(self) -> str:
        return "unix"

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def admin(tmp_path: Path) -> Iterator[str]:
    path = tmp_path / "admin.sock"
    server = socketserver.ThreadingUnixStreamServer(str(path), _Api)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"unix://{path}"
    finally:
        server.shutdown()
        server.server_close()


def _ctl(admin: str, *args: str) -> str:
    done = subprocess.run([sys.executable, "-m", "exporter.cli", "ctl", "--admin", admin, *args],
                          capture_output=True, text=True, cwd=REPO, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.mark.parametrize("args", [("agents",), ("set", "garbage_collection_threshold:0.8")],
                         ids=["agents", "set"])
def test_text_an_agent_chose_reaches_the_terminal_escaped(admin: str, args: tuple) -> None:
    out = _ctl(admin, *args)
    unsafe = [c for c in out if c != "\n" and (ord(c) < 0x20 or 0x7F <= ord(c) <= 0x9F
                                               or c == "\u202e")]
    assert unsafe == [], out
    assert "node\\x1b[2J\\x1b[1;1H\\x0dforged row\\x07\\u202egnp.\\x9b31m" in out
