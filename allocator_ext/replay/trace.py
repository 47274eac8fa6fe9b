"""Reading PyTorch memory snapshots (``torch.cuda.memory._dump_snapshot``) safely.

A trace file may come from anywhere, and pickle can run arbitrary code while loading: the
unpickler here builds plain data only (dicts, lists, tuples, strings, numbers) and refuses any
class. Every structural problem raises :class:`TraceError` with a message that says what is
wrong and where.
"""

from __future__ import annotations

import bisect
import gzip
import io
import pickle
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from allocator_ext.protocol.snapshots import RECORDING_KEY

# Actions the replay acts on, and the ones it knows and passes over.
REPLAYED_ACTIONS = {"alloc", "free_requested", "free_completed"}
SEGMENT_ACTIONS = {"segment_alloc", "segment_free", "segment_map", "segment_unmap"}
KNOWN_ACTIONS = REPLAYED_ACTIONS | SEGMENT_ACTIONS | {"oom", "snapshot", "user_defined"}

MAX_TRACE_BYTES = 2 << 30  # refuse absurd inputs before decompressing them into memory
# Gaps between events longer than this are idle time (data loading, evaluation, a pause),
# not allocator-relevant activity.
ACTIVE_GAP_CAP_US = 100_000


class TraceError(ValueError):
    """The file is not a usable PyTorch memory snapshot; the message says why."""


class _PlainDataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        raise TraceError(
            f"the trace contains a Python object ({module}.{name}); a memory snapshot holds "
            "only plain data, so this file is refused rather than executed"
        )


@dataclass(frozen=True)
class TraceEvent:
    action: str
    addr: int
    size: int
    stream: int
    time_us: int


@dataclass(frozen=True)
class RecordedLimits:
    """The recorded run's memory limits, where the snapshot keeps them (RECORDING_KEY): the
    per-process memory fraction in force and the device total it is a fraction of."""

    memory_fraction: float | None = None
    device_total_bytes: int | None = None


@dataclass
class Trace:
    """One device's history from a snapshot, plus the snapshot's own figures."""

    path: str
    events: list[TraceEvent]
    device: int
    allocator_settings: dict[str, Any] = field(default_factory=dict)
    final_segments: list[dict[str, Any]] = field(default_factory=list)
    limits: RecordedLimits = field(default_factory=RecordedLimits)

    @property
    def recorded_config(self) -> str:
        """The allocator settings the trace was recorded under, as a settings string."""
        return str(self.allocator_settings.get("PYTORCH_CUDA_ALLOC_CONF") or "")


@dataclass(frozen=True)
class Lifetime:
    """One request of the recorded program: its size and stream, from the event that allocated
    it to the one that completed its free (the trace's length if never freed)."""

    start: int
    end: int
    size: int
    stream: int


def lifetimes(trace: Trace) -> list[Lifetime]:
    """Every request's lifetime, in the order the requests were freed (the unfreed last)."""
    live: dict[int, tuple[int, int, int]] = {}
    out: list[Lifetime] = []
    for i, e in enumerate(trace.events):
        if e.action == "alloc":
            live[e.addr] = (i, e.size, e.stream)
        elif e.action == "free_completed" and e.addr in live:
            start, size, stream = live.pop(e.addr)
            out.append(Lifetime(start, i, size, stream))
    end = len(trace.events)
    out.extend(Lifetime(start, end, size, stream) for start, size, stream in live.values())
    return out


def peak_requested_by_stream(trace: Trace) -> tuple[int, dict[int, int]]:
    """The most memory the recorded program asked for at once (live requests, including frees
    still waiting for other streams), and the same for each stream's requests alone."""
    live: dict[int, tuple[int, int]] = {}
    current = peak = 0
    stream_current: dict[int, int] = {}
    stream_peak: dict[int, int] = {}
    for e in trace.events:
        if e.action == "alloc":
            live[e.addr] = (e.size, e.stream)
            current += e.size
            peak = max(peak, current)
            stream_current[e.stream] = stream_current.get(e.stream, 0) + e.size
            stream_peak[e.stream] = max(stream_peak.get(e.stream, 0), stream_current[e.stream])
        elif e.action == "free_completed" and e.addr in live:
            size, stream = live.pop(e.addr)
            current -= size
            stream_current[stream] -= size
    return peak, stream_peak


def peak_requested_bytes(trace: Trace) -> int:
    """The most memory the recorded program asked for at once (live requests, including
    frees still waiting for other streams)."""
    return peak_requested_by_stream(trace)[0]


def active_times(trace: Trace) -> list[float]:
    """Each event's time on the trace's active clock, in seconds from its first event: the gaps
    between events counted up to ACTIVE_GAP_CAP_US each (idle time is not work)."""
    times: list[float] = []
    total = 0
    previous = trace.events[0].time_us if trace.events else 0
    for e in trace.events:
        total += min(max(e.time_us - previous, 0), ACTIVE_GAP_CAP_US)
        previous = e.time_us
        times.append(total / 1e6)
    return times


def free_completes_at_once(events: list[TraceEvent], i: int) -> bool:
    """Whether the free requested at events[i] took effect at once (its `free_completed` is the
    next event) rather than after the block's work on other streams: a cross-stream wait,
    which a replay makes the block wait for (record_stream on a stream of its own)."""
    nxt = events[i + 1] if i + 1 < len(events) else None
    return nxt is not None and nxt.action == "free_completed" and nxt.addr == events[i].addr


def private_pools(trace: Trace) -> list[tuple[int, int] | None]:
    """Per event: for an allocation served from a private pool in the recorded run (a CUDA
    graph's, or a torch.cuda.MemPool's), that pool's id; None otherwise. The trace's events do
    not name pools, but the snapshot's segments do: an allocation inside a segment the
    snapshot still lists with a pool id came from that pool (a segment freed before the
    snapshot was taken, even one at an address a pool's segment took later, counts as the
    default pool's)."""
    pool_at = {(s.get("address"), s.get("total_size")): tuple(s.get("segment_pool_id") or (0, 0))
               for s in trace.final_segments}
    # The segment allocations still alive when the snapshot was taken: the last at their
    # address, with no free after it.
    last_alloc: dict[int, int] = {}
    for i, e in enumerate(trace.events):
        if e.action == "segment_alloc":
            last_alloc[e.addr] = i
        elif e.action == "segment_free":
            last_alloc.pop(e.addr, None)
    starts: list[int] = []                                  # live segments, sorted by address
    ends: dict[int, tuple[int, tuple[int, int]]] = {}       # start -> (end, pool)
    out: list[tuple[int, int] | None] = [None] * len(trace.events)
    for i, e in enumerate(trace.events):
        if e.action == "segment_alloc":
            bisect.insort(starts, e.addr)
            alive_at_end = last_alloc.get(e.addr) == i
            pool = pool_at.get((e.addr, e.size), (0, 0)) if alive_at_end else (0, 0)
            ends[e.addr] = (e.addr + e.size, pool)
        elif e.action == "segment_free" and e.addr in ends:
            starts.remove(e.addr)
            del ends[e.addr]
        elif e.action == "alloc":
            j = bisect.bisect_right(starts, e.addr) - 1
            if j >= 0:
                end, pool = ends[starts[j]]
                if e.addr < end and pool != (0, 0):
                    out[i] = pool
    return out


def _read_bytes(path: Path) -> bytes:
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise TraceError(f"cannot read {path}: {e.strerror}") from e
    if raw[:2] == b"\x1f\x8b":
        try:
            with gzip.GzipFile(fileobj=io.BytesIO(raw)) as f:
                raw = f.read(MAX_TRACE_BYTES + 1)
        except (OSError, EOFError, zlib.error) as e:
            raise TraceError(f"{path} is a damaged or truncated gzip file ({e})") from e
    if len(raw) > MAX_TRACE_BYTES:
        raise TraceError(f"{path} is larger than {MAX_TRACE_BYTES >> 30} GiB uncompressed")
    return raw


def _unpickle(raw: bytes, path: Path) -> Any:
    try:
        return _PlainDataUnpickler(io.BytesIO(raw)).load()
    except TraceError:
        raise
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, IndexError,
            KeyError, AttributeError, MemoryError, RecursionError, OverflowError) as e:
        raise TraceError(f"{path} is not a readable pickle (truncated or corrupt: {e})") from e


def _event(raw: Any, index: int) -> TraceEvent:
    if not isinstance(raw, dict):
        raise TraceError(f"event {index} is a {type(raw).__name__}, not a dict")
    action = raw.get("action")
    if not isinstance(action, str):
        raise TraceError(f"event {index} has no 'action' string")
    values = {}
    # PyTorch writes an out-of-memory event's device free memory where others have an address.
    addr_key = "device_free" if action == "oom" and "device_free" in raw else "addr"
    for key in (addr_key, "size", "stream", "time_us"):
        v = raw.get(key, 0)
        # What the core's 64-bit fields hold (time: PyTorch's int64 microseconds; a size: at
        # most the largest request the core serves, kMaxRequest in csrc/core/sizes.h).
        limit = {"time_us": (1 << 63) - 1, "size": 1 << 63}.get(key, (1 << 64) - 1)
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= limit:
            raise TraceError(f"event {index} ({action}) has a bad '{key}': {v!r}")
        values[key] = v
    return TraceEvent(action, values[addr_key], values["size"], values["stream"],
                      values["time_us"])


def _recorded_limits(data: dict[str, Any], path: str) -> RecordedLimits:
    recording = data.get(RECORDING_KEY)
    if recording is None:
        return RecordedLimits()
    if not isinstance(recording, dict):
        raise TraceError(f"{path}: '{RECORDING_KEY}' is a {type(recording).__name__}, not a dict")
    fraction = recording.get("memory_fraction")
    if fraction is not None and (isinstance(fraction, bool)
                                 or not isinstance(fraction, (int, float))
                                 or not 0 < fraction <= 1):
        raise TraceError(f"{path}: {RECORDING_KEY}['memory_fraction'] must be a number in "
                         f"(0, 1] or None, not {fraction!r}")
    total = recording.get("device_total_bytes")
    if total is not None and (isinstance(total, bool) or not isinstance(total, int)
                              or total <= 0):
        raise TraceError(f"{path}: {RECORDING_KEY}['device_total_bytes'] must be a positive "
                         f"integer or None, not {total!r}")
    return RecordedLimits(None if fraction is None else float(fraction), total)


def parse_snapshot(data: Any, path: str = "<snapshot>", device: int | None = None) -> Trace:
    """Checks the snapshot's structure and returns the trace of one device."""
    if not isinstance(data, dict):
        raise TraceError(f"{path}: a snapshot is a dict, this is a {type(data).__name__}")
    traces = data.get("device_traces")
    if not isinstance(traces, list) or not all(isinstance(t, list) for t in traces):
        raise TraceError(
            f"{path}: no 'device_traces' list; record with "
            "torch.cuda.memory._record_memory_history() before taking the snapshot"
        )
    active = [i for i, t in enumerate(traces) if t]
    if device is None:
        if not active:
            raise TraceError(f"{path}: the snapshot holds no recorded events")
        device = active[0]
    if not 0 <= device < len(traces):
        raise TraceError(f"{path}: no trace for device {device} (devices: 0..{len(traces) - 1})")
    if not traces[device]:
        raise TraceError(f"{path}: the snapshot holds no recorded events for device {device}")
    events = [_event(e, i) for i, e in enumerate(traces[device])]
    settings = data.get("allocator_settings")
    segments = data.get("segments")
    return Trace(
        path=path,
        events=events,
        device=device,
        allocator_settings=settings if isinstance(settings, dict) else {},
        final_segments=[s for s in segments if isinstance(s, dict)]
        if isinstance(segments, list)
        else [],
        limits=_recorded_limits(data, path),
    )


def load_trace(path: str | Path, device: int | None = None) -> Trace:
    """Loads a ``.pickle`` or ``.pickle.gz`` memory snapshot."""
    p = Path(path)
    return parse_snapshot(_unpickle(_read_bytes(p), p), str(p), device)
