"""The agents' gRPC service: its names, the size limit of every message, and the bounds of
command arguments both sides check."""

from __future__ import annotations

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
