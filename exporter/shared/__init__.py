"""What the sidecar's subsystems share, below them all:

- `config`: the settings file's vocabulary (`Section`, `setting`, `ConfigError`, reading files
  and tokens);
- `registry`: the agents, their latest reports, and the commands sent to them; `series`: the
  labels and slots of their series;
- `bounded_http`: the HTTP server base with bounded connections, deadlines and sizes;
- `tokens`: a bearer token read from a file or the environment, rotated on change;
- `figures`: figures derived from a report (the fragmentation ratios);
- `settings`: the check of an allocator settings string;
- `logs`: the logging set-up.
"""
