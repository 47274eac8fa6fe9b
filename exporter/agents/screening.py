"""What the sidecar takes from an agent's messages before it holds or serves any of it.

Every string from the wire has a length limit (most become label values, shown in every scrape
for as long as the agent's series live) and holds no control character but tabs and line feeds
(a terminal acts on the others where ctl prints them, and JSON writes each in six bytes); a
report names at most MAX_DEVICES_PER_REPORT devices, and a command's result at most as many
device settings. A message past these limits ends its stream: it comes from a
broken or hostile agent.

Figures no allocator can have (`implausible`) are never kept: the device entry carrying one is
left out of the report the sidecar stores (`screened_report`), and the reason counted.
"""

from __future__ import annotations

import functools
import math
import re

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message

from allocator_ext.protocol.proto.allocwatch.v1 import agent_pb2 as pb
from allocator_ext.protocol.service import MAX_SETTINGS_CHARACTERS

# Labels and names: GPU and MIG UUIDs, host and pod names (DNS: 253), jobs, versions.
MAX_STRING = 256
# The few longer texts, by field name: settings strings, an agent's messages, paths.
MAX_STRING_OF = {
    "config_string": 2 * MAX_SETTINGS_CHARACTERS,
    "message": 2 * MAX_SETTINGS_CHARACTERS,
    "snapshot_path": 4096,  # PATH_MAX
    "reason": 1024,
}
# One process drives at most this many GPUs (the largest nodes have 16).
MAX_DEVICES_PER_REPORT = 16

# C0 control characters but tab and line feed (which JSON writes in two bytes and label values
# escape), DEL and C1.
_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f]")

_STRING = FieldDescriptor.TYPE_STRING
_MESSAGE = FieldDescriptor.TYPE_MESSAGE


@functools.cache
def _holds_strings(descriptor: Descriptor) -> bool:
    """Whether a message type has a string field at any depth (the figures have none: no need
    to look into them)."""
    return any(f.type == _STRING or (f.type == _MESSAGE and f.message_type is not descriptor
                                      and _holds_strings(f.message_type))
               for f in descriptor.fields)


def long_string(message: Message, path: str = "") -> str | None:
    """Why `message` is refused for a string over its limit (naming the field by its path in
    the message), or None."""
    for field, value in message.ListFields():  # a repeated field's value is its container
        where = f"{path}{field.name}"
        if field.type == _STRING:
            limit = MAX_STRING_OF.get(field.name, MAX_STRING)
            texts = (value,) if isinstance(value, str) else value
            if any(len(text) > limit for text in texts):
                return f"{where} is longer than {limit} characters"
            for text in texts:
                char = _CONTROL.search(text)
                if char is not None:
                    return f"{where} holds a control character (U+{ord(char.group()):04X})"
        elif field.type == _MESSAGE and _holds_strings(field.message_type):
            if isinstance(value, Message):
                found = long_string(value, f"{where}.")
            else:
                found = next((problem for index, item in enumerate(value)
                              if (problem := long_string(item, f"{where}[{index}].")) is not None),
                             None)
            if found is not None:
                return found
    return None


def message_problem(message: pb.AgentMessage) -> str | None:
    """Why a message from an agent ends its stream, or None."""
    if message.HasField("report") and len(message.report.devices) > MAX_DEVICES_PER_REPORT:
        return (f"a report has {len(message.report.devices)} devices, more than "
                f"{MAX_DEVICES_PER_REPORT}")
    if message.HasField("command_result"):
        entries = len(message.command_result.settings_in_force)
        if entries > MAX_DEVICES_PER_REPORT:
            return (f"command_result.settings_in_force has {entries} entries, more than "
                    f"{MAX_DEVICES_PER_REPORT} (a process's devices)")
    return long_string(message)


# A byte count or counter at or above this is a negative number sent as unsigned.
_UNSIGNED_LIMIT = 1 << 63
_UINT64 = FieldDescriptor.TYPE_UINT64
_DOUBLE = FieldDescriptor.TYPE_DOUBLE


def _number_problem(message: Message) -> str | None:
    for field, value in message.ListFields():
        if field.type == _DOUBLE and not math.isfinite(value):
            return "non_finite"
        if field.type == _UINT64 and value >= _UNSIGNED_LIMIT:
            return "out_of_range"
        if field.type == _MESSAGE and isinstance(value, Message):
            found = _number_problem(value)
            if found is not None:
                return found
    return None


def implausible(device: pb.DeviceReport) -> str | None:
    """Why a device entry holds a figure no allocator can have (non_finite, out_of_range,
    inconsistent), or None."""
    found = _number_problem(device)
    if found is not None:
        return found
    if not 0.0 <= device.settings.garbage_collection_threshold <= 1.0:
        return "out_of_range"
    stats = device.allocator
    if any(pool.allocated_bytes > pool.reserved_bytes
           for pool in (stats.all, stats.small_pool, stats.large_pool)):
        return "inconsistent"
    memory = device.device_memory
    if memory.used_bytes > memory.total_bytes or memory.process_used_bytes > memory.total_bytes:
        return "inconsistent"
    return None


def screened_report(report: pb.Report) -> tuple[pb.Report, list[str]]:
    """The report as the sidecar keeps it — without the device entries that hold an
    implausible figure, and with a timestamp that is no time cleared (0: unknown) — and the
    reasons of what was left out. The report itself when nothing is (the common case: no
    copy)."""
    reasons = [implausible(d) for d in report.devices]
    bad_time = not (math.isfinite(report.timestamp_seconds) and report.timestamp_seconds >= 0)
    if not bad_time and not any(reasons):
        return report, []
    kept = pb.Report()
    kept.CopyFrom(report)
    del kept.devices[:]
    kept.devices.extend(d for d, why in zip(report.devices, reasons, strict=True) if why is None)
    dropped = [why for why in reasons if why is not None]
    if bad_time:
        kept.timestamp_seconds = 0.0
        dropped.append("non_finite")
    return kept, dropped


def screened_result(result: pb.CommandResult) -> tuple[pb.CommandResult, list[str]]:
    """A command's result as the admin API and the policy see it: a sync time that is no time
    cleared (0), and the reason, as for reports."""
    if math.isfinite(result.sync_seconds) and result.sync_seconds >= 0:
        return result, []
    kept = pb.CommandResult()
    kept.CopyFrom(result)
    kept.sync_seconds = 0.0
    return kept, ["non_finite" if not math.isfinite(result.sync_seconds) else "out_of_range"]
