"""`allocwatch ctl` against a real sidecar over its Unix socket and over TCP with a token:
each command reaches exactly the selected agents, refusals exit 2 and change nothing."""

from __future__ import annotations

import gzip
import pickle
from pathlib import Path

import pytest
from support.control import connect_agent, start_control_sidecar, two_agents_running
from support.sidecar import FakeSource
from support.waiting import wait_for

from exporter.cli import main

pytestmark = pytest.mark.timeout(60)
TOKEN = "0a1b2c3d4e5f60718293a4b5c6d7e8f9"


@pytest.fixture
def two_agents(tmp_path: Path):
    with two_agents_running(tmp_path) as (_, address, sources):
        yield address, sources, tmp_path


def test_agents_set_reclaim_reset(two_agents, capsys: pytest.CaptureFixture[str]) -> None:
    address, (first, second), _ = two_agents
    assert main(["ctl", "--admin", address, "agents"]) == 0
    out = capsys.readouterr().out
    assert "node-a" in out and "node-b" in out and "40.0 MiB" in out
    # PEAK_FRAG: 35 MiB allocated of 44 MiB reserved at the fake source's peak.
    header, row = out.splitlines()[:2]
    assert row[header.index("PEAK_FRAG"):].split()[0] == f"{9 / 44:.2f}"

    # Options after the subcommand work as well as before it.
    assert main(["ctl", "set", "garbage_collection_threshold:0.6", "--admin", address,
                 "--rank", "1"]) == 0
    out = capsys.readouterr().out
    assert "1 agent(s)" in out and "settings in force:" in out
    assert "garbage_collection_threshold:0.6" in out
    assert first.calls == [] and second.calls == [("set_config",
                                                   "garbage_collection_threshold:0.6")]

    assert main(["ctl", "--admin", address, "--host", "node-a", "reclaim", "--all"]) == 0
    assert "released 10.0 MiB" in capsys.readouterr().out
    assert first.calls == [("reclaim", (0, True))] and len(second.calls) == 1

    assert main(["ctl", "--admin", address, "reset-peaks", "--job", "j2"]) == 0
    assert second.calls[-1] == ("reset_peaks", 0) and len(first.calls) == 1


def test_refusals_exit_2_and_change_nothing(two_agents,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    address, sources, _ = two_agents
    assert main(["ctl", "--admin", address, "set", "bogus_key:1"]) == 2
    assert "bogus_key" in capsys.readouterr().err
    assert main(["ctl", "--admin", address, "--rank", "9", "reclaim"]) == 2
    assert "no connected agent matches" in capsys.readouterr().err
    assert all(source.calls == [] for source in sources)
    assert main(["ctl", "--admin", "ftp://x", "agents"]) == 2


def test_agent_failures_exit_1(two_agents, capsys: pytest.CaptureFixture[str]) -> None:
    address, sources, _ = two_agents
    # FakeSource refuses keys it does not know, after the sidecar's validation let them through.
    assert main(["ctl", "--admin", address, "set", "roundup_power2_divisions:4"]) == 1
    out = capsys.readouterr().out
    assert out.count("invalid_argument") == 2 and "unknown allocator setting" in out


def test_snapshot_to_a_file_and_a_directory(two_agents,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    address, _, tmp_path = two_agents
    target = tmp_path / "one.pickle.gz"
    assert main(["ctl", "--admin", address, "snapshot", "--rank", "0", "-o", str(target)]) == 0
    assert pickle.loads(gzip.decompress(target.read_bytes()))["segments"]
    assert main(["ctl", "--admin", address, "snapshot", "-o", str(tmp_path / "x.gz")]) == 2
    assert "give a directory" in capsys.readouterr().err
    folder = tmp_path / "all"
    folder.mkdir()
    assert main(["ctl", "--admin", address, "snapshot", "-o", str(folder)]) == 0
    assert len(list(folder.glob("snapshot-*.pickle.gz"))) == 2


def test_tcp_with_token_file(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                             monkeypatch: pytest.MonkeyPatch) -> None:
    token = tmp_path / "token"
    token.write_text(TOKEN)
    wrong = tmp_path / "wrong"
    wrong.write_text("f" * 32)
    running = start_control_sidecar(tmp_path, admin={"unix_socket": "", "tcp_port": 0,
                                                     "token_file": str(token)})
    source = FakeSource()
    agent = connect_agent(running, tmp_path, source)
    (address,) = running.sidecar.admin.addresses()
    monkeypatch.delenv("ALLOCWATCH_ADMIN_TOKEN", raising=False)
    try:
        assert main(["ctl", "--admin", address, "reclaim"]) == 2
        assert "refused (401)" in capsys.readouterr().err
        assert main(["ctl", "--admin", address, "--token-file", str(wrong), "reclaim"]) == 2
        assert source.calls == []
        assert main(["ctl", "--admin", address, "--token-file", str(token), "reclaim"]) == 0
        assert source.calls == [("reclaim", (0, False))]
        monkeypatch.setenv("ALLOCWATCH_ADMIN_TOKEN", TOKEN)
        assert main(["ctl", "--admin", address, "agents", "--json"]) == 0
        assert '"agents"' in capsys.readouterr().out
    finally:
        agent.stop()
        running.stop()


def test_unreachable_sidecar_exits_3(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["ctl", "--admin", f"unix://{tmp_path}/none.sock", "agents"]) == 3
    assert "cannot reach the sidecar's admin API" in capsys.readouterr().err


def test_help_explains() -> None:
    with pytest.raises(SystemExit) as done:
        main(["ctl", "--help"])
    assert done.value.code == 0


def test_ctl_pointed_at_the_agents_socket_says_so(tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    running = start_control_sidecar(tmp_path)
    try:
        agents = running.sidecar.agent_targets[0]
        (admin,) = running.sidecar.admin.addresses()
        assert main(["ctl", "--admin", agents, "agents"]) == 3
    finally:
        running.stop()
    err = capsys.readouterr().err
    assert "Traceback" not in err and "BadStatusLine" not in err
    assert f"{agents} is not the sidecar's admin API: a gRPC server (HTTP/2) answered" in err
    assert f"is it the agents' socket? The admin API's is admin.sock beside it (--admin {admin}" \
        in err


def test_the_token_options_say_the_variable_holds_the_token(
        capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["ctl", "agents", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "file holding the bearer token, for http(s):// (default: the token itself in " \
        "$ALLOCWATCH_ADMIN_TOKEN)" in text


def test_help_wraps_at_spaces_never_inside_a_settings_string(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "80")
    with pytest.raises(SystemExit):
        main(["ctl", "set", "--help"])
    assert "expandable_segments:True,garbage_collection_threshold:0.8" in capsys.readouterr().out


def test_the_agents_table_names_settings_by_number_and_writes_each_out_once(
        two_agents, capsys: pytest.CaptureFixture[str]) -> None:
    address, _, _ = two_agents
    assert main(["ctl", "--admin", address, "agents"]) == 0
    lines = capsys.readouterr().out.splitlines()
    header, rows, legend = lines[0], lines[1:3], lines[3:]
    column = header.index("SETTINGS")
    assert [row[column:].strip() for row in rows] == ["#1", "#1"]  # the same settings
    [line] = legend
    assert line.startswith("settings #1: ") and len(line) > len("settings #1: ")
    assert main(["ctl", "--admin", address, "--rank", "1", "set",
                 "garbage_collection_threshold:0.6"]) == 0
    capsys.readouterr()

    def table() -> list[str]:  # once a report of the new settings reached the sidecar
        assert main(["ctl", "--admin", address, "agents"]) == 0
        lines = capsys.readouterr().out.splitlines()
        return lines if sorted(r[column:].strip() for r in lines[1:3]) == ["#1", "#2"] else []

    lines = wait_for(table, what="the changed settings in the agents' table")
    assert len(lines) == 5 and "garbage_collection_threshold:0.6" in lines[3] + lines[4]
    assert not any("garbage_collection_threshold" in row for row in lines[:3])  # only below
