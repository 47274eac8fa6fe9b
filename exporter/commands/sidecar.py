"""allocwatch sidecar: the exporter daemon."""

from __future__ import annotations

import argparse
import logging
import sys

from exporter.commands._arguments import HelpFormatter, seconds

HELP = "run the sidecar: agents' gRPC endpoint, Prometheus /metrics, NVML reader"
DESCRIPTION = """\
Runs the exporter daemon beside a training container. Agents in the training processes connect
over gRPC (a Unix socket in a shared directory by default, TCP where configured) and publish
their allocator's figures; Prometheus scrapes them from /metrics (with /healthz, /readyz and a
landing page listing the agents). Settings: a YAML file, described in docs/sidecar.md; without
one, the defaults (socket /run/allocwatch/agent.sock, metrics on port 9471)."""


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("sidecar", help=HELP, description=DESCRIPTION,
                                   formatter_class=HelpFormatter)
    parser.add_argument("--config", metavar="FILE", help="YAML settings file")
    parser.add_argument("--check-config", action="store_true",
                        help="validate the settings file, print every setting in force (as "
                             "YAML the file could hold) and exit")
    parser.add_argument(
        "--exit-after-training", action="store_true",
        help="exit 0 once training is over: the file 'training-done' appears beside the agents' "
             "socket, or every agent that connected has been gone for --exit-grace seconds "
             "(for Kubernetes before 1.29, where the sidecar is a regular container)")
    parser.add_argument("--exit-grace", type=seconds(zero_allowed=True), default=60.0,
                        metavar="S",
                        help="with --exit-after-training: seconds all agents must be gone "
                             "(default 60)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from exporter.agents.grpc_server import ListenError
    from exporter.shared.config import ConfigError
    from exporter.shared.logs import configure_logging
    from exporter.sidecar.config import load_config

    try:
        config = load_config(args.config)
    except ConfigError as err:
        print(f"allocwatch sidecar: invalid settings: {err}", file=sys.stderr)
        return 2
    if args.check_config:
        from exporter.commands._settings_text import settings_text

        print("settings OK; in force, every default filled in:")
        print(settings_text(config))
        return 0
    configure_logging(config.logging.level, config.logging.format)
    from exporter.sidecar.app import run_sidecar

    try:
        run_sidecar(config, args.exit_after_training, args.exit_grace, config_path=args.config)
    except (ListenError, OSError) as err:
        logging.getLogger("exporter.sidecar").error("cannot start the sidecar",
                                                    extra={"reason": str(err)})
        print(f"allocwatch sidecar: {err}", file=sys.stderr)
        return 1
    return 0
