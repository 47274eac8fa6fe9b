"""Hostile settings files: an alias bomb, an oversized file, duplicate keys, numbers that are not
numbers. Each is refused at once with a message that names the key and shows a short value, on
the command line and on a hot reload alike, and a reload never stalls the sidecar's event loop.

The alias bomb runs in a child process whose address space is capped, so that a parser which
expands it fails there (and the test with it) without taking the machine's memory.
"""

from __future__ import annotations

import os
import re
import resource
import subprocess
import sys
import textwrap
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from support.files import replace_text
from support.waiting import wait_for

from bench.lib.ports import free_port
from exporter.shared.config import ConfigError
from exporter.sidecar.config import load_config, parse_config

pytestmark = pytest.mark.timeout(120)

CHILD_ADDRESS_SPACE = 2 << 30  # a sidecar process maps about 0.8 GiB; the rest is headroom


def alias_bomb(levels: int = 9, width: int = 9) -> str:
    """`agents.max_agents` as the classic billion-laughs list: width**levels strings once
    expanded, a few hundred bytes as written."""
    anchors = ['&l0 [' + ", ".join(['"lol"'] * width) + "]"]
    for level in range(1, levels):
        anchors.append(f"&l{level} [" + ", ".join([f"*l{level - 1}"] * width) + "]")
    return "agents:\n  max_agents: [" + ", ".join(anchors) + "]\n"


def _capped() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (CHILD_ADDRESS_SPACE, CHILD_ADDRESS_SPACE))


def _cli(*args: str, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "exporter.cli", "sidecar", *args],
                          capture_output=True, text=True, timeout=timeout, preexec_fn=_capped)


def test_an_alias_bomb_is_refused_at_once_by_check_config(tmp_path: Path) -> None:
    path = tmp_path / "bomb.yaml"
    path.write_text(alias_bomb())
    started = time.monotonic()
    result = _cli("--config", str(path), "--check-config", timeout=20)
    assert time.monotonic() - started < 10
    assert result.returncode == 2, result.stderr[-2000:]
    assert "invalid settings" in result.stderr and "alias" in result.stderr
    assert len(result.stderr) < 1000  # one short message, no expanded value


def _get(url: str, timeout: float) -> int:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return response.status


def _metric(url: str, name: str, label: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=5) as response:
        text = response.read().decode()
    for line in text.splitlines():
        if line.startswith(name) and label in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_an_alias_bomb_on_reload_is_refused_and_the_sidecar_keeps_serving(
        tmp_path: Path) -> None:
    port = free_port()
    path = tmp_path / "allocwatch.yaml"
    good = (f"agents: {{unix_socket: {tmp_path}/run/agent.sock}}\n"
            f"metrics: {{address: 127.0.0.1, port: {port}}}\n"
            "nvml: {enabled: false}\nreload: {interval_seconds: 0.1}\n")
    path.write_text(good)
    sidecar = subprocess.Popen([sys.executable, "-m", "exporter.cli", "sidecar", "--config",
                                str(path)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                               preexec_fn=_capped)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: _get(url + "/healthz", 1) == 200, timeout=30, what="sidecar up")
        replace_text(path, good + alias_bomb().replace("agents:\n", "admin:\n").replace(
            "max_agents", "command_timeout_seconds"))
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:  # the event loop answers throughout
            # 3 s: a loaded machine's delay, well short of what expanding the bomb would take.
            assert _get(url + "/healthz", 3) == 200
            time.sleep(0.1)
        assert _metric(url, "allocwatch_config_reloads_total", 'result="invalid"') == 1.0
        sidecar.terminate()
        assert sidecar.wait(10) == 0  # SIGTERM still heard
    finally:
        sidecar.kill()
        stderr = sidecar.communicate()[1]
    assert b"alias" in stderr and len(stderr) < 20000


def test_a_file_over_one_mebibyte_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "big.yaml"
    path.write_text("# padding\n" * 120_000 + "agents: {max_agents: 3}\n")
    with pytest.raises(ConfigError, match="larger than 1048576 bytes"):
        load_config(path)


def test_deep_nesting_is_refused_at_once(tmp_path: Path) -> None:
    path = tmp_path / "deep.yaml"
    path.write_text("agents: {max_agents: " + "[" * 50_000 + "]" * 50_000 + "}\n")
    # This thread's CPU time, not the wall clock: the refusal takes about 0.3 s of CPU, which a
    # loaded machine can stretch past the bound; composing all 50,000 levels takes seconds.
    started = time.thread_time()
    with pytest.raises(ConfigError, match="nested deeper than 32 levels"):
        load_config(path)
    assert time.thread_time() - started < 1.0


def test_a_file_whose_parse_exhausts_the_memory_is_a_refused_file(tmp_path: Path) -> None:
    """A file within the size limit can still take more memory than a small container has
    (PyYAML builds objects for every node): --check-config, in a child whose address space
    is capped 48 MiB above what it has mapped once it has checked a small file, refuses it by
    name."""
    path = tmp_path / "wide.yaml"
    path.write_text("agents:\n  max_agents: [" + "0, " * 340_000 + "0]\n")
    (tmp_path / "empty.yaml").write_text("{}\n")
    child = textwrap.dedent("""\
        import resource, sys
        from exporter.cli import main
        assert main(["sidecar", "--config", sys.argv[2], "--check-config"]) == 0  # imports
        mapped = int(open("/proc/self/statm").read().split()[0]) * resource.getpagesize()
        resource.setrlimit(resource.RLIMIT_AS, (mapped + (48 << 20),) * 2)
        sys.exit(main(["sidecar", "--config", sys.argv[1], "--check-config"]))
        """)
    result = subprocess.run([sys.executable, "-c", child, str(path), str(tmp_path / "empty.yaml")],
                            capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 2, result.stderr[-800:]
    assert "exhausted the memory" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.parametrize("text, key", [
    ("agents:\n  max_agents: 3\n  max_agents: 4\n", "max_agents"),
    ("agents: {expiry_seconds: 1}\nagents: {expiry_seconds: 2}\n", "agents"),
], ids=["in a section", "a section"])
def test_a_duplicate_key_is_refused_naming_it(tmp_path: Path, text: str, key: str) -> None:
    path = tmp_path / "dup.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=f"duplicate key '{key}'"):
        load_config(path)


@pytest.mark.parametrize("text, key", [
    ('admin: {tcp_port: 9000, token_file: "/run/token\\0x"}', "admin.token_file"),
    ('agents: {unix_socket: "/run/allocwatch/agent.sock\\0"}', "agents.unix_socket"),
    ('policy: {initial_settings: "garbage_collection_threshold:0.6\\0"}',
     "policy.initial_settings"),
])
def test_a_nul_character_in_a_setting_is_refused_naming_it(tmp_path: Path, text: str,
                                                           key: str) -> None:
    """YAML's "\\0" is a NUL character, which no path or settings string holds: refused by
    name at load, not a ValueError from open() or bind() later."""
    path = tmp_path / "nul.yaml"
    path.write_text(text + "\n")
    with pytest.raises(ConfigError, match=f"{re.escape(key)}: a NUL character"):
        load_config(path)


@pytest.mark.parametrize("raw, message", [
    ({"agents": {"expiry_seconds": float("nan")}}, "agents.expiry_seconds: expected a finite"),
    ({"agents": {"hello_timeout_seconds": float("nan")}},
     "agents.hello_timeout_seconds: expected a finite"),
    ({"agents": {"expiry_seconds": float("inf")}}, "agents.expiry_seconds: expected a finite"),
    ({"admin": {"command_timeout_seconds": float("nan")}},
     "admin.command_timeout_seconds: expected a finite"),
    ({"policy": {"command_timeout": float("nan")}}, "policy.command_timeout"),
    ({"nvml": {"cache_seconds": float("nan")}}, "nvml.cache_seconds: expected a finite"),
    ({"nvml": {"cache_seconds": -1}}, "nvml.cache_seconds: must be at least 0"),
    ({"agents": {"max_message_bytes": 10_000_000_000}},
     "agents.max_message_bytes: must be at most 67108864, got 10000000000"),
    ({"agents": {"max_agents": 10**30}}, "agents.max_agents: must be at most"),
    ({"reload": {"interval_seconds": 1e300}}, "reload.interval_seconds: must be at most"),
])
def test_numbers_are_finite_and_within_their_range(raw: dict, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_config(raw)
    assert message in str(err.value)


def test_max_message_bytes_too_large_for_grpc_is_refused_by_check_config(
        tmp_path: Path) -> None:
    path = tmp_path / "s.yaml"
    path.write_text("agents: {max_message_bytes: 10000000000}\n")
    result = _cli("--config", str(path), "--check-config", timeout=60)
    assert result.returncode == 2 and "agents.max_message_bytes" in result.stderr


@pytest.mark.parametrize("value, shown", [
    ("[" + ", ".join(["1"] * 5000) + "]", "a list of 5000 items"),
    ("{" + ", ".join(f"k{i}: {i}" for i in range(3000)) + "}", "a mapping of 3000 keys"),
    ('"' + "x" * 5000 + '"', "'xxxxxxxx"),
], ids=["list", "mapping", "string"])
def test_a_wrong_value_is_shown_short(tmp_path: Path, value: str, shown: str) -> None:
    path = tmp_path / "s.yaml"
    path.write_text(f"agents:\n  max_agents: {value}\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    message = str(err.value)
    assert "agents.max_agents: expected an integer" in message and shown in message
    assert len(message) < 300


@pytest.mark.parametrize("settings", [
    "agents: {tcp_port: 0, token_file: FILE}",
    "admin: {tcp_port: 0, token_file: FILE}",
    "agents: {tcp_port: 0, tls_cert_file: FILE, tls_key_file: FILE, tls_client_ca_file: FILE}",
    None,
], ids=["agents.token_file", "admin.token_file", "agents.tls_cert_file", "the settings file"])
def test_a_file_that_never_ends_is_refused_at_once(tmp_path: Path, settings: str | None
                                                   ) -> None:
    """A FIFO (which no writer ever fills) or a device (/dev/zero) where a file is named:
    --check-config refuses it at once, naming it, instead of waiting or reading forever."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for endless in (str(fifo), "/dev/zero"):
        path = tmp_path / "s.yaml"
        if settings is not None:
            path.write_text(settings.replace("FILE", endless) + "\n")
        result = _cli("--config", endless if settings is None else str(path), "--check-config",
                      timeout=20)
        assert result.returncode == 2, (endless, result.stderr[-500:])
        assert "not a regular file" in result.stderr, result.stderr[-500:]


def test_a_settings_file_swapped_for_a_fifo_holds_up_no_reload(tmp_path: Path) -> None:
    from exporter.sidecar.reload import ConfigWatcher

    path = tmp_path / "allocwatch.yaml"
    path.write_text("nvml: {enabled: false}\n")
    watcher = ConfigWatcher(path, apply=lambda config: [])
    path.unlink()
    os.mkfifo(path)
    polled = threading.Thread(target=watcher.check, daemon=True)
    polled.start()
    polled.join(5)
    assert not polled.is_alive(), "a poll of the FIFO never returned"
    assert watcher.counts() == ([("unreadable", 1)], True)
