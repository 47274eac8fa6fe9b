"""One module per `allocwatch` subcommand, each with `register(subparsers)` (see exporter.cli).

Heavy imports belong inside the command's function, so that `allocwatch --help` stays fast.
"""
