"""The policy engine: rules over each agent's figures that decide reclaims and settings changes.

- `config`: the `policy:` section of the sidecar's file (rules, initial settings);
- `engine`: the decisions (a state machine per rule, agent and device; no I/O);
- `runner`: the engine on the sidecar's event loop, sending what it decided;
- `collector`: its Prometheus families.
"""
