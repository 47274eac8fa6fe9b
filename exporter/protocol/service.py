"""The agents' gRPC service: its names, and the size limit of every message."""

from __future__ import annotations

SERVICE_NAME = "allocwatch.v1.AgentService"
CONNECT_METHOD = f"/{SERVICE_NAME}/Connect"

# Reports are small (a few hundred bytes per device); anything near this is a broken or hostile
# peer. Applies to every message the sidecar receives.
DEFAULT_MAX_MESSAGE_BYTES = 1 << 20

# The longest allocator settings string an agent accepts (SetConfig.settings): every key of the
# allocator fits many times over.
MAX_SETTINGS_CHARACTERS = 4096
