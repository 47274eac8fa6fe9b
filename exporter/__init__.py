"""allocwatch's sidecar: gRPC server for agents, Prometheus exporter, NVML reader, command line.

Kept free of imports so that the in-process agent can use ``exporter.proto`` and
``exporter.protocol`` without pulling in the sidecar's dependencies.
"""

__version__ = "0.1.0"
