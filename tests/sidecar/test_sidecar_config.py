"""The sidecar's YAML settings: defaults, validation naming the field, and the command line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from exporter.cli import build_parser, main
from exporter.shared.config import ConfigError
from exporter.sidecar.config import load_config, parse_config


def test_defaults() -> None:
    config = load_config(None)
    assert config.agents.unix_socket == "/run/allocwatch/agent.sock"
    assert config.agents.socket_mode == 0o660
    assert config.agents.tcp_port is None and config.agents.tcp_address == "127.0.0.1"
    assert config.metrics.address == "0.0.0.0"  # scraped from outside the pod
    assert config.logging.format == "auto"  # logfmt on a terminal, JSON in a container's log
    assert config.metrics.path == "/metrics"


def test_full_file(tmp_path: Path) -> None:
    path = tmp_path / "s.yaml"
    path.write_text("""
agents:
  unix_socket: /shared/agent.sock
  socket_mode: 0600
  tcp_port: 7070
  token_file: /shared/agent-token
  expiry_seconds: 5
metrics: {port: 9100}
nvml: {enabled: false}
logging: {level: debug, format: logfmt}
""")
    config = load_config(path)
    assert config.agents.socket_mode == 0o600
    assert config.agents.tcp_port == 7070 and config.agents.expiry_seconds == 5.0
    assert config.metrics.port == 9100 and not config.nvml.enabled
    assert config.logging.level == "debug" and config.logging.format == "logfmt"


@pytest.mark.parametrize("raw, message", [
    ({"agents": {"expiry_secnds": 3}}, "agents.expiry_secnds: unknown setting (known here: "),
    ({"metrix": {}}, "metrix: unknown setting"),
    ({"agents": {"tcp_port": "x"}}, "agents.tcp_port: expected an integer, got str 'x'"),
    ({"agents": {"tcp_port": 70000}}, "agents.tcp_port: must be a port number"),
    ({"agents": {"expiry_seconds": -1}}, "agents.expiry_seconds: must be greater than 0"),
    ({"agents": {"socket_mode": "rw"}}, "agents.socket_mode: expected an octal mode"),
    ({"agents": {"socket_mode": 0o1777}}, "agents.socket_mode: must be a file mode"),
    ({"nvml": {"enabled": "yes"}}, "nvml.enabled: expected true or false, got 'yes'"),
    ({"logging": {"level": "loud"}}, "logging.level: must be one of debug, info, warning"),
    ({"agents": [1, 2]}, "agents: expected a mapping of settings, got a list of 2 items"),
    ({"agents": {"unix_socket": "", "tcp_port": None}}, "agents: no listener"),
    ("just text", "the settings file: expected a mapping"),
])
def test_wrong_fields_are_named(raw: object, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_config(raw)
    assert message in str(err.value)


def test_bad_yaml_and_missing_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("agents: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    with pytest.raises(ConfigError, match="cannot read settings file"):
        load_config(tmp_path / "absent.yaml")


def test_cli_refuses_a_wrong_field_with_its_name(tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "s.yaml"
    path.write_text("agents:\n  expiry_secnds: 3\n")
    assert main(["sidecar", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert "invalid settings" in err and "agents.expiry_secnds: unknown setting" in err
    path.write_text("agents:\n  expiry_seconds: 3\n")
    assert main(["sidecar", "--config", str(path), "--check-config"]) == 0


def test_cli_unwritable_socket_directory_is_a_clear_error(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    path = tmp_path / "s.yaml"
    path.write_text(f"agents:\n  unix_socket: {blocker}/sub/agent.sock\nmetrics:\n  port: 0\n"
                    "nvml:\n  enabled: false\n")
    result = subprocess.run([sys.executable, "-m", "exporter.cli", "sidecar", "--config",
                             str(path)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    assert "cannot create the socket directory" in result.stderr


def test_help_explains_every_command() -> None:
    parser = build_parser()
    text = parser.format_help()
    for name in ("sidecar", "demo"):
        assert name in text
    result = subprocess.run([sys.executable, "-m", "exporter.cli", "demo", "--help"],
                            capture_output=True, text=True, timeout=60)
    assert "--duration" in result.stdout and "simulated device" in result.stdout


def _sidecar_cli(tmp_path: Path, *extra: str) -> tuple[subprocess.Popen, Path, str]:
    from bench.lib.ports import free_port

    port = free_port()
    socket_path = tmp_path / "run" / "agent.sock"
    path = tmp_path / "s.yaml"
    path.write_text(f"agents:\n  unix_socket: {socket_path}\nmetrics:\n  address: 127.0.0.1\n"
                    f"  port: {port}\nnvml:\n  enabled: false\n")
    proc = subprocess.Popen([sys.executable, "-m", "exporter.cli", "sidecar", "--config",
                             str(path), *extra])
    return proc, socket_path, f"http://127.0.0.1:{port}"


def test_exit_after_training_on_the_marker_file(tmp_path: Path) -> None:
    import time

    from support.sidecar import values
    from support.waiting import wait_for

    proc, socket_path, url = _sidecar_cli(tmp_path, "--exit-after-training")
    try:
        wait_for(lambda: values(url, "allocwatch_agents_connected") == [0.0], timeout=20,
                 what="sidecar up")
        time.sleep(1.0)
        assert proc.poll() is None  # no agent yet: only the file ends it
        (socket_path.parent / "training-done").touch()
        assert proc.wait(20) == 0
    finally:
        proc.kill()
        proc.wait()


def test_exit_after_training_when_every_agent_is_gone(tmp_path: Path) -> None:
    from support.sidecar import FakeSource, values
    from support.waiting import wait_for

    from allocator_ext.agent import start_agent

    proc, socket_path, url = _sidecar_cli(tmp_path, "--exit-after-training", "--exit-grace",
                                          "1")
    try:
        wait_for(lambda: values(url, "allocwatch_agents_connected") == [0.0], timeout=20,
                 what="sidecar up")
        agent = start_agent(f"unix://{socket_path}", interval=0.1, source=FakeSource(),
                            nvml=False, stop_at_exit=False)
        wait_for(lambda: values(url, "allocwatch_agents_connected") == [1.0], what="agent")
        assert proc.poll() is None
        agent.stop()
        assert proc.wait(20) == 0
    finally:
        proc.kill()
        proc.wait()
