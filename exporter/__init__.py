"""allocwatch's sidecar and command line: `protocol` (what the agent shares with the sidecar),
`sidecar`, `policy`, `admin` and `commands`.

Kept free of imports so that the in-process agent can use ``exporter.protocol`` without pulling
in the sidecar's dependencies.
"""
