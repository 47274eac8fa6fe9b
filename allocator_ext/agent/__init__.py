"""The in-process agent: publishes the allocator's figures to the allocwatch sidecar.

    import allocator_ext
    agent = allocator_ext.start_agent("unix:///run/allocwatch/agent.sock")

or, with no code change, set ALLOCWATCH_TARGET and call maybe_start_from_env() (what
`allocwatch run` and allocator_ext.install() do). Environment variables:

| variable                 | meaning                                                          |
| ------------------------ | ---------------------------------------------------------------- |
| ALLOCWATCH_TARGET        | the sidecar: unix:///path/agent.sock or host:port; unset: no agent |
| ALLOCWATCH_INTERVAL      | seconds between reports (default 1)                              |
| ALLOCWATCH_SOURCE        | auto (default), allocwatch, pytorch                              |
| ALLOCWATCH_SNAPSHOT_DIR  | where snapshots are written (default: beside the Unix socket,    |
|                          | in snapshots/; else the temp dir)                                |
| ALLOCWATCH_AGENT_NVML    | 0 to stop the agent reading NVML                                 |
| ALLOCWATCH_TOKEN_FILE    | over TCP: the file holding the sidecar's agent token             |
|                          | (agents.token_file; or ALLOCWATCH_TOKEN, the token itself)       |
| ALLOCWATCH_SIDECAR_UID   | on a Unix socket: the user the sidecar runs as; the agent checks |
|                          | the socket, its directory and the listening process against it   |
|                          | (default: the socket's owner; see allocator_ext.agent.peer)      |
| ALLOCWATCH_WARN_UNCONNECTED_SECONDS | after how long without ever reaching the sidecar the  |
|                          | agent warns, once, naming the target and the reason (default 60) |

The process's identity comes from the environment too: see allocator_ext.agent.identity.
"""

from __future__ import annotations

import atexit
import logging
import os
import tempfile
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from allocator_ext.agent import grpc_fork_handlers_off  # noqa: F401  (before grpc's import)
from allocator_ext.agent.auth import AgentToken
from allocator_ext.agent.backoff import Backoff
from allocator_ext.agent.client import Agent, abandon_inherited_agents
from allocator_ext.agent.identity import build_identity, device_uuid
from allocator_ext.agent.peer import sidecar_uid_from_env
from allocator_ext.agent.sources import AllocatorSource, Source, TorchSource, UnsupportedCommand
from allocator_ext.agent.tls import TlsSettings
from allocator_ext.protocol.nvml import NvmlReader

__all__ = [
    "Agent",
    "AllocatorSource",
    "Source",
    "TorchSource",
    "UnsupportedCommand",
    "maybe_start_from_env",
    "set_default_source_factory",
    "start_agent",
]

log = logging.getLogger("allocator_ext.agent")

# Set by allocator_ext.install() when allocwatch's allocator serves torch: returns its Source.
_default_source_factory: Callable[[], Source] | None = None
_lock = threading.Lock()
_env_agent: Agent | None = None


def set_default_source_factory(factory: Callable[[], Source] | None) -> None:
    """Register what `source=None` / "allocwatch" means (called by allocator_ext.install())."""
    global _default_source_factory
    _default_source_factory = factory


def _resolve_source(source: Any) -> Source:
    if isinstance(source, str):
        if source == "pytorch":
            return TorchSource()
        if source == "allocwatch":
            if _default_source_factory is None:
                raise ValueError("source 'allocwatch': allocwatch's allocator is not installed in "
                                 "this process (call allocator_ext.install() first)")
            return _default_source_factory()
        if source == "auto":
            source = None
        else:
            raise ValueError(f"source must be 'auto', 'allocwatch' or 'pytorch', got {source!r}")
    if source is None:
        if _default_source_factory is not None:
            return _default_source_factory()
        return TorchSource()
    if isinstance(source, Source):
        return source
    if hasattr(source, "stats") and hasattr(source, "malloc"):  # an allocator_ext.Allocator
        return AllocatorSource(source)
    if isinstance(source, Mapping):  # {device: Allocator}
        return AllocatorSource(source)
    raise TypeError(f"cannot use {type(source).__name__} as an agent source")


def _default_snapshot_dir(target: str) -> Path:
    explicit = os.environ.get("ALLOCWATCH_SNAPSHOT_DIR")
    if explicit:
        return Path(explicit)
    if target.startswith("unix://"):
        return Path(target[len("unix://"):]).parent / "snapshots"
    return Path(tempfile.gettempdir()) / "allocwatch-snapshots"


def start_agent(
    target: str | None = None,
    interval: float = 1.0,
    source: Any = None,
    identity: Mapping[str, Any] | None = None,
    *,
    cuda_device: int | None = None,
    snapshot_dir: str | Path | None = None,
    nvml: bool | Any = True,
    buffer_reports: int = 32,
    backoff: Backoff | None = None,
    stop_at_exit: bool = True,
    tls: TlsSettings | None = None,
    token: AgentToken | None = None,
    warn_unconnected_after: float = 60.0,
    connect_at_start: bool = False,
    sidecar_uid: int | None = None,
) -> Agent:
    """Start publishing to the sidecar at `target` (default: ALLOCWATCH_TARGET).

    source: None/"auto" (allocwatch's allocator if installed, else PyTorch's), "allocwatch",
    "pytorch", an allocator_ext.Allocator, a {device: Allocator} mapping, or any Source.
    identity: overrides of Identity fields (e.g. {"training_job": "llm-7b"}).
    nvml: False to skip NVML; True to read it (initialised at the process's first GPU use, on
    the agent's thread); or a pynvml-like module (tests).
    tls: TLS to a TCP target (default: from ALLOCWATCH_TLS_CA etc., see agent/tls.py).
    token: the token for a TCP target (default: ALLOCWATCH_TOKEN_FILE or ALLOCWATCH_TOKEN,
    see agent/auth.py).
    warn_unconnected_after: seconds without ever reaching the sidecar before the agent warns,
    once, in the process's log (counted from the process's first GPU use).
    connect_at_start: connect at once, not at the process's first use of a GPU (a process that
    never uses one -- a DataLoader worker -- otherwise never shows in the sidecar).
    sidecar_uid: on a Unix socket, the user the sidecar must run as (default:
    ALLOCWATCH_SIDECAR_UID, else the socket's owner; see agent/peer.py).
    Never raises for an unreachable sidecar: the agent keeps retrying in the background.
    """
    target = target or os.environ.get("ALLOCWATCH_TARGET")
    if not target:
        raise ValueError("no sidecar target: pass target= or set ALLOCWATCH_TARGET")
    if interval <= 0:
        raise ValueError(f"interval must be > 0 seconds, got {interval}")
    tls = tls if tls is not None else TlsSettings.from_env()
    token = token if token is not None else AgentToken.from_env()
    sidecar_uid = sidecar_uid if sidecar_uid is not None else sidecar_uid_from_env()
    if tls is not None:
        tls.check()
    resolved = _resolve_source(source)
    # NVML starts with the agent's first sample, on its own thread (Agent.start_nvml): a
    # process that never uses a GPU never pays for it, nor does the program's import of torch.
    # An agent that connects at start starts it here: its Hello goes out at once, with the
    # GPU's UUID, which NVML may be the one to know.
    reader: NvmlReader | None = None
    if nvml:
        reader = NvmlReader(None if nvml is True else nvml, cache_seconds=interval / 2)
        if connect_at_start and not reader.start():
            reader = None
    devices = resolved.devices()
    if cuda_device is None:
        env_device = os.environ.get("ALLOCWATCH_CUDA_DEVICE")
        cuda_device = int(env_device) if env_device else (devices[0] if devices else -1)
    uuid = (device_uuid(resolved, reader if connect_at_start else None, cuda_device)
            if cuda_device >= 0 else "")
    torch_version, cuda_version = resolved.versions()
    ident = build_identity(backend=resolved.backend, cuda_device=cuda_device, gpu_uuid=uuid,
                           torch_version=torch_version, cuda_version=cuda_version,
                           overrides=identity)
    agent = Agent(
        target, resolved, ident, interval=interval,
        snapshot_dir=Path(snapshot_dir) if snapshot_dir else _default_snapshot_dir(target),
        nvml=reader, buffer_reports=buffer_reports, backoff=backoff, tls=tls, token=token,
        warn_unconnected_after=warn_unconnected_after, connect_at_start=connect_at_start,
        sidecar_uid=sidecar_uid)
    agent.start()
    if stop_at_exit:
        atexit.register(agent.stop, 1.0)
    log.info("agent started", extra={"target": target, "backend": resolved.backend,
                                     "interval": interval})
    return agent


def _connect_at_start_from_env() -> bool:
    value = os.environ.get("ALLOCWATCH_AGENT_CONNECT", "first-gpu-use")
    if value not in ("first-gpu-use", "start"):
        raise ValueError(f"ALLOCWATCH_AGENT_CONNECT={value!r}: expected first-gpu-use (the "
                         "default) or start")
    return value == "start"


def maybe_start_from_env(source: Any = None) -> Agent | None:
    """Start the agent if ALLOCWATCH_TARGET is set (once per process); never raises."""
    global _env_agent
    target = os.environ.get("ALLOCWATCH_TARGET")
    if not target:
        return None
    with _lock:
        if _env_agent is not None:
            return _env_agent
        try:
            interval = float(os.environ.get("ALLOCWATCH_INTERVAL", "1"))
            chosen = source if source is not None else os.environ.get("ALLOCWATCH_SOURCE", "auto")
            use_nvml = os.environ.get("ALLOCWATCH_AGENT_NVML", "1") != "0"
            warn_after = float(os.environ.get("ALLOCWATCH_WARN_UNCONNECTED_SECONDS", "60"))
            _env_agent = start_agent(target, interval=interval, source=chosen, nvml=use_nvml,
                                     warn_unconnected_after=warn_after,
                                     connect_at_start=_connect_at_start_from_env())
        except Exception as err:  # a bad setting must not stop the training job
            # The reason in the message itself: a program that configured no logging, or no
            # structured handler, still shows it.
            log.warning("allocwatch agent not started: %s", err, extra={"reason": repr(err)})
            return None
        return _env_agent


def _after_fork_in_child() -> None:
    """A forked process keeps its parent's agent objects but none of their threads, and their
    connections are the parent's: every copy is abandoned (Agent.abandon_after_fork), and no
    new agent starts in the child: gRPC is not safe to use in a child forked while its parent
    had a channel. A forked process that uses a GPU itself (a launcher's ranks started with the
    fork method) is best started with spawn; where its parent's agent never connected, it can
    also call start_agent() itself."""
    global _lock
    _lock = threading.Lock()  # another thread of the parent may have held it at the fork
    abandon_inherited_agents()


os.register_at_fork(after_in_child=_after_fork_in_child)
