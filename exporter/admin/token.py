"""The admin API's bearer token, read again when its file changes: a rotated Kubernetes Secret
(the kubelet swaps the mounted file's symlink) takes effect at the next request, no restart.

Each request on TCP stats the file (a few microseconds; admin requests are rare) and reads it
only when its content stamp moved. A token that cannot be read, or is too short, leaves the one
in force, logged once per change of the file; a file that changed while it was read (perhaps
caught mid-write, a cut token of 16 bytes or more) is read again at the next request."""

from __future__ import annotations

import logging
import threading

from exporter.admin.config import AdminConfig, read_token
from exporter.config import ConfigError
from exporter.protocol.files import Stamp, content_stamp

log = logging.getLogger("exporter.admin")


class RotatingToken:
    """`current()` is the token in force: None where none is configured."""

    def __init__(self, config: AdminConfig):
        self._config = config
        self._lock = threading.Lock()
        self._stamp = self._file_stamp()
        self._token = read_token(config)  # ConfigError at start: the sidecar refuses to run

    def _file_stamp(self) -> Stamp | None:
        return content_stamp(self._config.token_file) if self._config.token_file else None

    def current(self) -> bytes | None:
        if not self._config.token_file:  # none, or from the environment: fixed for the process
            return self._token
        with self._lock:
            stamp = self._file_stamp()
            if stamp == self._stamp:
                return self._token
            try:
                token = read_token(self._config)
            except ConfigError as err:
                self._stamp = stamp  # logged once for this content; a new write reads again
                log.error("admin API: the changed token file cannot be used; the token in "
                          "force stays", extra={"reason": str(err)})
                return self._token
            if self._file_stamp() == stamp:
                if token != self._token:
                    log.info("admin API: token file changed; the new token is in force",
                             extra={"path": self._config.token_file})
                self._token, self._stamp = token, stamp
            return self._token
