"""allocwatch's sidecar and command line, in layers, each importing only those below it:

- `shared`: what the sidecar's parts share (the settings file's vocabulary, the agents'
  registry, the bounded HTTP server, the token, figures derived from a report);
- `agents`, `metrics`, `admin`, `policy`: the subsystems, side by side (the agents' gRPC
  endpoint; /metrics and its collectors; the admin API; the policy engine);
- `sidecar`: the daemon wired together from them (its settings, reload, run);
- `commands` and `cli`: the `allocwatch` command line.

Below them all sits allocator_ext.protocol, which the in-process agent shares. Kept free of
imports, so that importing any part loads only what that part needs.
"""
