"""The package's version and the protocol's (allocwatch.v1): plain constants, so that reading
them costs no import (`allocwatch --version`, the HTTP server's banner)."""

PACKAGE_VERSION = "0.1.0"

PROTOCOL_MAJOR = 1
PROTOCOL_MINOR = 3
