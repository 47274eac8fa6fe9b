"""The agents' gRPC service: its names, the size limit of every message, and the bounds of
command arguments both sides check."""

from __future__ import annotations

import re

SERVICE_NAME = "allocwatch.v1.AgentService"
CONNECT_METHOD = f"/{SERVICE_NAME}/Connect"

# Reports are small (a few hundred bytes per device); anything near this is a broken or hostile
# peer. Applies to every message the sidecar receives.
DEFAULT_MAX_MESSAGE_BYTES = 1 << 20

# The longest allocator settings string an agent accepts (SetConfig.settings): every key of the
# allocator fits many times over.
MAX_SETTINGS_CHARACTERS = 4096
# RecordHistory.max_entries: PyTorch's own example records 100,000 entries; a trace entry costs
# the core about 100 bytes and PyTorch's, with stacks, a few KiB.
DEFAULT_HISTORY_ENTRIES = 100_000
MAX_HISTORY_ENTRIES = 10_000_000


# Whitespace between two characters of one word. PyTorch's lexer drops whitespace, so
# "expandable_segments:True max_split_size_mb:512" would give expandable_segments the value
# "Truemax_split_size_mb"; around the separators whitespace is harmless.
_SPACE_IN_WORD = re.compile(r"[^\s,:\[\]]\s+[^\s,:\[\]]")


def check_settings_text(text: str) -> str:
    """`text`, an allocator settings string, where its shape is one an agent accepts;
    ValueError naming the problem where it is longer than an agent accepts, or where a space
    splits a word (two settings separated by a space instead of ',' would otherwise be glued
    into one, as PyTorch's parser does). The keys and values are the core's to check."""
    if len(text) > MAX_SETTINGS_CHARACTERS:
        raise ValueError(f"longer than {MAX_SETTINGS_CHARACTERS} characters ({len(text)}): "
                         "no agent accepts it")
    found = _SPACE_IN_WORD.search(text)
    if found:
        before = re.search(r"[^\s,:\[\]]+$", text[:found.start() + 1])
        after = re.match(r"[^\s,:\[\]]+", text[found.end() - 1:])
        assert before is not None and after is not None
        raise ValueError(f"invalid allocator settings {text!r}: a space between "
                         f"{before.group()!r} and {after.group()!r} (settings are separated "
                         "by ',')")
    return text


_HOST_PORT = re.compile(r"^(?:\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._-]+):(?P<port>\d+)$")


def check_target(target: str) -> str:
    """`target`, where it is an address an agent can dial: unix:PATH or unix:///PATH (the
    sidecar's socket), or HOST:PORT ([IPv6]:PORT), where gRPC would take a bare name as a host
    and try it for ever; ValueError saying what was expected."""
    expected = "expected unix:///path/agent.sock or HOST:PORT"
    if target.startswith("unix:"):
        if not target[len("unix:"):].strip("/"):
            raise ValueError(f"{target!r}: no socket path ({expected})")
        return target
    found = _HOST_PORT.match(target)
    if found is None:
        raise ValueError(f"{target!r}: {expected}")
    if not 1 <= int(found.group("port")) <= 65535:
        raise ValueError(f"{target!r}: the port must be 1-65535")
    return target
