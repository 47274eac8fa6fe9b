"""The agent carries out the sidecar's commands — only these, with validated arguments —
and answers each with its result and the settings now in force."""

from __future__ import annotations

import logging
import time
from pathlib import Path

from allocator_ext.agent.snapshots import DEFAULT_MAX_BYTES, write_snapshot
from allocator_ext.agent.sources import CommandRefusedNow, Source, UnsupportedCommand
from allocator_ext.protocol.proto.allocwatch.v1 import agent_pb2 as pb
from allocator_ext.protocol.service import (
    DEFAULT_HISTORY_ENTRIES,
    MAX_HISTORY_ENTRIES,
    MAX_SETTINGS_CHARACTERS,
)

log = logging.getLogger("allocator_ext.agent")
Status = pb.CommandResult.Status


def _target_devices(source: Source, command: pb.Command) -> list[int]:
    devices = source.devices()
    if command.cuda_device < 0:
        return devices
    if command.cuda_device not in devices:
        raise ValueError(f"cuda_device {command.cuda_device} is not used by this process "
                         f"(it uses {devices})")
    return [command.cuda_device]


def _record_history(command: pb.Command, source: Source) -> str:
    wanted = command.record_history
    entries = wanted.max_entries or DEFAULT_HISTORY_ENTRIES
    if entries > MAX_HISTORY_ENTRIES:
        raise ValueError(f"record_history.max_entries must be at most {MAX_HISTORY_ENTRIES}, "
                         f"got {entries}")
    record = getattr(source, "record_history", None)
    if record is None:
        raise UnsupportedCommand(f"the {type(source).__name__} source has no memory history")
    devices = _target_devices(source, command)
    if not devices:
        raise ValueError("this process uses no CUDA device yet")
    for device in devices:
        record(device, wanted.enabled, entries)
    where = ", ".join(f"cuda:{d}" for d in devices)
    if wanted.enabled:
        return f"memory history on for {where} (the last {entries} entries)"
    return f"memory history off for {where}"


def execute(command: pb.Command, source: Source, snapshot_dir: Path, rank: int) -> pb.CommandResult:
    result = pb.CommandResult(command_id=command.id)
    action = command.WhichOneof("action")
    try:
        if action == "set_config":
            text = command.set_config.settings
            if not text.strip() or len(text) > MAX_SETTINGS_CHARACTERS:
                raise ValueError(
                    f"set_config.settings must be 1-{MAX_SETTINGS_CHARACTERS} characters")
            source.set_config(text)
            result.message = f"applied {text}"
        elif action == "reclaim":
            empty = command.reclaim.mode == pb.Reclaim.EMPTY_CACHE
            started = time.perf_counter()
            for device in _target_devices(source, command):
                result.bytes_released += source.reclaim(device, empty_cache=empty)
            # The reclaim call includes the device-wide synchronisation it needs.
            result.sync_seconds = time.perf_counter() - started
            result.message = f"released {result.bytes_released} bytes"
        elif action == "reset_peaks":
            for device in _target_devices(source, command):
                source.reset_peaks(device)
            result.message = "peak statistics reset"
        elif action == "snapshot":
            devices = _target_devices(source, command)
            if not devices:
                raise ValueError("this process uses no CUDA device yet")
            device = devices[0]
            cap = command.snapshot.max_bytes or DEFAULT_MAX_BYTES
            path, size = write_snapshot(
                snapshot_dir, source.snapshot(device), rank=rank, device=device,
                include_frames=command.snapshot.include_frames,
                max_bytes=min(cap, DEFAULT_MAX_BYTES))
            result.snapshot_path, result.snapshot_bytes = str(path), size
            result.message = f"snapshot of cuda:{device} written"
        elif action == "record_history":
            result.message = _record_history(command, source)
        else:
            raise UnsupportedCommand(f"unknown command {action or '(none)'}: this agent knows "
                                     "set_config, reclaim, reset_peaks, snapshot, record_history")
        result.status = Status.OK
    except UnsupportedCommand as err:
        result.status, result.message = Status.UNSUPPORTED, str(err)
    except CommandRefusedNow as err:
        result.status, result.message = Status.FAILED, str(err)
    except ValueError as err:
        result.status, result.message = Status.INVALID_ARGUMENT, str(err)
    except Exception as err:  # never let a command take the training process down
        log.exception("command %s failed", action)
        result.status, result.message = Status.FAILED, f"{type(err).__name__}: {err}"
    try:
        for device in source.devices():
            result.settings_in_force.add(cuda_device=device, settings=source.settings(device))
    except Exception:
        log.exception("reading the settings in force failed")
    log.info("command done", extra={"command": action, "status": Status.Name(result.status),
                                    "detail": result.message})
    return result
