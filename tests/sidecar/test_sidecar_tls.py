"""TLS on the agents' TCP listener: an agent that trusts the sidecar's CA reports over it
(with mutual TLS when the sidecar asks for client certificates); a plaintext agent or one
trusting another CA gets nothing through. Certificates are made with the openssl command."""

from __future__ import annotations

import dataclasses
import os
import shutil
import time
from pathlib import Path

import pytest
from support.pki import make_ca, make_leaf
from support.sidecar import FakeSource, sidecar_config, tcp_token, values
from support.waiting import wait_for

from allocator_ext.agent import start_agent
from allocator_ext.agent.tls import TlsSettings
from exporter.shared.config import ConfigError
from exporter.sidecar.app import SidecarThread
from exporter.sidecar.config import parse_config

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="no openssl command")


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("pki")
    ca = make_ca(d, "allocwatch-ca")
    other = make_ca(d, "other-ca")
    server = make_leaf(d, "sidecar", ca, "IP:127.0.0.1,DNS:localhost")
    client = make_leaf(d, "agent", ca, "DNS:agent")
    return {"ca": ca[1], "other_ca": other[1], "server_key": server[0], "server_cert": server[1],
            "client_key": client[0], "client_cert": client[1]}


def tls_sidecar(tmp_path: Path, pki: dict[str, Path], mutual: bool) -> SidecarThread:
    config = sidecar_config(tmp_path, tcp=True)
    agents = dataclasses.replace(
        config.agents, tls_cert_file=str(pki["server_cert"]), tls_key_file=str(pki["server_key"]),
        tls_client_ca_file=str(pki["ca"]) if mutual else "")
    return SidecarThread(dataclasses.replace(config, agents=agents), None).start()


def reported(url: str) -> bool:
    return bool(values(url, "torch_cuda_allocator_reserved_bytes"))


@pytest.mark.parametrize("mutual", [False, True], ids=["server-tls", "mutual-tls"])
def test_an_agent_trusting_the_ca_reports_over_tls(tmp_path: Path, pki, mutual: bool) -> None:
    running = tls_sidecar(tmp_path, pki, mutual)
    try:
        target = running.sidecar.agent_targets[1]
        tls = TlsSettings(str(pki["ca"]), str(pki["client_cert"]) if mutual else "",
                          str(pki["client_key"]) if mutual else "")
        agent = start_agent(target, interval=0.1, source=FakeSource(), nvml=False,
                            stop_at_exit=False, tls=tls, token=tcp_token(tmp_path))
        try:
            wait_for(lambda: reported(running.sidecar.metrics_url), what="a report over TLS")
        finally:
            agent.stop()
    finally:
        running.stop()


@pytest.mark.parametrize("case", ["plaintext", "other-ca", "no-client-cert"])
def test_agents_without_the_right_credentials_get_nothing_through(tmp_path: Path, pki,
                                                                  case: str) -> None:
    running = tls_sidecar(tmp_path, pki, mutual=True)
    try:
        target = running.sidecar.agent_targets[1]
        tls = {"plaintext": None,
               "other-ca": TlsSettings(str(pki["other_ca"]), str(pki["client_cert"]),
                                       str(pki["client_key"])),
               "no-client-cert": TlsSettings(str(pki["ca"]))}[case]
        agent = start_agent(target, interval=0.1, source=FakeSource(), nvml=False,
                            stop_at_exit=False, tls=tls, token=tcp_token(tmp_path))
        try:
            time.sleep(1.5)
            assert not agent.connected.is_set()
            assert not reported(running.sidecar.metrics_url)
        finally:
            agent.stop()
    finally:
        running.stop()


def test_tls_settings_are_checked_and_named(tmp_path: Path, pki) -> None:
    with pytest.raises(ConfigError, match="agents.tls_cert_file and agents.tls_key_file"):
        parse_config({"agents": {"tcp_port": 0, "tls_cert_file": str(pki["server_cert"])}})
    with pytest.raises(ConfigError, match="agents.tls_key_file: cannot read"):
        parse_config({"agents": {"tcp_port": 0, "tls_cert_file": str(pki["server_cert"]),
                                 "tls_key_file": str(tmp_path / "missing.key")}})
    with pytest.raises(ValueError, match="cannot read the CA file"):
        TlsSettings(str(tmp_path / "nope.crt")).check()


@pytest.mark.parametrize("kind", ["fifo", "endless device"])
def test_a_tls_file_that_is_no_file_holds_up_nothing_of_the_agent(tmp_path: Path, pki,
                                                                  kind: str) -> None:
    """ALLOCWATCH_TLS_CA comes from the training process's environment: a FIFO there would
    hold the agent's connection thread (and its stop) for good, /dev/zero fill the process's
    memory. The agent names the file, stays unconnected and stops at once."""
    ca = tmp_path / "ca.pem"
    if kind == "fifo":
        os.mkfifo(ca)
    running = tls_sidecar(tmp_path, pki, mutual=False)
    try:
        agent = start_agent(running.sidecar.agent_targets[1], interval=0.1, source=FakeSource(),
                            nvml=False, stop_at_exit=False, token=tcp_token(tmp_path),
                            tls=TlsSettings(str(ca) if kind == "fifo" else "/dev/zero"))
        wait_for(lambda: agent.last_error and "not a regular file" in agent.last_error,
                 what="the agent naming the file")
        started = time.monotonic()
        agent.stop(1.0)
        assert time.monotonic() - started < 2.0 and not agent.connected.is_set()
    finally:
        running.stop()
