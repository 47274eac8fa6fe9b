"""What the sidecar takes from an agent's messages before it holds or serves any of it.

Every string from the wire has a length limit (most become label values, shown in every scrape
for as long as the agent's series live); a report names at most MAX_DEVICES_PER_REPORT devices.
A message past these limits ends its stream: it comes from a broken or hostile agent.
"""

from __future__ import annotations

import functools

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message

from exporter.protocol.proto.allocwatch.v1 import agent_pb2 as pb
from exporter.protocol.service import MAX_SETTINGS_CHARACTERS

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
            if any(len(text) > limit for text in ((value,) if isinstance(value, str) else value)):
                return f"{where} is longer than {limit} characters"
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
    return long_string(message)
