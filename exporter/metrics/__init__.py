"""/metrics: the Prometheus collectors of the allocator, GPU and agents series (`collectors`,
`bounds_collector`), and the HTTP server of /metrics, /healthz, /readyz and the landing page
(`http_server`, writing the exposition format of `exposition_format`)."""
