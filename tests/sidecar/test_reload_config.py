"""Hot reload of the sidecar's YAML: a valid new file takes effect without a restart (rules,
initial settings, expiry), an invalid one is refused, logged and counted while the old settings
stay, a file caught mid-write is never applied, and a ConfigMap-style symlink swap is seen."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import pytest
from support.control import connect_agent, metric
from support.files import MountedVolume, hang_token_file, replace_text
from support.sidecar import FakeSource, scrape
from support.waiting import wait_for

from exporter.sidecar.app import SidecarThread
from exporter.sidecar.config import SidecarConfig, load_config
from exporter.sidecar.reload import ConfigWatcher

ae = pytest.importorskip("allocator_ext._core", reason="the allocator core is not built")

pytestmark = pytest.mark.timeout(60)


def settings_text(tmp_path: Path, extra: str = "", expiry: int = 60) -> str:
    return f"""
agents:
  unix_socket: {tmp_path}/run/agent.sock
  expiry_seconds: {expiry}
metrics: {{address: 127.0.0.1, port: 0}}
nvml: {{enabled: false}}
reload: {{interval_seconds: 0.05}}
{extra}
"""


STUCK_RULE = """
policy:
  interval: 0.05
  rules:
    - {name: stuck, metric: pending_events, above: 100, for: 0, cooldown: 1h, action: reclaim}
"""


def start(path: Path) -> SidecarThread:
    return SidecarThread(load_config(path), config_path=path).start()


def test_valid_file_takes_effect_invalid_is_refused(tmp_path: Path,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "allocwatch.yaml"
    path.write_text(settings_text(tmp_path))
    running = start(path)
    sidecar = running.sidecar
    source = FakeSource()
    source.bump(0, pending_events=500)
    agent = connect_agent(running, tmp_path, source)
    try:
        assert sidecar.policy.config.rules == ()
        # A new rule and a new expiry, no restart: the rule acts on the connected agent.
        replace_text(path, settings_text(tmp_path, STUCK_RULE, expiry=5))
        wait_for(lambda: [c for c in source.calls if c[0] == "reclaim"],
                 what="the reloaded rule to act")
        assert sidecar.registry.expiry_seconds == 5.0
        assert metric(running, "allocwatch_config_reloads_total", result="ok") == 1.0

        # Invalid: refused, logged naming the field, counted once, the old settings stay.
        with caplog.at_level(logging.ERROR, logger="exporter.reload"):
            replace_text(path, settings_text(tmp_path, STUCK_RULE.replace("above", "abov"), 7))
            wait_for(lambda: metric(running, "allocwatch_config_reloads_total",
                                    result="invalid") == 1.0, what="the refusal")
        (record,) = [r for r in caplog.records if "refused" in r.getMessage()]
        assert "policy.rules[0].abov: unknown setting" in record.reason  # type: ignore[attr-defined]
        assert [r.name for r in sidecar.policy.config.rules] == ["stuck"]
        assert sidecar.registry.expiry_seconds == 5.0
        assert metric(running, "allocwatch_config_last_reload_successful") == 0.0
        os.utime(path)  # the same bad content again: not counted twice
        replace_text(path, path.read_text())
        time.sleep(0.3)  # several polls
        assert metric(running, "allocwatch_config_reloads_total", result="invalid") == 1.0

        # Not YAML at all: refused too.
        replace_text(path, "agents: [unclosed\n")
        wait_for(lambda: metric(running, "allocwatch_config_reloads_total",
                                result="invalid") == 2.0, what="the YAML refusal")

        # Fixed: accepted, without the rule now.
        replace_text(path, settings_text(tmp_path, expiry=9))
        wait_for(lambda: sidecar.registry.expiry_seconds == 9.0, what="the fixed file")
        assert sidecar.policy.config.rules == ()
        assert metric(running, "allocwatch_config_last_reload_successful") == 1.0
    finally:
        agent.stop()
        running.stop()


def test_a_file_caught_mid_write_is_never_applied(tmp_path: Path) -> None:
    """`cat > file` truncates first: a poll can read the file empty (a valid document, all
    defaults, no rules) or cut short. Only content that reads the same on two polls in a row
    counts, so neither the moment's emptiness nor a half-written rule is applied or refused."""
    path = tmp_path / "allocwatch.yaml"
    path.write_text(settings_text(tmp_path, STUCK_RULE))
    applied: list[SidecarConfig] = []
    watcher = ConfigWatcher(path, apply=lambda config: applied.append(config) or [])
    full = settings_text(tmp_path, STUCK_RULE, expiry=5).encode()
    cut = full[:full.index(b"rules:") + len(b"rules:")]  # policy with its rules not yet written
    for reading in (b"", cut, full):  # each read once: a write in progress
        assert watcher.check(reading) is None
    assert (applied, watcher.counts()) == ([], ([], True))
    assert watcher.check(full) == "ok"  # the same content twice: settled
    (config,) = applied
    assert [r.name for r in config.policy.rules] == ["stuck"]
    assert config.agents.expiry_seconds == 5.0
    assert watcher.check(full) is None  # and applied once


def test_a_file_changed_while_the_sidecar_started_is_applied(tmp_path: Path) -> None:
    """The sidecar reads its settings, then starts watching: a file that changed in between no
    longer holds the settings in force, so the watcher applies it instead of taking it as
    current."""
    path = tmp_path / "allocwatch.yaml"
    path.write_text(settings_text(tmp_path))
    in_force = load_config(path)
    replace_text(path, settings_text(tmp_path, STUCK_RULE, expiry=5))
    applied: list[SidecarConfig] = []
    watcher = ConfigWatcher(path, apply=lambda config: applied.append(config) or [],
                            in_force=in_force)
    assert watcher.check() is None  # new to the watcher: it settles first
    assert watcher.check() == "ok"
    (config,) = applied
    assert [r.name for r in config.policy.rules] == ["stuck"]

    # The file that still holds the settings in force is current from the start.
    unchanged = ConfigWatcher(path, apply=lambda config: applied.append(config) or [],
                              in_force=load_config(path))
    assert (unchanged.check(), unchanged.check(), len(applied)) == (None, None, 1)


def test_fields_that_need_a_restart_keep_their_value(tmp_path: Path) -> None:
    path = tmp_path / "allocwatch.yaml"
    path.write_text(settings_text(tmp_path))
    running = start(path)
    sidecar = running.sidecar
    try:
        port = sidecar.http.port if sidecar.http else None
        text = settings_text(tmp_path, expiry=3).replace("port: 0", "port: 1")
        replace_text(path, text)
        wait_for(lambda: metric(running, "allocwatch_config_reloads_total",
                                result="partial") == 1.0, what="a partial reload")
        assert sidecar.registry.expiry_seconds == 3.0   # live: applied
        assert sidecar.config.metrics.port == 0         # listener: after a restart
        assert sidecar.http is not None and sidecar.http.port == port
    finally:
        running.stop()


def test_configmap_symlink_swap_and_new_initial_settings(tmp_path: Path) -> None:
    """Kubernetes updates a ConfigMap volume by pointing `..data` at a new directory."""
    volume = MountedVolume(tmp_path / "config", "allocwatch.yaml")
    volume.publish(settings_text(tmp_path))
    running = start(volume.path)
    allocator = ae.Allocator(ae.SimDevice(capacity=0), "native")
    agent = connect_agent(running, tmp_path, {0: allocator})
    try:
        volume.publish(settings_text(tmp_path, """
policy:
  interval: 0.05
  initial_settings: "garbage_collection_threshold:0.65"
"""))
        # The new initial settings reach the agent that is already connected.
        wait_for(lambda: allocator.config()["garbage_collection_threshold"] == 0.65,
                 what="the swapped file's initial settings")
        assert metric(running, "allocwatch_config_reloads_total", result="ok") == 1.0
    finally:
        agent.stop()
        running.stop()


def test_a_missing_file_keeps_the_settings(tmp_path: Path) -> None:
    path = tmp_path / "allocwatch.yaml"
    path.write_text(settings_text(tmp_path, STUCK_RULE))
    running = start(path)
    try:
        path.unlink()
        wait_for(lambda: metric(running, "allocwatch_config_reloads_total",
                                result="unreadable") == 1.0, what="the missing file noticed")
        assert [r.name for r in running.sidecar.policy.config.rules] == ["stuck"]
    finally:
        running.stop()


TOKEN = "4f1c0a9e7b2d4c6a8e0f1b3d5c7a9e2f"


def admin_settings(tmp_path: Path, token_file: Path) -> str:
    return settings_text(tmp_path, f"""
admin: {{unix_socket: "", tcp_port: 0, token_file: {token_file}}}
""")


def test_a_reload_naming_a_new_admin_token_file_reads_it_off_the_event_loop(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A reload that points admin.token_file at a new file: the new token takes over, the old
    one is refused. The new file is read on a worker thread: while its reading hangs (a network
    mount that stopped answering; here its stat blocks until the test lets it go), the sidecar
    answers scrapes and requests with the token in force."""
    from support.admin import call

    old_file, new_file = tmp_path / "old-token", tmp_path / "new-token"
    old_file.write_text(TOKEN + "\n")
    new_file.write_text(TOKEN[::-1] + "\n")
    path = tmp_path / "allocwatch.yaml"
    path.write_text(admin_settings(tmp_path, old_file))
    running = start(path)
    (address,) = running.sidecar.admin.addresses()
    release, reads = hang_token_file(monkeypatch, new_file)

    def status(token: str) -> int:
        return call(address, "GET", "/v1/agents", None, {"Authorization": f"Bearer {token}"})[0]

    try:
        assert status(TOKEN) == 200
        replace_text(path, admin_settings(tmp_path, new_file))
        wait_for(lambda: reads, what="the new token file's reading to start")
        wait_for(lambda: metric(running, "allocwatch_config_reloads_total", result="ok") == 1.0,
                 what="the reload to be counted while the token file hangs")
        assert status(TOKEN) == 200 and status(TOKEN[::-1]) == 401  # the token in force
        assert "allocwatch_config_reloads_total" in scrape(running.sidecar.metrics_url)[0]
        assert "allocwatch-sidecar" not in reads  # a worker thread, not the event loop's
        release.set()
        wait_for(lambda: status(TOKEN[::-1]) == 200, what="the new token to take over")
        assert status(TOKEN) == 401
    finally:
        release.set()
        running.stop()


EXIT_WHILE_TOKEN_FILE_HANGS = """
import asyncio, sys, threading
from pathlib import Path
from exporter.shared import tokens
from exporter.sidecar.app import Sidecar
from exporter.sidecar.config import load_config

config, new_file = Path(sys.argv[1]), Path(sys.argv[2])
real_stamp, reading = tokens.content_stamp, threading.Event()

def never_answers(name):  # a network mount that stopped answering, for good
    if Path(name) == new_file:
        reading.set()
        threading.Event().wait()
    return real_stamp(name)

tokens.content_stamp = never_answers

async def main():
    sidecar = Sidecar(load_config(config), config_path=config)
    await sidecar.start()
    config.write_text(sys.stdin.read())  # the reload that names the new token file
    while not reading.is_set():
        await asyncio.sleep(0.05)
    await sidecar.stop()

asyncio.run(main())
print("exited", flush=True)
"""


def test_a_sidecar_exits_while_a_reloaded_token_file_hangs(tmp_path: Path) -> None:
    """SIGTERM's path: the sidecar stops and asyncio.run returns, though the reload's reading of
    a new token file never ends. Read on a pool's thread (asyncio.to_thread), it held up the
    exit for good: asyncio.run waits for the pool."""
    import subprocess
    import sys

    from support.paths import REPO

    old_file, new_file = tmp_path / "old-token", tmp_path / "new-token"
    old_file.write_text(TOKEN + "\n")
    new_file.write_text(TOKEN[::-1] + "\n")
    path = tmp_path / "allocwatch.yaml"
    path.write_text(admin_settings(tmp_path, old_file))
    try:
        out = subprocess.run([sys.executable, "-c", EXIT_WHILE_TOKEN_FILE_HANGS, str(path),
                              str(new_file)], input=admin_settings(tmp_path, new_file),
                             cwd=REPO, capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired:
        pytest.fail("the sidecar did not exit within 30 s while the token file hung")
    assert out.returncode == 0 and out.stdout.strip() == "exited", out.stderr[-2000:]


def test_a_reload_logs_what_an_operator_reads_and_nothing_internal(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "allocwatch.yaml"
    path.write_text(settings_text(tmp_path))
    running = start(path)
    try:
        with caplog.at_level(logging.INFO, logger="exporter.reload"):
            replace_text(path, settings_text(tmp_path, expiry=5))
            wait_for(lambda: running.sidecar.registry.expiry_seconds == 5.0, what="the reload")
    finally:
        running.stop()
    (record,) = [r for r in caplog.records if r.getMessage() == "settings reloaded"]
    standard = {*vars(logging.makeLogRecord({})), "message", "asctime"}
    fields = {k for k in vars(record) if k not in standard}
    assert fields == {"path", "sha256", "needs_restart"}  # no stat signature of the file
