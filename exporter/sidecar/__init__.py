"""The sidecar daemon: the composition root, which wires the subsystems (exporter.agents,
exporter.metrics, exporter.admin, exporter.policy) together.

- `app`: the daemon wired together (`Sidecar`, `SidecarThread`, `run_sidecar`);
- `config`: its YAML settings (`SidecarConfig`, composing each subsystem's section);
- `reload`: the settings file watched and applied without a restart;
- `collector`: the sidecar's own series (build, reloads).
"""
