"""The admin API over real sockets and real HTTP: selection reaches exactly the chosen agents,
bad values and bad tokens are refused and change nothing, the token never shows in logs or
metrics, and snapshots come back with their path and bytes."""

from __future__ import annotations

import gzip
import logging
import os
import pickle
import stat
import threading
from pathlib import Path

import pytest
from support.admin import call
from support.control import connect_agent, metric, start_control_sidecar
from support.files import MountedVolume, hang_token_file
from support.sidecar import FakeSource, MiB, scrape
from support.waiting import wait_for

from exporter.shared.config import ConfigError
from exporter.sidecar.config import parse_config

ae = pytest.importorskip("allocator_ext._core", reason="the allocator core is not built")

pytestmark = pytest.mark.timeout(60)
TOKEN = "4f1c0a9e7b2d4c6a8e0f1b3d5c7a9e2f"


def test_unix_socket_is_private_and_lists_agents_by_selector(two_agents) -> None:
    running, address, _ = two_agents
    mode = stat.S_IMODE(Path(address[len("unix://"):]).stat().st_mode)
    assert mode == 0o600
    status, answer = call(address, "GET", "/v1/agents")
    assert status == 200 and sorted(a["rank"] for a in answer["agents"]) == [0, 1]
    for query, rank in (("rank=1", 1), ("host=node-a", 0), ("job=j2", 1)):
        status, answer = call(address, "GET", f"/v1/agents?{query}")
        assert status == 200 and [a["rank"] for a in answer["agents"]] == [rank], query
    (device,) = answer["agents"][0]["devices"]
    assert device["reserved_bytes"] == 40 * MiB and device["allocated_bytes"] == 30 * MiB
    assert device["fragmentation_ratio"] == pytest.approx(0.25)
    assert call(address, "GET", "/v1/agents?rank=7")[1]["agents"] == []
    assert call(address, "GET", "/v1/agents?colour=red")[0] == 400


def test_each_request_is_logged_with_its_method_as_sent(
        two_agents, caplog: pytest.LogCaptureFixture) -> None:
    _, address, _ = two_agents
    with caplog.at_level(logging.INFO, logger="exporter.admin"):
        assert call(address, "GET", "/v1/agents")[0] == 200
        assert call(address, "POST", "/v1/reset-peaks", {"rank": 0})[0] == 200
        wait_for(lambda: len([r for r in caplog.records
                              if r.getMessage() == "admin request"]) == 2,
                 what="both requests logged")
    methods = [r.method for r in caplog.records  # type: ignore[attr-defined]
               if r.getMessage() == "admin request"]
    assert methods == ["GET", "POST"]  # as sent: not the repr of a string ("'GET'")


def test_commands_reach_exactly_the_selected_agents(two_agents) -> None:
    running, address, (first, second) = two_agents
    status, answer = call(address, "POST", "/v1/settings",
                          {"settings": "garbage_collection_threshold:0.6", "rank": 1})
    assert status == 200 and answer["ok"] and answer["selected"] == 1
    (result,) = answer["results"]
    assert result["rank"] == 1 and result["status"] == "ok"
    assert "garbage_collection_threshold:0.6" in result["settings_in_force"][0]["config_string"]
    assert first.calls == [] and second.calls == [("set_config",
                                                   "garbage_collection_threshold:0.6")]

    status, answer = call(address, "POST", "/v1/reclaim", {"mode": "all", "host": "node-a"})
    assert status == 200 and [r["rank"] for r in answer["results"]] == [0]
    assert answer["results"][0]["bytes_released"] == 10 * MiB
    assert answer["results"][0]["sync_seconds"] >= 0
    assert first.calls == [("reclaim", (0, True))] and len(second.calls) == 1

    assert call(address, "POST", "/v1/reset-peaks", {"job": "j2"})[0] == 200
    assert second.calls[-1] == ("reset_peaks", 0) and len(first.calls) == 1

    status, answer = call(address, "POST", "/v1/reclaim", {})  # no selector: every agent
    assert status == 200 and answer["selected"] == 2
    assert first.calls[-1] == ("reclaim", (0, False)) == second.calls[-1]


def test_bad_values_are_refused_and_change_nothing(tmp_path: Path) -> None:
    running = start_control_sidecar(tmp_path)
    allocator = ae.Allocator(ae.SimDevice(capacity=0), "native")
    agent = connect_agent(running, tmp_path, {0: allocator})
    (address,) = running.sidecar.admin.addresses()
    before = allocator.config_string()
    try:
        cases = [
            ("/v1/settings", {"settings": "garbage_collection_threshold:0.6,bogus_key:1"},
             400, "bogus_key"),
            ("/v1/settings", {"settings": "garbage_collection_threshold:1.5"}, 400,
             "garbage_collection_threshold"),
            ("/v1/settings", {"settings": ""}, 400, "settings"),
            ("/v1/settings", {"settings": "expandable_segments:True", "colour": 1}, 400,
             "unknown field 'colour'"),
            ("/v1/settings", {"settings": "expandable_segments:True", "rank": "first"}, 400,
             "rank: expected an integer"),
            ("/v1/settings", {"settings": "expandable_segments:True", "rank": 5}, 404,
             "no connected agent matches"),
            ("/v1/reclaim", {"mode": "everything"}, 400, "mode: must be gc or all"),
            ("/v1/snapshot", {"frames": "yes"}, 400, "frames: expected true or false"),
            ("/v1/reclaim", b"{not json", 400, "not JSON"),
            ("/v1/reclaim", [1, 2], 400, "JSON object"),
        ]
        for path, body, code, message in cases:
            status, answer = call(address, "POST", path, body)
            assert status == code and message in answer["error"], (body, answer)
        assert call(address, "GET", "/v1/settings")[0] == 405
        assert call(address, "POST", "/v1/reboot", {})[0] == 404
        assert allocator.config_string() == before
        assert allocator.stats()["num_empty_cache_calls"] == 0
        assert metric(running, "allocwatch_commands_total") == 0.0  # nothing reached the agent
        assert metric(running, "allocwatch_admin_requests_total", endpoint="/v1/settings",
                      code="400") == 5.0
    finally:
        agent.stop()
        running.stop()


def test_tcp_needs_the_right_token_and_never_shows_it(tmp_path: Path,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    running = start_control_sidecar(tmp_path, admin={
        "unix_socket": "", "tcp_port": 0, "token_file": str(token_file)})
    source = FakeSource()
    agent = connect_agent(running, tmp_path, source)
    (address,) = running.sidecar.admin.addresses()
    assert address.startswith("http://127.0.0.1:")  # loopback by default
    body = {"settings": "garbage_collection_threshold:0.6"}
    try:
        with caplog.at_level(logging.DEBUG):
            for headers in ({}, {"Authorization": "Bearer wrong"},
                            {"Authorization": f"Bearer {TOKEN}x"},
                            {"Authorization": f"Bearer {TOKEN[:-1]}"},
                            {"Authorization": TOKEN},  # no scheme
                            {"Authorization": f"Basic {TOKEN}"}):
                assert call(address, "POST", "/v1/settings", body, headers)[0] == 401, headers
                assert call(address, "GET", "/v1/agents", None, headers)[0] == 401
            assert source.calls == []  # nothing changed
            good = {"Authorization": f"Bearer {TOKEN}"}
            status, answer = call(address, "GET", "/v1/agents", None, good)
            assert status == 200 and len(answer["agents"]) == 1
            assert call(address, "POST", "/v1/settings", body, good)[0] == 200
            assert source.calls == [("set_config", "garbage_collection_threshold:0.6")]
        text, _ = scrape(running.sidecar.metrics_url)
        assert TOKEN not in text
        assert metric(running, "allocwatch_admin_requests_total", code="401") == 12.0
        for record in caplog.records:
            assert TOKEN not in repr(vars(record)) and TOKEN[:-1] not in repr(vars(record))
        # Counted, and warned about at most five times a minute (a client may send thousands).
        assert metric(running, "allocwatch_refused_total", reason="admin_token") == 12.0
        refused = [r for r in caplog.records if r.getMessage() == "admin request refused"
                   and getattr(r, "status", 0) == 401]
        assert len(refused) == 5 and refused[0].levelno == logging.WARNING
    finally:
        agent.stop()
        running.stop()


def test_a_rotated_secret_takes_effect_at_the_next_request(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The kubelet updates a mounted Secret by pointing its `..data` symlink at a new
    directory: the next request on TCP is checked against the new token, no reload, no
    restart. A token file that then cannot be used leaves the token in force."""
    secret = MountedVolume(tmp_path / "secret", "token")

    secret.publish(TOKEN + "\n")
    running = start_control_sidecar(tmp_path, admin={
        "unix_socket": "", "tcp_port": 0, "token_file": str(secret.path)})
    (address,) = running.sidecar.admin.addresses()
    rotated = TOKEN[::-1]
    try:
        assert call(address, "GET", "/v1/agents", None, bearer(TOKEN))[0] == 200
        secret.publish(rotated + "\n")
        assert call(address, "GET", "/v1/agents", None, bearer(TOKEN))[0] == 401
        assert call(address, "GET", "/v1/agents", None, bearer(rotated))[0] == 200

        with caplog.at_level(logging.ERROR, logger="exporter.tokens"):
            secret.publish("short\n")  # too short to be a token: refused, the rotated one stays
            assert call(address, "GET", "/v1/agents", None, bearer(rotated))[0] == 200
            assert call(address, "GET", "/v1/agents", None, bearer(rotated))[0] == 200
        (refusal,) = [r for r in caplog.records if "cannot be used" in r.getMessage()]
        assert "shorter than 16 bytes" in refusal.reason  # type: ignore[attr-defined]
        assert call(address, "GET", "/v1/agents", None, bearer("short"))[0] == 401
    finally:
        running.stop()


def test_a_token_file_that_stops_answering_holds_up_neither_requests_nor_scrapes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A token file on a network mount whose server stops answering (a hung NFS mount) must
    not stall the sidecar's event loop, which answers the scrapes too: a request waits at most
    FILE_CHECK_TIMEOUT_S and goes on with the token in force, later ones go on at once while
    the file still hangs, and once it answers, a rotated token is read again. No mount can
    be made to hang here (no NFS server, no FUSE): the token file's stat blocks instead,
    until the test lets it go."""

    path = tmp_path / "token"
    path.write_text(TOKEN + "\n")
    running = start_control_sidecar(tmp_path, admin={
        "unix_socket": "", "tcp_port": 0, "token_file": str(path)})
    (address,) = running.sidecar.admin.addresses()
    release, stats = hang_token_file(monkeypatch, path)
    first: list[int] = []
    waiting = threading.Thread(
        target=lambda: first.append(call(address, "GET", "/v1/agents", None, bearer(TOKEN))[0]))
    try:
        with caplog.at_level(logging.ERROR, logger="exporter.tokens"):
            waiting.start()
            wait_for(lambda: stats, what="the token file's check to start")
            # The check hangs in a thread of its own: the loop serves a scrape meanwhile.
            assert "allocwatch_admin_requests_total" in scrape(running.sidecar.metrics_url)[0]
            waiting.join(10)
            assert first == [200]  # after FILE_CHECK_TIMEOUT_S, with the token in force
            assert call(address, "GET", "/v1/agents", None, bearer(TOKEN))[0] == 200
            assert call(address, "GET", "/v1/agents", None, bearer(TOKEN[::-1]))[0] == 401
            assert len(stats) == 1  # no new check while the first still hangs
        hangs = [r for r in caplog.records if "has not answered" in r.getMessage()]
        assert len(hangs) == 1
        assert stats[0].startswith("allocwatch-admin-token-file")
        path.write_text(TOKEN[::-1] + "\n")
        release.set()
        wait_for(lambda: call(address, "GET", "/v1/agents", None, bearer(TOKEN[::-1]))[0] == 200,
                 what="the rotated token to be read once the file answers")
    finally:
        release.set()
        running.stop()


def test_a_new_token_that_cannot_be_used_or_comes_late_leaves_the_right_token_in_force(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """What a settings reload hands the admin server (set_token): a token file without a usable
    token leaves the token in force, logged; of two new token files, the one named later wins
    even when the earlier one's reading ends after it."""
    import asyncio

    from exporter.admin.config import AdminConfig

    first = tmp_path / "token"
    first.write_text(TOKEN + "\n")
    running = start_control_sidecar(tmp_path, admin={
        "unix_socket": "", "tcp_port": 0, "token_file": str(first)})
    admin = running.sidecar.admin
    (address,) = admin.addresses()

    def status(token: str) -> int:
        return call(address, "GET", "/v1/agents", None, bearer(token))[0]

    def named(path: Path) -> AdminConfig:
        return AdminConfig(unix_socket="", tcp_port=0, token_file=str(path))

    short, slow, late = tmp_path / "short", tmp_path / "slow", tmp_path / "late"
    short.write_text("short\n")
    slow.write_text("s" * 32 + "\n")
    late.write_text("l" * 32 + "\n")
    release, reads = hang_token_file(monkeypatch, slow)
    try:
        with caplog.at_level(logging.ERROR, logger="exporter.admin"):
            running.call(admin.set_token(named(short)))
        (refusal,) = [r for r in caplog.records if "cannot be read" in r.getMessage()]
        assert "shorter than 16 bytes" in refusal.reason  # type: ignore[attr-defined]
        assert status(TOKEN) == 200 and status("short") == 401

        earlier = asyncio.run_coroutine_threadsafe(admin.set_token(named(slow)), running.loop)
        wait_for(lambda: reads, what="the earlier token file's reading to start")
        running.call(admin.set_token(named(late)))
        assert status("l" * 32) == 200 and status(TOKEN) == 401
        release.set()
        earlier.result(10)  # its reading ended after the later one's: it changes nothing
        assert status("l" * 32) == 200 and status("s" * 32) == 401
    finally:
        release.set()
        running.stop()


def test_a_token_file_read_while_it_was_written_is_read_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A token rewritten in place can be read cut short, yet 16 bytes or more: such a read is
    not put in force; the next request reads the file again and takes the whole token."""
    from exporter.admin.config import AdminConfig
    from exporter.shared import tokens

    path = tmp_path / "token"
    path.write_text(TOKEN + "\n")
    rotating = tokens.RotatingToken(AdminConfig(token_file=str(path)), "admin")
    rotated = TOKEN[::-1] + "0123456789"
    cut = rotated[:20]
    path.write_text(cut + "\n")
    real_read = tokens.read_token

    def read_then_the_writer_finishes(config: AdminConfig, path_name: str) -> bytes | None:
        token = real_read(config, path_name)
        path.write_text(rotated + "\n")
        return token

    monkeypatch.setattr(tokens, "read_token", read_then_the_writer_finishes)
    assert rotating.current() == TOKEN.encode()  # the cut read is not in force
    monkeypatch.setattr(tokens, "read_token", real_read)
    assert rotating.current() == rotated.encode()


def _swap_in(path: Path, token: str, mode: int, owner: int | None = None) -> None:
    """Another file put in place of the token file (a rename: what a user who may write in
    the directory, though not the file, can do)."""
    staged = path.with_name("staged")
    staged.write_text(token + "\n")
    os.chmod(staged, mode)
    if owner is not None:
        os.chown(staged, owner, -1)
    os.replace(staged, path)


def test_a_swapped_token_file_writable_by_more_users_is_not_trusted(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from exporter.admin.config import AdminConfig
    from exporter.shared.tokens import RotatingToken

    path = tmp_path / "token"
    path.write_text(TOKEN + "\n")
    os.chmod(path, 0o400)
    rotating = RotatingToken(AdminConfig(token_file=str(path)), "admin")
    planted = TOKEN[::-1]
    with caplog.at_level(logging.ERROR, logger="exporter.tokens"):
        _swap_in(path, planted, 0o666)
        assert rotating.current() == TOKEN.encode()
    (refusal,) = [r for r in caplog.records if "cannot be used" in r.getMessage()]
    assert "writable by more users (mode 0666)" in refusal.reason  # type: ignore[attr-defined]
    _swap_in(path, planted, 0o440)  # as a Secret's file is: taken
    assert rotating.current() == planted.encode()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a file another owner")
def test_a_swapped_token_file_of_another_owner_is_not_trusted(tmp_path: Path) -> None:
    from exporter.admin.config import AdminConfig
    from exporter.shared.tokens import RotatingToken

    path = tmp_path / "token"
    path.write_text(TOKEN + "\n")
    rotating = RotatingToken(AdminConfig(token_file=str(path)), "admin")
    _swap_in(path, TOKEN[::-1], 0o400, owner=54321)  # neither root, us, nor the first owner
    assert rotating.current() == TOKEN.encode()
    _swap_in(path, TOKEN[::-1], 0o400, owner=0)
    assert rotating.current() == TOKEN[::-1].encode()


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def test_token_from_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AW_TEST_ADMIN_TOKEN", TOKEN)
    running = start_control_sidecar(tmp_path, admin={"tcp_port": 0,
                                                     "token_env": "AW_TEST_ADMIN_TOKEN"})
    try:
        unix, tcp = running.sidecar.admin.addresses()
        assert call(tcp, "GET", "/v1/agents")[0] == 401
        assert call(tcp, "GET", "/v1/agents", None, {"Authorization": f"Bearer {TOKEN}"})[0] == 200
        assert call(unix, "GET", "/v1/agents")[0] == 200  # the socket's mode guards it
    finally:
        running.stop()


@pytest.mark.parametrize("admin, message", [
    ({"tcp_port": 9000}, "admin.tcp_port: the admin API listens on TCP only with a bearer token"),
    ({"tcp_port": 9000, "token_env": "AW_SURELY_UNSET_VARIABLE"}, "token is empty"),
    ({"tcp_port": 9000, "token_file": "/nonexistent/token"}, "admin.token_file: cannot read"),
    ({"socket_mode": "0666"}, "admin.socket_mode: 0o666 lets every user"),
    ({"tcp_port": 9000, "token_file": "/x", "token_env": "Y"}, "not both"),
    ({"command_timeout_seconds": 0}, "admin.command_timeout_seconds"),
    ({"colour": 1}, "admin.colour: unknown setting"),
])
def test_admin_settings_are_checked(admin: dict, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_config({"admin": admin})
    assert message in str(err.value)


def test_short_token_file_is_refused(tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("abc\n")
    with pytest.raises(ConfigError, match="shorter than 16 bytes"):
        parse_config({"admin": {"tcp_port": 0, "token_file": str(token_file)}})


def test_snapshot_returns_path_and_bytes(two_agents) -> None:
    running, address, _ = two_agents
    status, answer = call(address, "POST", "/v1/snapshot", {"rank": 0})
    assert status == 200 and answer["ok"]
    (result,) = answer["results"]
    path = Path(result["snapshot"]["path"])
    assert path.is_file() and path.stat().st_size == result["snapshot"]["bytes"]
    status, data = call(address, "GET", result["snapshot"]["download"])
    assert status == 200 and data == path.read_bytes()
    snapshot = pickle.loads(gzip.decompress(data))
    assert snapshot["segments"][0]["frames"] == []  # no stack frames unless asked

    status, answer = call(address, "POST", "/v1/snapshot", {"rank": 0, "frames": True})
    data = call(address, "GET", answer["results"][0]["snapshot"]["download"])[1]
    assert pickle.loads(gzip.decompress(data))["segments"][0]["frames"]
    # Only files of the snapshot directory are served (tests/admin/test_snapshot_confinement.py).
    assert call(address, "GET", "/v1/snapshots/passwd")[0] == 404
    assert call(address, "GET", "/v1/snapshots/..%2F..%2Fetc%2Fpasswd")[0] == 400
