"""The token an agent presents to a sidecar over TCP (any local user reaches a TCP port, so the
sidecar asks for the pod's token there; a Unix socket is guarded by its file mode instead).

Settings come from start_agent(token=...) or the environment: ALLOCWATCH_TOKEN_FILE (the file
the sidecar shares, read at each connection: the sidecar may create it after the agent starts)
or ALLOCWATCH_TOKEN (the token itself). The token is sent as gRPC metadata and shown nowhere:
not in logs, not in the object's repr.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping

from allocator_ext.protocol.files import MAX_TOKEN_BYTES, read_regular_file


@dataclasses.dataclass(frozen=True)
class AgentToken:
    file: str = ""
    value: str = dataclasses.field(default="", repr=False)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> AgentToken | None:
        file, value = environ.get("ALLOCWATCH_TOKEN_FILE", ""), environ.get("ALLOCWATCH_TOKEN", "")
        return cls(file, value) if file or value else None

    def read(self) -> str:
        """The token now ("" when the file cannot be read yet, or is no regular file of at most
        MAX_TOKEN_BYTES: the sidecar then refuses the stream, saying why, and the agent retries
        with its backoff). Read without blocking and bounded: a FIFO or /dev/zero named here
        must neither hold the agent's connection thread nor fill the training process's
        memory."""
        if self.value:
            return self.value.strip()
        try:
            raw = read_regular_file(self.file, MAX_TOKEN_BYTES)
            return raw.decode("ascii").strip() if len(raw) <= MAX_TOKEN_BYTES else ""
        except (OSError, UnicodeDecodeError):
            return ""

    def metadata(self) -> tuple[tuple[str, str], ...]:
        token = self.read()
        return (("authorization", f"Bearer {token}"),) if token else ()
