"""HTTPS for the admin API's TCP listener: the token then never crosses a network in clear, and
with a client CA, clients must also present a certificate signed by it (mutual TLS). The
handshake runs on the event loop (asyncio's TLS), bounded by the listener's idle deadline."""

from __future__ import annotations

import logging
import ssl
import threading

from allocator_ext.protocol.files import Stamp, content_stamp

log = logging.getLogger("exporter.admin")


def server_tls_context(cert_file: str, key_file: str, client_ca_file: str = "") -> ssl.SSLContext:
    """The server side of HTTPS; OSError or ValueError when the files are not a usable
    certificate and key."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(cert_file, key_file)
    if client_ca_file:
        context.load_verify_locations(client_ca_file)
        context.verify_mode = ssl.CERT_REQUIRED
    return context


class RenewingTlsContext:
    """The TLS context of the TCP listener, rebuilt when its files change on disk, so that a
    renewed certificate (a cert-manager Secret update, say) is served without a restart."""

    def __init__(self, cert_file: str, key_file: str, client_ca_file: str = ""):
        self._files = (cert_file, key_file, client_ca_file)
        self._lock = threading.Lock()
        self._stamp = self._read_stamp()
        self._context = server_tls_context(*self._files)

    def _read_stamp(self) -> tuple[Stamp, ...]:
        """The files' content stamps; () while any is missing or no regular file (the reload
        runs in a handshake, on the event loop: a FIFO there must not hold it)."""
        stamps = [content_stamp(f) for f in self._files if f]
        return () if None in stamps else tuple(stamps)  # type: ignore[arg-type]

    def listening_context(self) -> ssl.SSLContext:
        """The context to listen with: each handshake switches to `context()` (from the SNI
        callback, which OpenSSL calls for every ClientHello, with or without a server name),
        so renewed files serve the next connection, no restart."""
        listening = server_tls_context(*self._files)

        def current(ssl_object: ssl.SSLObject, server_name: str | None,
                    _: ssl.SSLContext) -> None:
            ssl_object.context = self.context()

        listening.sni_callback = current  # type: ignore[assignment]
        return listening

    def context(self) -> ssl.SSLContext:
        with self._lock:
            stamp = self._read_stamp()
            if stamp and stamp != self._stamp:
                try:
                    fresh = server_tls_context(*self._files)
                except (OSError, ValueError) as err:  # half-written files: keep the old one
                    log.warning("admin API: the renewed TLS files cannot be loaded yet; the "
                                "previous certificate stays", extra={"reason": str(err)})
                else:
                    # Files that changed while they were read may have been read cut short (a
                    # chain whose leaf parses without its intermediates): the next handshake
                    # reads them again.
                    if self._read_stamp() == stamp:
                        self._context, self._stamp = fresh, stamp
            return self._context
