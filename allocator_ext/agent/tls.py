"""TLS for an agent that reaches its sidecar over TCP.

Settings come from start_agent(tls=...) or the environment: ALLOCWATCH_TLS_CA (the CA that
signed the sidecar's certificate; its presence turns TLS on), ALLOCWATCH_TLS_CERT and
ALLOCWATCH_TLS_KEY (the agent's own certificate, for mutual TLS) and ALLOCWATCH_TLS_SERVER_NAME
(when the certificate's name differs from the target's host). Unix sockets never use TLS.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping

import grpc

from allocator_ext.protocol.files import read_regular_file

# A PEM certificate chain or key is a few kilobytes.
MAX_PEM_BYTES = 1 << 20


@dataclasses.dataclass(frozen=True)
class TlsSettings:
    ca_file: str
    cert_file: str = ""
    key_file: str = ""
    server_name: str = ""

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> TlsSettings | None:
        ca = environ.get("ALLOCWATCH_TLS_CA", "")
        if not ca:
            return None
        return cls(ca, environ.get("ALLOCWATCH_TLS_CERT", ""),
                   environ.get("ALLOCWATCH_TLS_KEY", ""),
                   environ.get("ALLOCWATCH_TLS_SERVER_NAME", ""))

    def check(self) -> None:
        """Raises ValueError naming a file that is missing or unreadable."""
        if bool(self.cert_file) != bool(self.key_file):
            raise ValueError("TLS: give both the agent's certificate and its key, or neither")
        for what, path in (("CA", self.ca_file), ("certificate", self.cert_file),
                           ("key", self.key_file)):
            if path and not os.access(path, os.R_OK):
                raise ValueError(f"TLS: cannot read the {what} file {path}")

    def credentials(self) -> grpc.ChannelCredentials:
        """Read at each connection (renewed files take effect at the next); OSError naming a
        file that is no regular file of at most MAX_PEM_BYTES (a FIFO would hold the
        connection thread, /dev/zero fill the training process's memory)."""
        def read(path: str) -> bytes | None:
            if not path:
                return None
            data = read_regular_file(path, MAX_PEM_BYTES)
            if len(data) > MAX_PEM_BYTES:
                raise OSError(f"larger than {MAX_PEM_BYTES} bytes: {path}")
            return data

        return grpc.ssl_channel_credentials(read(self.ca_file), read(self.key_file),
                                            read(self.cert_file))

    def options(self) -> list[tuple[str, str]]:
        return [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []
