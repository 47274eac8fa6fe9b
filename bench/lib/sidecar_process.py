"""A sidecar in a process of its own, for benchmarks that train beside one (or kill it).

    sidecar = SidecarProcess("allocwatch-soak-", agents_yaml="  expiry_seconds: 120\n")
    sidecar.start(); ...; sidecar.kill(); sidecar.start(); ...; sidecar.stop()

Its settings file, agents' socket and log live in a fresh folder (under `parent` where given, else
in the temporary directory); metrics on a free loopback port. `extra_yaml` adds top-level
sections (a policy, say). `scrape(sidecar.metrics_url)` reads its /metrics as Prometheus would.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

from bench import REPO
from bench.lib.ports import free_port

Sample = tuple[str, dict[str, str], float]  # name, labels, value


def scrape(url: str, timeout: float = 5.0) -> list[Sample] | None:
    """Every sample of one scrape of `url`, or None where the sidecar does not answer."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        text = urllib.request.urlopen(url, timeout=timeout).read().decode()
    except OSError:
        return None
    return [(s.name, dict(s.labels), s.value)
            for family in text_string_to_metric_families(text) for s in family.samples]


# A Unix socket's path must fit sockaddr_un (108 bytes with its terminator on Linux).
MAX_SOCKET_PATH = 100


class SidecarProcess:
    def __init__(self, prefix: str, agents_yaml: str = "", extra_yaml: str = "",
                 parent: Path | None = None):
        self.folder = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
        self.socket = self.folder / "run" / "agent.sock"
        if len(os.fsencode(self.socket)) > MAX_SOCKET_PATH:  # a deep parent: the socket alone
            self.socket = Path(tempfile.mkdtemp(prefix=prefix)) / "agent.sock"  # goes short
        self.port = free_port()  # below the ephemeral range: no client's connect() takes it
        self.config = self.folder / "sidecar.yaml"
        self.config.write_text(f"agents:\n  unix_socket: {self.socket}\n{agents_yaml}"
                               f"metrics:\n  address: 127.0.0.1\n  port: {self.port}\n"
                               + extra_yaml)
        self.log = self.folder / "sidecar.log"
        self.target = f"unix://{self.socket}"
        self.metrics_url = f"http://127.0.0.1:{self.port}/metrics"
        self._process: subprocess.Popen | None = None

    def start(self) -> SidecarProcess:
        self._process = subprocess.Popen(
            [sys.executable, "-m", "exporter.cli", "sidecar", "--config", str(self.config)],
            cwd=REPO, stdout=self.log.open("ab"), stderr=subprocess.STDOUT)
        return self

    def kill(self) -> None:
        """SIGKILL: no goodbye, no cleanup, as a crashed or evicted sidecar."""
        assert self._process is not None
        self._process.send_signal(signal.SIGKILL)
        self._process.wait()

    def stop(self) -> None:
        if self._process is not None and self._process.poll() is None:
            self._process.send_signal(signal.SIGTERM)
            self._process.wait(10)
