"""SIGHUP reloads the sidecar's settings at once, as Prometheus does (also with polling off), and
never ends it: a sidecar that was sent one keeps serving, with the file's new settings in force,
and still removes its sockets when it stops."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from support.sidecar import values
from support.waiting import terminate, wait_for

from bench.lib.ports import free_port

pytestmark = pytest.mark.timeout(90)


def _settings(run: Path, port: int, expiry: float) -> str:
    return (f"agents: {{unix_socket: {run / 'agent.sock'}, expiry_seconds: {expiry}}}\n"
            f"metrics: {{address: 127.0.0.1, port: {port}}}\n"
            "nvml: {enabled: false}\nlogging: {level: warning}\n"
            "reload: {enabled: false}\n")


def test_sighup_reloads_the_settings_and_never_ends_the_sidecar(tmp_path: Path) -> None:
    port, run = free_port(), tmp_path / "run"
    config = tmp_path / "sidecar.yaml"
    config.write_text(_settings(run, port, 60))
    process = subprocess.Popen([sys.executable, "-m", "exporter.cli", "sidecar", "--config",
                                str(config)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: urllib.request.urlopen(url + "/readyz", timeout=1).status == 200,
                 timeout=30, what="sidecar ready")
        process.send_signal(signal.SIGHUP)  # the file unchanged: nothing to do
        time.sleep(0.5)
        assert process.poll() is None
        config.write_text(_settings(run, port, 5))
        process.send_signal(signal.SIGHUP)
        wait_for(lambda: values(url, "allocwatch_config_reloads_total", result="ok") == [1.0],
                 timeout=10, what="the reload SIGHUP asked for")
        assert process.poll() is None
        assert urllib.request.urlopen(url + "/healthz", timeout=5).status == 200
        config.write_text("agents: {max_agents: -1}\n")  # refused, the settings in force stay
        process.send_signal(signal.SIGHUP)
        wait_for(lambda: values(url, "allocwatch_config_reloads_total", result="invalid")
                 == [1.0], timeout=10, what="the refused reload")
        assert process.poll() is None
    finally:
        terminate(process)
        _, stderr = process.communicate()
    assert process.returncode == 0, stderr.decode()[-2000:]
    assert not (run / "agent.sock").exists()
