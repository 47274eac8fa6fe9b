"""The sidecar daemon.

- `app`: the daemon wired together (`Sidecar`, `SidecarThread`, `run_sidecar`);
- `config`: its YAML settings (`SidecarConfig`, with the admin, policy and reload sections);
- `grpc_server`: the agents' gRPC endpoint;
- `registry`: the agents, their latest reports, and the commands sent to them;
- `http_server`: /metrics, /healthz, /readyz and the landing page;
- `collectors`: the Prometheus collectors of the allocator, GPU, agents and sidecar series;
- `reload`: the settings file watched and applied without a restart.
"""
