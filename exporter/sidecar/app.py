"""The sidecar daemon: the agents' gRPC server, the metrics endpoint, NVML, wired together."""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
import threading
import time
from collections.abc import Coroutine
from pathlib import Path
from types import ModuleType
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.process_collector import ProcessCollector

from allocator_ext.protocol.nvml import NvmlReader
from allocator_ext.protocol.version import PACKAGE_VERSION
from exporter.admin.collector import AdminCollector
from exporter.admin.http_server import AdminHttpServer
from exporter.admin.service import AdminService
from exporter.admin.snapshot_dir import prepare_snapshot_dir, snapshot_dir_for
from exporter.admin.tls import RenewingTlsContext
from exporter.agents.grpc_server import AgentsEndpoint, ListenError
from exporter.metrics.bounds_collector import BoundsCollector
from exporter.metrics.collectors import (
    AgentsCollector,
    AllocatorCollector,
    GpuCollector,
)
from exporter.metrics.http_server import MetricsHttpServer
from exporter.policy.collector import PolicyCollector
from exporter.policy.engine import PolicyEngine
from exporter.policy.runner import PolicyRunner
from exporter.shared.bounded_http import HttpCollector
from exporter.shared.config import apply_reload
from exporter.shared.descriptors import agent_connections
from exporter.shared.precedence import Precedence
from exporter.shared.refusals import Refusals
from exporter.shared.registry import Registry
from exporter.shared.tokens import RotatingToken
from exporter.sidecar.collector import SidecarCollector
from exporter.sidecar.config import Flags, SidecarConfig
from exporter.sidecar.reload import ConfigWatcher

log = logging.getLogger("exporter.sidecar")


class Sidecar:
    """Start with `await start()`, stop with `await stop()`; all on one event loop."""

    def __init__(self, config: SidecarConfig, nvml_module: ModuleType | Any | None = None,
                 config_path: str | Path | None = None, flags: Flags | None = None):
        # The command line's flags over the file's settings, now and at every reload.
        self.flags = flags or Flags()
        file_config, config = config, self.flags.apply(config)
        self.config = config
        self.config_path = config_path
        self.registry = Registry(config.agents.expiry_seconds, config.agents.max_agents,
                                 config.agents.max_departed_agents, config.agents.max_series)
        self.nvml: NvmlReader | None = None
        if config.nvml.enabled:
            self.nvml = NvmlReader(nvml_module, cache_seconds=config.nvml.cache_seconds)
        else:
            log.info("NVML disabled by settings (nvml.enabled: false): no device series "
                     "from the sidecar")
        self.policy = PolicyEngine(config.policy)
        self.policy_runner = PolicyRunner(self.policy, self.registry)
        self.admin: AdminHttpServer | None = None
        self.watcher: ConfigWatcher | None = None
        if config_path is not None:  # polled where reload.enabled; read on SIGHUP either way
            self.watcher = ConfigWatcher(config_path, self.apply_config,
                                         config.reload.interval_seconds, in_force=file_config)
        # One collector per source; the admin API's joins them once it listens.
        self.metrics_registry = CollectorRegistry(auto_describe=False)
        self.refusals = Refusals()
        # Scrapes first: while /metrics is built, every listener leaves newcomers queued.
        self.precedence = Precedence()
        for collector in (AllocatorCollector(self.registry), GpuCollector(self.registry, self.nvml),
                          AgentsCollector(self.registry),
                          BoundsCollector(self.registry, self.refusals),
                          SidecarCollector(self.watcher),
                          PolicyCollector(self.policy)):
            self.metrics_registry.register(collector)
        self.http_collector = HttpCollector()  # each listener joins it once it listens
        self.metrics_registry.register(self.http_collector)
        # The sidecar's own CPU and memory (process_cpu_seconds_total, ...): the soak watches them.
        ProcessCollector(registry=self.metrics_registry)
        self.agents_endpoint: AgentsEndpoint | None = None
        self.http: MetricsHttpServer | None = None
        self.agent_targets: list[str] = []
        self._ready = False
        self._heartbeat = time.monotonic()
        self._tasks: list[asyncio.Task] = []

    @property
    def metrics_url(self) -> str:
        assert self.http is not None
        host = self.config.metrics.address
        if host in ("0.0.0.0", "::", ""):
            host = "127.0.0.1"
        elif ":" in host:
            host = f"[{host}]"
        return f"{self.http.scheme}://{host}:{self.http.port}"

    async def start(self) -> None:
        if self.nvml is not None:
            await asyncio.to_thread(self.nvml.start)
        metrics = self.config.metrics
        tls = (RenewingTlsContext(metrics.tls_cert_file, metrics.tls_key_file,
                                  metrics.tls_client_ca_file) if metrics.tls_cert_file else None)
        self.http = MetricsHttpServer(
            metrics.address, metrics.port, self.metrics_registry,
            self.registry, is_ready=lambda: self._ready, is_healthy=self._healthy,
            limits=metrics.limits, tls=tls.listening_context if tls else None,
            token=RotatingToken(metrics, "metrics") if metrics.token_file or metrics.token_env
            else None, refusals=self.refusals, path=metrics.path, precedence=self.precedence)
        await _listening("metrics", f"{_host_port(metrics.address, metrics.port)} "
                         "(metrics.address and port, --web.listen-address)", self.http.start())
        self.http_collector.servers.append(self.http.http)
        config = self.config
        self.agents_endpoint = AgentsEndpoint(
            self.registry, config.agents, self.refusals, agent_connections(
                config.agents.max_connections, config.metrics.limits.max_connections,
                config.admin.limits.max_connections if config.admin.enabled else 0),
            self.precedence)
        try:
            await _listening("agents", "agents.unix_socket, agents.tcp_port",
                             self.agents_endpoint.start())
            self.agent_targets = self.agents_endpoint.targets
            assert self.agents_endpoint.front is not None
            self.http_collector.servers.append(self.agents_endpoint.front)
            self._prepare_snapshot_dir()
            await self._start_admin()
        except Exception:
            await self.agents_endpoint.stop(0)
            if self.admin is not None:
                await self.admin.stop()
            await self.http.stop()
            raise
        self._tasks.append(asyncio.create_task(self._housekeeping()))
        self._tasks.append(asyncio.create_task(self.policy_runner.run()))
        if self.watcher is not None and self.config.reload.enabled:
            self._tasks.append(asyncio.create_task(self.watcher.run()))
        self._ready = True
        policy = self.policy.config
        log.info("sidecar started", extra={
            "version": PACKAGE_VERSION, "agents": self.agent_targets, "metrics": self.metrics_url,
            "nvml": bool(self.nvml and self.nvml.available),
            "admin": self.admin.addresses() if self.admin else [],
            "policy_rules": [r.name for r in policy.rules], "policy_dry_run": policy.dry_run,
            "watching": str(self.config_path)
            if self.watcher and self.config.reload.enabled else None})

    def _prepare_snapshot_dir(self) -> None:
        """Before any command can ask for a snapshot: the agents' snapshot directory, made so
        that the sidecar can read what agents of any user write there."""
        directory = snapshot_dir_for(self.config.agents.unix_socket)
        if directory is None:
            return
        problem = prepare_snapshot_dir(directory, self.config.agents.socket_mode)
        if problem is not None:
            log.warning("snapshots may not be downloadable", extra={"reason": problem})

    async def _start_admin(self) -> None:
        admin = self.config.admin
        if not admin.enabled:
            log.info("admin API disabled by settings (admin.enabled: false)")
            return
        service = AdminService(
            self.registry, timeout=lambda: self.config.admin.command_timeout_seconds,
            snapshot_dir=admin.snapshot_path(self.config.agents.unix_socket),
            snapshot_owners=self._snapshot_owners)
        self.admin = AdminHttpServer(admin, self.config.agents.unix_socket, service,
                                     self.refusals, self.precedence)
        where = [f"{self.admin.unix_path} (admin.unix_socket)"] if self.admin.unix_path else []
        if admin.tcp_port is not None:
            where.append(f"{_host_port(admin.tcp_address, admin.tcp_port)} "
                         "(admin.tcp_address, tcp_port)")
        await _listening("admin", " or ".join(where), self.admin.start())
        self.http_collector.servers.append(self.admin.http)
        self.metrics_registry.register(AdminCollector(self.admin))

    def _snapshot_owners(self) -> set[int]:
        """Whose snapshot files the admin API serves: the users agents run as (those
        agents.allowed_uids names, those seen on the agents' socket) and the sidecar's own."""
        front = self.agents_endpoint.front if self.agents_endpoint is not None else None
        return {os.geteuid(), *self.config.agents.allowed_uids,
                *(front.seen_uids if front is not None else ())}

    def apply_config(self, new: SidecarConfig) -> list[str]:
        """Install reloaded settings (on the event loop); returns the changed fields that only
        a restart applies (listeners, ports), which keep their values until then."""
        old = self.config
        effective, restart = apply_reload(old, self.flags.apply(new))
        if self.admin is not None and effective.admin != old.admin:
            # Read off the event loop; the reload goes on meanwhile.
            self._spawn(self.admin.set_token(effective.admin))
        self.registry.expiry_seconds = effective.agents.expiry_seconds
        self.registry.max_agents = effective.agents.max_agents
        self.registry.max_departed = effective.agents.max_departed_agents
        self.registry.max_series = effective.agents.max_series
        logging.getLogger().setLevel(effective.logging.level.upper())
        if self.watcher is not None:
            self.watcher.interval_seconds = effective.reload.interval_seconds
        self.policy_runner.reconfigure(effective.policy)
        self.config = effective
        return restart

    def reload(self) -> None:
        """SIGHUP: read the settings file now (a sidecar started without one has nothing to
        read, and says so)."""
        if self.watcher is None:
            log.warning("SIGHUP: no settings file to reload (started without --config)")
            return
        self._spawn(self._reload_now(self.watcher))

    @staticmethod
    async def _reload_now(watcher: ConfigWatcher) -> None:
        await watcher.reload_now()

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        """Runs `work` on the event loop beside the caller, cancelled with the others at stop;
        an error it did not expect is logged, never lost."""
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.append(task)

        def finished(done: asyncio.Task) -> None:
            if done in self._tasks:
                self._tasks.remove(done)
            if not done.cancelled() and done.exception() is not None:
                log.error("a sidecar task failed", exc_info=done.exception())

        task.add_done_callback(finished)

    def _healthy(self) -> bool:
        # The event loop is alive when its housekeeping task ran recently.
        return time.monotonic() - self._heartbeat < 10.0

    async def _housekeeping(self) -> None:
        while True:
            self._heartbeat = time.monotonic()
            self.registry.agents()  # expires departed agents even when nobody scrapes
            await asyncio.sleep(1.0)

    async def stop(self, grace: float = 1.0) -> None:
        self._ready = False
        for task in self._tasks:
            task.cancel()
        if self.admin is not None:
            await self.admin.stop()
        if self.agents_endpoint is not None:
            await self.agents_endpoint.stop(grace)
        if self.http is not None:
            await self.http.stop()
        if self.nvml is not None:
            self.nvml.close()
        log.info("sidecar stopped")


TRAINING_DONE_FILE = "training-done"


def training_finished(sidecar: Sidecar, grace_seconds: float) -> str | None:
    """Why the training is over, for --exit-after-training (Kubernetes before 1.29, where a
    sidecar is a regular container and must exit for the pod to complete); None while it runs.

    Over when the trainer wrote `training-done` beside the agents' socket or in the directory
    above it (the shared volume, where the socket's directory is the sidecar's alone), or when
    every agent that connected has been gone for `grace_seconds` (a trainer killed before it
    could write the file). Before any agent connected, only the file ends it.
    """
    socket = sidecar.config.agents.unix_socket
    if socket and any((folder / TRAINING_DONE_FILE).exists()
                      for folder in (Path(socket).parent, Path(socket).parent.parent)):
        return f"{TRAINING_DONE_FILE} found"
    agents = sidecar.registry.agents()
    if sidecar.registry.ever_connected and not any(a.connected for a in agents):
        gone = sidecar.registry.all_gone_since
        if gone is not None and time.monotonic() - gone >= grace_seconds:
            return f"every agent gone for {grace_seconds:g} s"
    return None


def _host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


async def _listening(listener: str, where: str, start: Coroutine[Any, Any, None]) -> None:
    """Starts one of the sidecar's three listeners; a failure (a port another program holds, a
    socket path that cannot be made) is a ListenError that names the listener and its
    settings, since the system's own message ("Address already in use") names neither."""
    try:
        await start
    except ListenError as err:
        raise ListenError(f"the {listener} listener: {err}") from None
    except OSError as err:
        raise ListenError(f"the {listener} listener cannot listen on {where}: "
                          f"{err.strerror or err}") from None


async def _serve(config: SidecarConfig, exit_after_training: bool, grace_seconds: float,
                 config_path: str | Path | None = None, flags: Flags | None = None) -> None:
    sidecar = Sidecar(config, config_path=config_path, flags=flags)
    loop = asyncio.get_running_loop()
    started = False
    # SIGHUP reloads the settings, as Prometheus does; until the sidecar is up it is ignored
    # (its default action would end the process and leave its sockets behind).
    loop.add_signal_handler(signal.SIGHUP, lambda: sidecar.reload() if started else None)
    await sidecar.start()
    started = True
    # What start-up made (modules, the listeners, gRPC's and aiohttp's machinery) lives as
    # long as the process: out of the collector's sight, a full collection no longer walks it,
    # so that the pauses it takes under load stay short (a crowd of clients allocates fast).
    gc.collect()
    gc.freeze()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    while not stop.is_set():
        try:
            await asyncio.wait_for(stop.wait(), timeout=0.5)
        except asyncio.TimeoutError:
            pass
        if exit_after_training:
            reason = training_finished(sidecar, grace_seconds)
            if reason is not None:
                log.info("training finished, stopping", extra={"reason": reason})
                break
    else:
        log.info("signal received, stopping")
    await sidecar.stop()


def run_sidecar(config: SidecarConfig, exit_after_training: bool = False,
                grace_seconds: float = 60.0, config_path: str | Path | None = None,
                flags: Flags | None = None) -> None:
    """Run until SIGTERM or SIGINT (the `allocwatch sidecar` command), or, with
    exit_after_training, until the training is over. With `config_path`, the file is watched
    and reloaded when it changes, or at once on SIGHUP."""
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # until the event loop handles it
    asyncio.run(_serve(config, exit_after_training, grace_seconds, config_path, flags))


class SidecarThread:
    """A sidecar on its own event loop in a background thread (tests, demo, benchmarks)."""

    def __init__(self, config: SidecarConfig, nvml_module: ModuleType | Any | None = None,
                 config_path: str | Path | None = None):
        self.sidecar = Sidecar(config, nvml_module, config_path)
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="allocwatch-sidecar",
                                        daemon=True)

    def start(self) -> SidecarThread:
        self._thread.start()
        try:
            asyncio.run_coroutine_threadsafe(self.sidecar.start(), self.loop).result(30)
        except BaseException:
            self._end_loop()
            raise
        return self

    def _end_loop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
        self.loop.close()

    def call(self, coro: Any, timeout: float = 30.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self) -> None:
        try:
            self.call(self.sidecar.stop(grace=0.2))
        finally:
            self._end_loop()

    def __enter__(self) -> SidecarThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
