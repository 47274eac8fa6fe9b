"""One module (or package, for `ctl`) per `allocwatch` subcommand, each with
`register(subparsers)` and the command's code beside it (see exporter.cli).

Heavy imports belong inside the command's function, so that `allocwatch --help` stays fast.
"""
