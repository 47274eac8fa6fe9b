"""A sidecar on a background thread with the tests' settings, its /metrics read back, and a
fake allocator source for agents: for the sidecar, agent, policy, admin and ctl tests."""

from __future__ import annotations

import gzip
import threading
import urllib.request
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from allocator_ext.agent import convert
from allocator_ext.agent.auth import AgentToken
from allocator_ext.protocol.proto.allocwatch.v1 import agent_pb2 as pb
from exporter.sidecar.app import SidecarThread
from exporter.sidecar.config import (
    AgentsConfig,
    LoggingConfig,
    MetricsConfig,
    NvmlConfig,
    SidecarConfig,
)

MiB = 1 << 20


def sidecar_config(tmp_path: Path, *, expiry: float = 60.0, hello_timeout: float = 10.0,
                   tcp: bool = False, metrics_port: int = 0, socket_name: str = "agent.sock",
                   nvml: bool = True, max_message_bytes: int = 1 << 20) -> SidecarConfig:
    return SidecarConfig(
        agents=AgentsConfig(unix_socket=str(tmp_path / "run" / socket_name),
                            tcp_port=0 if tcp else None,
                            token_file=str(tcp_token(tmp_path).file) if tcp else "",
                            expiry_seconds=expiry,
                            hello_timeout_seconds=hello_timeout,
                            max_message_bytes=max_message_bytes),
        metrics=MetricsConfig(address="127.0.0.1", port=metrics_port),
        nvml=NvmlConfig(enabled=nvml),
        logging=LoggingConfig(level="info", format="json"),
    )


def tcp_token(tmp_path: Path) -> AgentToken:
    """The agents' token of a sidecar made with `sidecar_config(tcp=True)`: its file, which
    the sidecar creates at start."""
    return AgentToken(file=str(tmp_path / "run" / "agent-token"))


def start_sidecar(tmp_path: Path, nvml_module: Any | None = None, **kwargs: Any) -> SidecarThread:
    return SidecarThread(sidecar_config(tmp_path, **kwargs), nvml_module).start()


def scrape(url: str, accept: str | None = None, gzip_ok: bool = False,
           timeout: float = 10.0) -> tuple[str, dict[str, str]]:
    request = urllib.request.Request(url + "/metrics")
    if accept:
        request.add_header("Accept", accept)
    if gzip_ok:
        request.add_header("Accept-Encoding", "gzip")
    with urllib.request.urlopen(request, timeout=timeout) as response:
        body = response.read()
        headers = {k.lower(): v for k, v in response.headers.items()}
    if headers.get("content-encoding") == "gzip":
        body = gzip.decompress(body)
    return body.decode(), headers


def samples(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """{(sample name, sorted labels): value} of one scrape, parsed by prometheus_client."""
    text, _ = scrape(url)
    found = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return found


def values(url: str, name: str, **labels: str) -> list[float]:
    """Values of every sample `name` whose labels include `labels` (per-pool series only when
    `pool` is given)."""
    labels.setdefault("pool", "")
    return [v for (n, ls), v in samples(url).items()
            if n == name and all(dict(ls).get(k, "") == val for k, val in labels.items())]


class FakeSource:
    """An allocator stand-in with controllable figures and the full command interface.

    Used where the point of a test is the agent or the sidecar, not the allocator core.
    """

    backend = "allocwatch"

    def __init__(self, devices: Mapping[int, str] | None = None):
        self.uuids = dict(devices if devices is not None else {0: "GPU-fake-0"})
        self.lock = threading.Lock()
        self.stats: dict[int, dict[str, int]] = {d: self._initial() for d in self.uuids}
        self.config: dict[str, str] = {"garbage_collection_threshold": "0.0",
                                       "expandable_segments": "False"}
        self.calls: list[tuple[str, Any]] = []

    @staticmethod
    def _initial() -> dict[str, int]:
        return {
            "allocated_bytes.all.current": 30 * MiB, "reserved_bytes.all.current": 40 * MiB,
            "allocated_bytes.small_pool.current": 10 * MiB,
            "reserved_bytes.small_pool.current": 12 * MiB,
            "allocated_bytes.large_pool.current": 20 * MiB,
            "reserved_bytes.large_pool.current": 28 * MiB,
            "allocated_bytes.all.peak": 35 * MiB, "reserved_bytes.all.peak": 44 * MiB,
            "active_bytes.all.current": 31 * MiB, "requested_bytes.all.current": 29 * MiB,
            "segment.all.current": 7, "num_alloc_retries": 0, "num_ooms": 0,
            "num_device_alloc": 7, "num_device_free": 0, "num_allocations": 100,
        }

    def bump(self, device: int = 0, **deltas: int) -> None:
        with self.lock:
            for key, delta in deltas.items():
                self.stats[device][key] = self.stats[device].get(key, 0) + delta

    def devices(self) -> list[int]:
        return sorted(self.uuids)

    def memory_stats(self, device: int) -> dict[str, int]:
        with self.lock:
            return dict(self.stats[device])

    def settings(self, device: int) -> pb.AllocatorSettings:
        return convert.allocator_settings(self.config, convert.format_settings(self.config))

    def set_config(self, settings: str) -> None:
        parsed = convert.parse_settings_string(settings)
        for key, value in parsed.items():
            if key not in ("garbage_collection_threshold", "expandable_segments",
                           "max_split_size_mb"):
                raise ValueError(f"unknown allocator setting {key!r}")
            if key == "garbage_collection_threshold" and not 0 < float(value) < 1:
                raise ValueError(f"garbage_collection_threshold must be in (0, 1), got {value}")
        self.config.update(parsed)
        self.calls.append(("set_config", settings))

    def reclaim(self, device: int, empty_cache: bool) -> int:
        with self.lock:
            stats = self.stats[device]
            released = stats["reserved_bytes.all.current"] - stats["allocated_bytes.all.current"]
            stats["reserved_bytes.all.current"] -= released
        self.calls.append(("reclaim", (device, empty_cache)))
        return released

    def reset_peaks(self, device: int) -> None:
        with self.lock:
            stats = self.stats[device]
            stats["allocated_bytes.all.peak"] = stats["allocated_bytes.all.current"]
            stats["reserved_bytes.all.peak"] = stats["reserved_bytes.all.current"]
        self.calls.append(("reset_peaks", device))

    def snapshot(self, device: int) -> dict[str, Any]:
        frames = [{"filename": "/secret/train.py", "line": 3, "name": "step"}]
        return {"segments": [{"device": device, "address": 4096, "total_size": 2 * MiB,
                              "stream": 0, "segment_type": "small", "allocated_size": 512,
                              "active_size": 512, "requested_size": 500, "frames": frames,
                              "blocks": [{"address": 4096, "size": 512, "requested_size": 500,
                                          "state": "active_allocated", "frames": frames}]}],
                "device_traces": [[{"action": "alloc", "addr": 4096, "size": 512, "stream": 0,
                                    "frames": frames}]]}

    def record_history(self, device: int, enabled: bool, max_entries: int) -> None:
        with self.lock:
            self.calls.append(("record_history", (device, enabled, max_entries)))

    def versions(self) -> tuple[str, str]:
        return "", ""

    def gpu_uuid(self, device: int) -> str:
        return self.uuids.get(device, "")
