"""The sidecar's admin API: JSON over HTTP, for `allocwatch ctl`.

- `config`: the `admin:` section of the sidecar's file, and the bearer token it names;
- `service`: what the endpoints do, independent of HTTP;
- `views`: the JSON shapes of agents, settings and command results;
- `http_server`: the Unix-socket and TCP listeners, authentication, routing;
- `tls`: HTTPS for the TCP listener, with certificates renewed on disk picked up;
- `collector`: its Prometheus families.
"""
