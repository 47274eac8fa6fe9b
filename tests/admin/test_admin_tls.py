"""HTTPS on the admin API's TCP listener: `allocwatch ctl` trusting the sidecar's CA gets through
(with mutual TLS when the sidecar asks for client certificates); plain HTTP, another CA or a
missing client certificate get nothing through and change nothing; a client that stalls its
handshake holds up nobody, and past the connection limit its place goes to a newcomer; a
renewed certificate is served without a restart. Certificates are made with the openssl
command."""

from __future__ import annotations

import json
import os
import shutil
import socket
import ssl
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.control import connect_agent, metric, start_control_sidecar
from support.paths import REPO
from support.pki import make_ca, make_leaf
from support.sidecar import FakeSource

from exporter.commands.ctl.client import AdminClient, ClientTls, CtlError
from exporter.shared.config import ConfigError
from exporter.sidecar.config import parse_config

pytestmark = [pytest.mark.skipif(shutil.which("openssl") is None, reason="no openssl command"),
              pytest.mark.timeout(90)]
TOKEN = "9b2e4d6f8a0c1e3b5d7f9a1c3e5b7d9f"


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("admin-pki")
    ca, other = make_ca(d, "admin-ca"), make_ca(d, "other-ca")
    server = make_leaf(d, "sidecar-admin", ca, "IP:127.0.0.1,DNS:localhost")
    renewed = make_leaf(d, "sidecar-admin-renewed", other, "IP:127.0.0.1,DNS:localhost")
    client = make_leaf(d, "operator", ca, "DNS:operator")
    return {"ca": ca[1], "other_ca": other[1], "server_key": server[0], "server_cert": server[1],
            "renewed_key": renewed[0], "renewed_cert": renewed[1],
            "client_key": client[0], "client_cert": client[1]}


def tls_admin(tmp_path: Path, pki: dict[str, Path], mutual: bool = False,
              limits: dict[str, float] | None = None):
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    cert, key = tmp_path / "tls.crt", tmp_path / "tls.key"  # copies: the rotation test swaps them
    shutil.copy(pki["server_cert"], cert)
    shutil.copy(pki["server_key"], key)
    admin = {"unix_socket": "", "tcp_port": 0, "token_file": str(token_file),
             "tls_cert_file": str(cert), "tls_key_file": str(key)}
    if mutual:
        admin["tls_client_ca_file"] = str(pki["ca"])
    if limits:
        admin["limits"] = limits
    return start_control_sidecar(tmp_path, admin=admin)


def client_hello() -> bytes:
    """The first flight of a TLS client: a ClientHello."""
    context = ssl.create_default_context()
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    outgoing = ssl.MemoryBIO()
    tls = context.wrap_bio(ssl.MemoryBIO(), outgoing)
    with pytest.raises(ssl.SSLWantReadError):
        tls.do_handshake()
    return outgoing.read()


def ended_by_server(sock: socket.socket) -> bool:
    """Whether the server has closed `sock`: what it sent is read through to its end."""
    sock.settimeout(0.5)
    try:
        while sock.recv(1 << 16):
            pass
    except TimeoutError:
        return False
    except ConnectionResetError:
        pass
    return True


def test_ctl_over_https_lists_and_commands_agents(tmp_path: Path, pki) -> None:
    running = tls_admin(tmp_path, pki)
    source = FakeSource()
    agent = connect_agent(running, tmp_path, source)
    try:
        (address,) = running.sidecar.admin.addresses()
        assert address.startswith("https://127.0.0.1:")
        (tmp_path / "ctl-token").write_text(TOKEN)
        ctl = [sys.executable, "-m", "exporter.cli", "ctl", "--admin", address,
               "--token-file", str(tmp_path / "ctl-token"), "--tls-ca-file", str(pki["ca"])]
        out = subprocess.run([*ctl, "agents", "--json"], capture_output=True, text=True,
                             cwd=REPO, timeout=60)
        assert out.returncode == 0, out.stderr
        assert len(json.loads(out.stdout)["agents"]) == 1
        out = subprocess.run([*ctl, "set", "garbage_collection_threshold:0.7"],
                             capture_output=True, text=True, cwd=REPO, timeout=60)
        assert out.returncode == 0, out.stderr
        assert source.calls == [("set_config", "garbage_collection_threshold:0.7")]
        # Over TLS the token is still required.
        with pytest.raises(CtlError, match="refused \\(401\\)"):
            AdminClient(address, "x" * 32, tls=ClientTls(str(pki["ca"]))).get("/v1/agents")
    finally:
        agent.stop()
        running.stop()


@pytest.mark.parametrize("case", ["plain-http", "other-ca", "no-client-cert"])
def test_clients_without_the_right_credentials_get_nothing_through(tmp_path: Path, pki,
                                                                   case: str) -> None:
    running = tls_admin(tmp_path, pki, mutual=True)
    source = FakeSource()
    agent = connect_agent(running, tmp_path, source)
    try:
        (address,) = running.sidecar.admin.addresses()
        if case == "plain-http":
            client = AdminClient(address.replace("https://", "http://"), TOKEN, timeout=10)
        elif case == "other-ca":
            client = AdminClient(address, TOKEN, timeout=10, tls=ClientTls(
                str(pki["other_ca"]), str(pki["client_cert"]), str(pki["client_key"])))
        else:
            client = AdminClient(address, TOKEN, timeout=10, tls=ClientTls(str(pki["ca"])))
        with pytest.raises(CtlError):
            client.post("/v1/settings", {"settings": "garbage_collection_threshold:0.7"})
        assert source.calls == []
        # ...while the right credentials work on the same listener.
        good = AdminClient(address, TOKEN, tls=ClientTls(
            str(pki["ca"]), str(pki["client_cert"]), str(pki["client_key"])))
        assert len(good.get("/v1/agents")["agents"]) == 1
    finally:
        agent.stop()
        running.stop()


def test_a_stalled_handshake_holds_up_nobody(tmp_path: Path, pki) -> None:
    running = tls_admin(tmp_path, pki)
    try:
        (address,) = running.sidecar.admin.addresses()
        port = int(address.rsplit(":", 1)[1])
        stalled = [socket.create_connection(("127.0.0.1", port)) for _ in range(4)]
        try:
            client = AdminClient(address, TOKEN, timeout=5, tls=ClientTls(str(pki["ca"])))
            started = time.monotonic()
            assert client.get("/v1/agents")["agents"] == []
            assert time.monotonic() - started < 3
        finally:
            for s in stalled:
                s.close()
    finally:
        running.stop()


def test_past_the_connection_limit_a_stalled_handshake_gives_its_place_to_a_newcomer(
        tmp_path: Path, pki) -> None:
    running = tls_admin(tmp_path, pki, limits={"max_connections": 4})
    try:
        (address,) = running.sidecar.admin.addresses()
        port = int(address.rsplit(":", 1)[1])
        stalled = []
        for _ in range(6):  # each says hello and never finishes its handshake
            stalled.append(socket.create_connection(("127.0.0.1", port), timeout=10))
            stalled[-1].sendall(client_hello())
            # The server's answer: its handshake under way (no longer silent) before the next.
            assert stalled[-1].recv(1, socket.MSG_PEEK)
        try:
            assert [ended_by_server(s) for s in stalled] == [True] * 2 + [False] * 4
            client = AdminClient(address, TOKEN, timeout=5, tls=ClientTls(str(pki["ca"])))
            assert client.get("/v1/agents")["agents"] == []
            assert ended_by_server(stalled[2])
        finally:
            for s in stalled:
                s.close()
        assert metric(running, "allocwatch_http_connections_closed_total", server="admin",
                      reason="idle_evicted") == 3.0
    finally:
        running.stop()


def test_a_renewed_certificate_is_served_without_a_restart(tmp_path: Path, pki) -> None:
    running = tls_admin(tmp_path, pki)
    try:
        (address,) = running.sidecar.admin.addresses()
        old_ca = AdminClient(address, TOKEN, timeout=10, tls=ClientTls(str(pki["ca"])))
        new_ca = AdminClient(address, TOKEN, timeout=10, tls=ClientTls(str(pki["other_ca"])))
        assert old_ca.get("/v1/agents")["agents"] == []
        # As a Secret update does: new files in place (and a later modification time).
        shutil.copy(pki["renewed_key"], tmp_path / "tls.key")
        shutil.copy(pki["renewed_cert"], tmp_path / "tls.crt")
        later = time.time() + 5
        for name in ("tls.key", "tls.crt"):
            os.utime(tmp_path / name, (later, later))
        assert new_ca.get("/v1/agents")["agents"] == []
        with pytest.raises(CtlError, match="TLS"):
            old_ca.get("/v1/agents")
    finally:
        running.stop()


def test_certificate_files_read_while_they_were_written_are_read_again(
        tmp_path: Path, pki, monkeypatch: pytest.MonkeyPatch) -> None:
    """A chain rewritten in place can be read with its leaf whole and the rest to come: it
    loads, yet is not kept. A context is kept only from files that did not change while they
    were read; the next handshake reads them again."""
    from exporter.admin import tls

    cert, key = tmp_path / "tls.crt", tmp_path / "tls.key"
    shutil.copy(pki["server_cert"], cert)
    shutil.copy(pki["server_key"], key)
    renewing = tls.RenewingTlsContext(str(cert), str(key))
    first = renewing.context()
    shutil.copy(pki["renewed_key"], key)
    shutil.copy(pki["renewed_cert"], cert)  # the leaf; its issuer follows below
    loaded: list[ssl.SSLContext] = []
    load = tls.server_tls_context

    def load_while_the_writer_finishes(*files: str) -> ssl.SSLContext:
        loaded.append(load(*files))
        if len(loaded) == 1:
            with cert.open("ab") as f:
                f.write(pki["other_ca"].read_bytes())
        return loaded[-1]

    monkeypatch.setattr(tls, "server_tls_context", load_while_the_writer_finishes)
    assert renewing.context() is first  # read mid-write: not kept
    assert renewing.context() is loaded[1]  # read again, whole
    assert renewing.context() is loaded[1] and len(loaded) == 2  # unchanged since: kept


def test_admin_tls_settings_are_checked_and_named(tmp_path: Path, pki) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    base = {"tcp_port": 0, "token_file": str(token_file)}
    with pytest.raises(ConfigError, match="admin.tls_cert_file and admin.tls_key_file"):
        parse_config({"admin": {**base, "tls_cert_file": str(pki["server_cert"])}})
    with pytest.raises(ConfigError, match="admin.tls_key_file: cannot read"):
        parse_config({"admin": {**base, "tls_cert_file": str(pki["server_cert"]),
                                "tls_key_file": str(tmp_path / "missing.key")}})
    with pytest.raises(ConfigError, match="admin.tls_client_ca_file: needs"):
        parse_config({"admin": {**base, "tls_client_ca_file": str(pki["ca"])}})
    with pytest.raises(ConfigError, match="set admin.tcp_port too"):
        parse_config({"admin": {"tls_cert_file": str(pki["server_cert"]),
                                "tls_key_file": str(pki["server_key"])}})
    junk = tmp_path / "junk.crt"
    junk.write_text("not a certificate")
    with pytest.raises(ConfigError, match="not a usable certificate"):
        parse_config({"admin": {**base, "tls_cert_file": str(junk),
                                "tls_key_file": str(pki["server_key"])}})
    # A key that does not match the certificate is refused too.
    with pytest.raises(ConfigError, match="not a usable certificate"):
        parse_config({"admin": {**base, "tls_cert_file": str(pki["server_cert"]),
                                "tls_key_file": str(pki["client_key"])}})


def test_ctl_tls_options_are_checked(pki) -> None:
    with pytest.raises(CtlError, match="give both or neither"):
        AdminClient("https://127.0.0.1:1", TOKEN, tls=ClientTls(str(pki["ca"]),
                                                              str(pki["client_cert"])))
    with pytest.raises(CtlError, match="TLS files"):
        AdminClient("https://127.0.0.1:1", TOKEN, tls=ClientTls("/nonexistent/ca.crt"))
