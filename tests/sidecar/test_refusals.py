"""Clients refused by the listeners are counted (allocwatch_refused_total{reason}) and their
warnings rate-limited: streams on the agents' TCP port without the token and admin requests
with a wrong one, hundreds a second, write a handful of log lines, each count exact. And the
metrics endpoint can ask for a bearer token, over HTTPS, as a PodMonitor's `authorization` and
`tlsConfig` send them, while the kubelet's probes stay open."""

from __future__ import annotations

import dataclasses
import http.client
import logging
import ssl
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import pytest
from support.admin import call
from support.control import start_control_sidecar
from support.pki import make_ca, make_leaf
from support.sidecar import sidecar_config, values
from support.streams import Stream, hello

from exporter.sidecar.app import SidecarThread
from exporter.sidecar.config import parse_config

pytestmark = pytest.mark.timeout(120)
TOKEN = "5e7c9a1b3d5f7092b4d6f8a0c2e4a6c8"
REFUSED = 300


def _warnings(caplog: pytest.LogCaptureFixture, logger: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == logger and r.levelno >= logging.WARNING]


def test_streams_without_the_token_are_counted_and_their_warnings_rate_limited(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    config = sidecar_config(tmp_path, nvml=False, tcp=True)
    with SidecarThread(config) as running, caplog.at_level(logging.INFO, "exporter.grpc"):
        target = running.sidecar.agent_targets[1]
        channel = grpc.insecure_channel(target)
        try:
            for n in range(REFUSED):
                with Stream(target) as stream:
                    assert stream.send(hello(rank=n)).error().code() == \
                        grpc.StatusCode.UNAUTHENTICATED
        finally:
            channel.close()
        assert values(running.sidecar.metrics_url, "allocwatch_refused_total",
                      reason="agent_token") == [float(REFUSED)]
        # Before, one warning each.
        assert len(_warnings(caplog, "exporter.grpc")) <= 6


def test_admin_requests_with_a_wrong_token_are_counted_and_their_warnings_rate_limited(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    running = start_control_sidecar(tmp_path, admin={"tcp_port": 0,
                                                     "token_file": str(token_file)})
    try:
        tcp = next(a for a in running.sidecar.admin.addresses() if a.startswith("http://"))
        with caplog.at_level(logging.INFO, "exporter.admin"):
            for _ in range(REFUSED):
                assert call(tcp, "GET", "/v1/agents",
                            headers={"Authorization": "Bearer wrong"})[0] == 401
        assert values(running.sidecar.metrics_url, "allocwatch_refused_total",
                      reason="admin_token") == [float(REFUSED)]
        assert len(_warnings(caplog, "exporter.admin")) <= 6
        assert call(tcp, "GET", "/v1/agents", headers={"Authorization": f"Bearer {TOKEN}"}
                    )[0] == 200
    finally:
        running.stop()


def test_the_metrics_endpoint_can_ask_for_a_token_over_https(tmp_path: Path) -> None:
    ca = make_ca(tmp_path, "ca")
    key, cert = make_leaf(tmp_path, "sidecar", ca, "IP:127.0.0.1")
    token_file = tmp_path / "scrape-token"
    token_file.write_text(TOKEN + "\n")
    parsed = parse_config({"metrics": {
        "address": "127.0.0.1", "port": 0, "token_file": str(token_file),
        "tls_cert_file": str(cert), "tls_key_file": str(key)}})
    config = dataclasses.replace(sidecar_config(tmp_path, nvml=False), metrics=parsed.metrics)
    trusting = ssl.create_default_context(cafile=str(ca[1]))
    with SidecarThread(config) as running:
        url = running.sidecar.metrics_url
        assert url.startswith("https://")

        def get(path: str, token: str | None = None) -> int:
            request = urllib.request.Request(url + path)
            if token:
                request.add_header("Authorization", f"Bearer {token}")
            try:
                with urllib.request.urlopen(request, timeout=10, context=trusting) as answer:
                    return answer.status
            except urllib.error.HTTPError as err:
                return err.code

        assert get("/metrics") == 401 and get("/metrics", "wrong") == 401 and get("/") == 401
        assert get("/metrics", TOKEN) == 200
        assert get("/healthz") == 200 and get("/readyz") == 200  # the kubelet's probes
        with pytest.raises((urllib.error.URLError, http.client.HTTPException, OSError)):
            # plain HTTP gets nothing
            urllib.request.urlopen(url.replace("https://", "http://") + "/metrics", timeout=5)
        request = urllib.request.Request(url + "/metrics",
                                         headers={"Authorization": f"Bearer {TOKEN}"})
        with urllib.request.urlopen(request, timeout=10, context=trusting) as answer:
            body = answer.read().decode()
        assert 'allocwatch_refused_total{reason="metrics_token"} 3.0' in body
