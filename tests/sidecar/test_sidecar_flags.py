"""`allocwatch sidecar` as a real process, with the flags other exporters take: the metrics
listener's address and path, the logs' format and level over the settings file's, kept across a
reload; and a port another program holds named with its listener."""

from __future__ import annotations

import json
import os
import pty
import signal
import socket
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.paths import REPO
from support.waiting import wait_for

from bench.lib.ports import free_port
from exporter.cli import main

pytestmark = pytest.mark.timeout(120)


def settings(tmp_path: Path, extra: str = "") -> Path:
    path = tmp_path / "sidecar.yaml"
    path.write_text(f"""
agents: {{unix_socket: {tmp_path}/run/agent.sock}}
metrics: {{address: 0.0.0.0, port: 9471}}
nvml: {{enabled: false}}
logging: {{level: warning, format: json}}
reload: {{interval_seconds: 0.1}}
{extra}""")
    return path


def sidecar(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "exporter.cli", "sidecar", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)


def stopped(process: subprocess.Popen) -> tuple[str, str]:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
    return process.communicate(timeout=60)


def get(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return int(response.status)
    except urllib.error.HTTPError as err:
        return err.code


def test_the_flags_set_the_listener_path_and_logs_over_the_file_and_a_reload(
        tmp_path: Path) -> None:
    path, port = settings(tmp_path), free_port()
    process = sidecar("--config", str(path), "--web.listen-address", f"127.0.0.1:{port}",
                      "--web.telemetry-path", "/allocwatch/metrics", "--log.format", "logfmt",
                      "--log.level", "info")
    try:
        base = f"http://127.0.0.1:{port}"
        wait_for(lambda: get(f"{base}/readyz") == 200 or process.poll() is not None,
                 timeout=60, what="the sidecar ready on the flag's address")
        assert process.poll() is None
        assert get(f"{base}/allocwatch/metrics") == 200 and get(f"{base}/metrics") == 404
        # A reload of the file, whose metrics and logging sections say otherwise: the flags
        # stay in force, and the listener is no change that waits for a restart.
        path.write_text(path.read_text().replace("agents:", "policy: {dry_run: true}\nagents:"))
        wait_for(lambda: _reloads(base) >= 1, timeout=30, what="the reload")
        assert get(f"{base}/allocwatch/metrics") == 200
    finally:
        _, err = stopped(process)
    lines = [line for line in err.splitlines() if line.startswith("ts=")]
    assert lines and all(" level=" in line and " logger=" in line for line in lines), err
    started = next(line for line in lines if 'msg="sidecar started"' in line)
    assert f'metrics=http://127.0.0.1:{port}' in started
    reloaded = next(line for line in lines if 'msg="settings reloaded"' in line)
    assert "needs_restart=" in reloaded and "metrics" not in reloaded.split("needs_restart=")[1]
    assert not any(line.startswith("{") for line in err.splitlines())  # no JSON line


def _metrics_text(base: str) -> str:
    with urllib.request.urlopen(f"{base}/allocwatch/metrics", timeout=5) as response:
        return response.read().decode()


def _reloads(base: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in _metrics_text(base).splitlines()
               if line.startswith('allocwatch_config_reloads_total{result="ok"}'))


def test_logs_default_to_json_where_stderr_is_no_terminal(tmp_path: Path) -> None:
    path, port = settings(tmp_path).read_text(), free_port()
    (tmp_path / "auto.yaml").write_text(path.replace("format: json", "format: auto"))
    process = sidecar("--config", str(tmp_path / "auto.yaml"), "--web.listen-address",
                      f"127.0.0.1:{port}", "--log.level", "info")
    try:
        wait_for(lambda: get(f"http://127.0.0.1:{port}/readyz") == 200
                 or process.poll() is not None, timeout=60, what="the sidecar ready")
    finally:
        _, err = stopped(process)
    records = [json.loads(line) for line in err.splitlines() if line.startswith("{")]
    assert any(r["msg"] == "sidecar started" for r in records), err


def test_logs_default_to_logfmt_on_a_terminal(tmp_path: Path) -> None:
    """A person running the sidecar in a terminal reads key=value lines, not JSON: stderr is
    a real pseudo-terminal here."""
    path, port = settings(tmp_path).read_text(), free_port()
    (tmp_path / "auto.yaml").write_text(path.replace("format: json", "format: auto"))
    terminal, its_end = pty.openpty()
    chunks: list[bytes] = []

    def drain() -> None:  # read as it comes: a full terminal buffer would block the sidecar
        while True:
            try:
                chunk = os.read(terminal, 65536)
            except OSError:  # EIO: the sidecar, the only writer, has gone
                return
            if not chunk:
                return
            chunks.append(chunk)

    process = subprocess.Popen(
        [sys.executable, "-m", "exporter.cli", "sidecar", "--config", str(tmp_path / "auto.yaml"),
         "--web.listen-address", f"127.0.0.1:{port}", "--log.level", "info"],
        stdout=subprocess.DEVNULL, stderr=its_end, cwd=REPO)
    os.close(its_end)
    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    try:
        wait_for(lambda: get(f"http://127.0.0.1:{port}/readyz") == 200
                 or process.poll() is not None, timeout=60, what="the sidecar ready")
    finally:
        stopped(process)
        reader.join(timeout=10)
        os.close(terminal)
    lines = b"".join(chunks).decode(errors="replace").splitlines()
    started = [line for line in lines if 'msg="sidecar started"' in line]
    assert started and started[0].startswith("ts="), lines
    assert " level=info " in started[0]
    assert not any(line.lstrip().startswith("{") for line in lines), lines


@pytest.fixture
def taken_port() -> Iterator[int]:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        yield holder.getsockname()[1]


@pytest.mark.parametrize("listener", ["metrics", "agents", "admin"])
def test_a_taken_port_names_its_listener(listener: str, taken_port: int, tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    token = tmp_path / "token"
    token.write_text("0a1b2c3d4e5f60718293a4b5c6d7e8f9")
    os.chmod(token, 0o600)
    ports = {"metrics": free_port(), listener: taken_port}
    extra = {
        "metrics": "",
        "agents": f"agents: {{unix_socket: {tmp_path}/run/agent.sock, tcp_port: {taken_port}, "
                  f"token_file: {token}}}\n",
        "admin": f"admin: {{tcp_port: {taken_port}, token_file: {token}}}\n",
    }[listener]
    path = settings(tmp_path)
    text = path.read_text().replace("port: 9471", f"port: {ports['metrics']}")
    if listener == "agents":
        text = text.replace(f"agents: {{unix_socket: {tmp_path}/run/agent.sock}}\n", "")
    path.write_text(text + extra)
    assert main(["sidecar", "--config", str(path), "--web.listen-address",
                 f"127.0.0.1:{ports['metrics']}", "--log.format", "json"]) == 1
    err = capsys.readouterr().err
    [said] = [line for line in err.splitlines() if line.startswith("allocwatch sidecar: ")]
    assert said.startswith(f"allocwatch sidecar: the {listener} listener"), said
    assert f"127.0.0.1:{taken_port}" in said and "Address already in use" in said, said


def test_bad_flag_values_are_refused_by_name(capsys: pytest.CaptureFixture[str]) -> None:
    for argv, message in (
            (["--web.listen-address", "9471"], "expected [HOST]:PORT"),
            (["--web.listen-address", ":99999"], "a TCP port is 1-65535"),
            (["--web.telemetry-path", "metrics"], "expected a path such as /metrics"),
            (["--web.telemetry-path", "/healthz"], "/healthz is the sidecar's own"),
            (["--log.format", "text"], "invalid choice: 'text'")):
        with pytest.raises(SystemExit) as exit:
            main(["sidecar", *argv])
        assert exit.value.code == 2
        assert message in capsys.readouterr().err, argv
