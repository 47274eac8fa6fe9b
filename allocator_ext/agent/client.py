"""The in-process agent: a sampler thread and a connection thread, both daemons.

Training is never blocked: sampling runs on its own thread at the report interval; reports go
through a bounded outbox (oldest dropped and counted when the sidecar is slow or away); the
connection thread reconnects with exponential backoff and jitter, and carries out commands.

An agent connects once its process uses a GPU (its source has a device to report): a process
that never does -- a spawned DataLoader worker, torch.compile's compile workers, a preprocessing
pool, a utility run under `allocwatch run` -- has nothing to publish. Connected, it would show
in the sidecar as one more process with its parent's rank and no figures, and its exit (a
DataLoader's workers end with every epoch) would fire AllocwatchAgentGone. `connect_at_start`
connects at once instead (a deployment checked on a machine without a GPU).

A forked process (a DataLoader worker under the fork start method) inherits a copy of the agent
without its threads, and a connection that belongs to its parent: abandon_inherited_agents()
marks every copy stopped, so the child never touches that connection nor waits for it at exit.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc

from allocator_ext.agent import convert
from allocator_ext.agent.auth import AgentToken
from allocator_ext.agent.backoff import Backoff
from allocator_ext.agent.commands import execute
from allocator_ext.agent.identity import device_uuid
from allocator_ext.agent.oom_snapshots import OomSnapshots
from allocator_ext.agent.outbox import Outbox
from allocator_ext.agent.peaks import interval_peaks, largest_free_block
from allocator_ext.agent.peer import socket_problem, unix_path
from allocator_ext.agent.sources import Source
from allocator_ext.agent.tls import TlsSettings
from allocator_ext.protocol.handshake import incompatibility, local_version
from allocator_ext.protocol.nvml import NvmlReader
from allocator_ext.protocol.proto.allocwatch.v1 import agent_pb2 as pb
from allocator_ext.protocol.proto.allocwatch.v1 import agent_pb2_grpc
from allocator_ext.protocol.service import DEFAULT_MAX_MESSAGE_BYTES

log = logging.getLogger("allocator_ext.agent")

_agents: weakref.WeakSet[Agent] = weakref.WeakSet()


def abandon_inherited_agents() -> None:
    """In a forked child: every agent object is its parent's copy (Agent.abandon_after_fork)."""
    for agent in list(_agents):
        agent.abandon_after_fork()


class Agent:
    def __init__(
        self,
        target: str,
        source: Source,
        identity: pb.Identity,
        *,
        interval: float = 1.0,
        snapshot_dir: Path,
        nvml: NvmlReader | None = None,
        buffer_reports: int = 32,
        backoff: Backoff | None = None,
        protocol_version: pb.ProtocolVersion | None = None,
        tls: TlsSettings | None = None,
        token: AgentToken | None = None,
        warn_unconnected_after: float = 60.0,
        connect_at_start: bool = False,
        sidecar_uid: int | None = None,
    ):
        self.target = target
        # On a Unix socket: checked to be the sidecar's before each stream (agent.peer).
        self.socket_path = unix_path(target)
        self.sidecar_uid = sidecar_uid
        self.tls = tls if tls is not None and not target.startswith("unix:") else None
        self.token = token if not target.startswith("unix:") else None
        self.source = source
        self.identity = identity
        self.interval = interval
        self.snapshot_dir = snapshot_dir
        self.oom_snapshots = OomSnapshots(snapshot_dir, identity.rank)
        self.nvml = nvml
        self.outbox = Outbox(buffer_reports)
        self.backoff = backoff or Backoff()
        self.protocol_version = protocol_version or local_version()
        self.sequence = 0
        self.sample_errors = 0
        self.reconnects = 0
        self.connected = threading.Event()
        self.last_error: str | None = None
        self.agent_key: str | None = None
        # An agent that never reaches its sidecar says so once, loudly, in the process's log.
        self.warn_unconnected_after = warn_unconnected_after
        self.ever_connected = False
        self.warned_unconnected = False
        self._started = time.monotonic()
        # Reports handed to gRPC: the load benchmark compares them with the sidecar's count.
        self.reports_sent = 0
        self._stop = threading.Event()
        self._stopping = threading.Event()  # no more sampling; drain, say goodbye, close
        self._stream_closed = threading.Event()
        self.in_use = threading.Event()  # the source has had a device to report
        self._may_connect = threading.Event()  # in use (or connect_at_start), or stopping
        if connect_at_start:
            self.in_use.set()
            self._may_connect.set()
        self._call: Any = None
        self._call_lock = threading.Lock()
        self._sample_lock = threading.Lock()
        self._sampler = threading.Thread(target=self._sample_loop, name="allocwatch-agent-sampler",
                                         daemon=True)
        self._connector = threading.Thread(target=self._connect_loop, name="allocwatch-agent",
                                           daemon=True)
        self._forked_copy = False
        _agents.add(self)

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> Agent:
        self._sampler.start()
        self._connector.start()
        return self

    def stop(self, timeout: float = 2.0) -> None:
        """Stop sampling, send what is queued and a goodbye where connected, then end both
        threads. Bounded by `timeout`: exit is never held up by a slow or absent sidecar."""
        if self._forked_copy or self._stopping.is_set():
            return
        deadline = time.monotonic() + timeout
        self._stopping.set()
        self._sampler.join(max(0.0, deadline - time.monotonic()))
        if self.connected.is_set():
            drain_until = min(deadline, time.monotonic() + timeout / 2)
            while len(self.outbox) and time.monotonic() < drain_until:
                time.sleep(0.005)
            self._stream_closed.clear()
            self.outbox.put_result(pb.AgentMessage(goodbye=pb.Goodbye(reason="process exiting")))
            # The stream closes from our side after the goodbye; the sidecar ends it at once.
            self._stream_closed.wait(max(0.0, deadline - time.monotonic()))
        self._stop.set()
        self._may_connect.set()
        self.outbox.wake()
        with self._call_lock:
            if self._call is not None:
                self._call.cancel()
        self._connector.join(max(0.1, deadline - time.monotonic()))

    def abandon_after_fork(self) -> None:
        """Called in a forked child on the copy of its parent's agent: its threads did not
        survive the fork, its stream is the parent's, and the locks it holds may have been held
        by the parent's threads at that moment. So nothing here takes a lock or calls gRPC: the
        copy just counts as stopped and unconnected, and stop() (atexit's) returns at once."""
        self._forked_copy = True
        self.connected = threading.Event()

    @property
    def dropped(self) -> int:
        return self.outbox.dropped

    # ------------------------------------------------------------------ sampling

    def _sample_loop(self) -> None:
        next_at = time.monotonic()
        while not self._stopping.is_set():
            if self.in_use.is_set() or self._note_first_use():
                self.sample_once()
                self._warn_if_never_connected()
            next_at += self.interval
            delay = next_at - time.monotonic()
            if delay < 0:  # fell behind (suspended process): skip, never burst
                next_at = time.monotonic()
                delay = 0
            self._stopping.wait(delay)

    def _note_first_use(self) -> bool:
        """Whether the process now uses a GPU; from then on the agent samples and connects.
        A source that cannot say counts as in use: its errors then show as sample errors."""
        try:
            devices = self.source.devices()
        except Exception:
            devices = [-1]
        if not devices:
            return False
        self._started = time.monotonic()  # the wait for the sidecar counts from here
        self.start_nvml()  # before the UUID is looked up, which may ask NVML
        if self.identity.cuda_device < 0 and devices[0] >= 0:
            # Started before CUDA was (at the program's import of torch): the device it uses
            # is known now, before the Hello that carries it.
            self.identity.cuda_device = devices[0]
        if not self.identity.gpu_uuid and self.identity.cuda_device >= 0:
            # ALLOCWATCH_GPU_UUID, or the source's at start, stands; else the source's or
            # NVML's now.
            with contextlib.suppress(Exception):  # no UUID rather than no agent
                self.identity.gpu_uuid = device_uuid(self.source, self.nvml,
                                                     self.identity.cuda_device)
        self.in_use.set()
        self._may_connect.set()
        return True

    def start_nvml(self) -> None:
        """Initialise NVML once the process uses a GPU, on the sampler thread: nvmlInit can
        take seconds on a host whose GPUs are not in persistence mode, which the program's
        import of torch, and every DataLoader worker that imports it and never uses a GPU,
        would otherwise wait for. Where NVML cannot be used the agent goes on without it."""
        if self.nvml is not None and not self.nvml.started and not self.nvml.start():
            self.nvml = None

    def _warn_if_never_connected(self) -> None:
        if self.ever_connected or self.warned_unconnected:
            return
        waited = time.monotonic() - self._started
        if waited < self.warn_unconnected_after:
            return
        self.warned_unconnected = True
        # The whole story in the message itself: a process that configured no logging still
        # prints it (logging's last-resort handler shows warnings, without extra fields).
        log.warning(
            "allocwatch: the agent has not reached its sidecar at %s in %.0f s (%s): this "
            "process's allocator figures are not published. Check that the sidecar runs and "
            "listens there (docs/runbooks.md#allocwatchnoagentconnected).",
            self.target, waited, self.last_error or "no answer yet",
            extra={"target": self.target, "waited_seconds": round(waited),
                   "reason": self.last_error or "no answer yet"})

    def sample_once(self) -> pb.Report | None:
        try:
            with self._sample_lock:
                report = self._build_report()
        except Exception as err:
            self.sequence -= 1
            self.sample_errors += 1
            if self.sample_errors == 1 or self.sample_errors % 100 == 0:
                log.warning("sampling the allocator failed", extra={"reason": repr(err),
                                                                   "errors": self.sample_errors})
            return None
        self.outbox.put_report(pb.AgentMessage(report=report))
        return report

    def _build_report(self) -> pb.Report:
        self.sequence += 1
        report = pb.Report(sequence=self.sequence, timestamp_seconds=time.time())
        for device in self.source.devices():
            uuid = self.source.gpu_uuid(device) or (
                self.identity.gpu_uuid if device == self.identity.cuda_device else "")
            stats = self.source.memory_stats(device)
            entry = report.devices.add(
                cuda_device=device, gpu_uuid=uuid,
                allocator=convert.allocator_stats(stats),
                settings=self.source.settings(device),
                interval_peaks=interval_peaks(self.source, device, stats))
            largest = largest_free_block(self.source, device)
            if largest is not None:
                entry.allocator.largest_free_block_bytes = largest
            self.oom_snapshots.observe(self.source, device, stats)
            nvml = self.nvml  # start_nvml may drop it meanwhile, on the sampler thread
            gpu = nvml.find(uuid=uuid, index=device) if nvml is not None else None
            if gpu is not None:
                if not entry.gpu_uuid:
                    entry.gpu_uuid = gpu.uuid
                entry.device_memory.total_bytes = gpu.total_bytes
                entry.device_memory.used_bytes = gpu.used_bytes
                own = gpu.process_used_bytes.get(self.identity.pid)
                if own is not None:  # NVML lists host PIDs: matches only in the host PID space
                    entry.device_memory.has_process_used_bytes = True
                    entry.device_memory.process_used_bytes = own
        report.agent.reports_sampled_total = self.sequence
        # Dropped counts up to the previous report: this one may itself be dropped later.
        report.agent.reports_dropped_total = self.outbox.dropped
        report.agent.sample_errors_total = self.sample_errors
        report.agent.reconnects_total = self.reconnects
        return report

    # ------------------------------------------------------------------ connection

    def _connect_loop(self) -> None:
        self._may_connect.wait()
        while not self._stop.is_set():
            try:
                self._run_stream()
            except Exception as err:  # a bug here must not end the agent, nor the process
                log.exception("agent stream failed unexpectedly")
                self.last_error = repr(err)
            self.connected.clear()
            self._stream_closed.set()
            if self._stop.is_set() or self._stopping.is_set():
                break
            self.reconnects += 1
            self._stop.wait(self.backoff.next_delay())

    def _requests(self, hello: pb.AgentMessage, stream_done: threading.Event
                  ) -> Iterator[pb.AgentMessage]:
        yield hello
        # Reports only after the sidecar accepted us (Welcome), so none is spent on a refusal.
        while not self.connected.wait(0.1):
            if stream_done.is_set() or self._stop.is_set():
                return
        while not stream_done.is_set() and not self._stop.is_set():
            message = self.outbox.get(timeout=0.2)
            if message is None:
                continue
            kind = message.WhichOneof("body")
            if kind == "report":
                self.reports_sent += 1
            yield message
            if kind == "goodbye":
                return  # half-close: the sidecar sees the goodbye, then the end of our stream

    def _run_stream(self) -> None:
        if self.socket_path is not None:
            problem = socket_problem(self.socket_path, self.sidecar_uid)
            if problem is not None:  # nothing is sent to a socket that may not be the sidecar's
                self._note_error(f"not the sidecar's socket: {problem}")
                return
        hello = pb.AgentMessage(hello=pb.Hello(protocol_version=self.protocol_version,
                                               identity=self.identity))
        stream_done = threading.Event()
        options = [("grpc.max_receive_message_length", DEFAULT_MAX_MESSAGE_BYTES),
                   ("grpc.enable_retries", 0),
                   # A connection of its own (gRPC shares one between the channels of a process
                   # otherwise): the sidecar bounds the streams of a connection, and judges a
                   # connection by the agent it carries.
                   ("grpc.use_local_subchannel_pool", 1)]
        if self.tls is not None:
            try:
                credentials = self.tls.credentials()
            except OSError as err:
                self._note_error(f"TLS: cannot read {err}")
                return
            channel_cm = grpc.secure_channel(self.target, credentials,
                                             options=options + self.tls.options())
        else:
            channel_cm = grpc.insecure_channel(self.target, options=options)
        with channel_cm as channel:
            stub = agent_pb2_grpc.AgentServiceStub(channel)
            call = stub.Connect(self._requests(hello, stream_done),
                                metadata=self.token.metadata() if self.token else None)
            with self._call_lock:
                self._call = call
            try:
                for message in call:
                    self._handle(message)
                self.last_error = "the sidecar ended the stream"
            except grpc.RpcError as err:
                code = err.code() if hasattr(err, "code") else None
                if code != grpc.StatusCode.CANCELLED or not self._stop.is_set():
                    self._note_error(f"{code.name if code else 'error'}: "
                                     f"{err.details() if hasattr(err, 'details') else err}")
            finally:
                stream_done.set()
                with self._call_lock:
                    self._call = None

    def _note_error(self, text: str) -> None:
        if text != self.last_error:  # one line per distinct problem, not one per retry
            log.warning("agent cannot reach the sidecar", extra={"target": self.target,
                                                                 "reason": text})
        self.last_error = text

    def _handle(self, message: pb.SidecarMessage) -> None:
        kind = message.WhichOneof("body")
        if kind == "welcome":
            why = incompatibility(message.welcome.protocol_version, self.protocol_version)
            if why is not None:
                self._note_error(f"sidecar {why}")
                with self._call_lock:
                    if self._call is not None:
                        self._call.cancel()
                return
            self.agent_key = message.welcome.agent_key
            self.backoff.reset()
            self.ever_connected = True
            self.connected.set()
            log.info("agent connected to the sidecar", extra={"target": self.target,
                                                              "agent": self.agent_key})
            self.last_error = None
            # The sidecar gets our figures right away, not an interval later.
            self.sample_once()
        elif kind == "command":
            result = execute(message.command, self.source, self.snapshot_dir, self.identity.rank)
            self.outbox.put_result(pb.AgentMessage(command_result=result))
