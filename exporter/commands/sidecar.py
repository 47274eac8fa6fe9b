"""allocwatch sidecar: the exporter daemon."""

from __future__ import annotations

import argparse
import logging
import sys

from exporter.commands._arguments import HelpFormatter, seconds, tcp_port

HELP = "run the sidecar: agents' gRPC endpoint, Prometheus /metrics, NVML reader"
DESCRIPTION = """\
Runs the exporter daemon beside a training container. Agents in the training processes connect
over gRPC (a Unix socket in a shared directory by default, TCP where configured) and publish
their allocator's figures; Prometheus scrapes them from /metrics (with /healthz, /readyz and a
landing page listing the agents). Settings: a YAML file, described in docs/sidecar.md; without
one, the defaults (socket /run/allocwatch/agent.sock, metrics on port 9471). The flags below
that other exporters take (--web.*, --log.*) set their settings over the file's, at start and
at every reload of it."""


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
    parser.add_argument("--web.listen-address", dest="listen_address", type=listen_address,
                        metavar="[HOST]:PORT",
                        help="where /metrics, /healthz and /readyz listen (metrics.address and "
                             "metrics.port; default 0.0.0.0:9471; :PORT: every interface)")
    parser.add_argument("--web.telemetry-path", dest="telemetry_path", type=_telemetry_path,
                        metavar="PATH", help="the metrics' path (metrics.path; default /metrics)")
    parser.add_argument("--log.format", dest="log_format", choices=_log_formats(),
                        help="logfmt (key=value pairs) or json, one record a line on stderr, "
                             "or auto: logfmt on a terminal, json elsewhere (logging.format; "
                             "default auto)")
    parser.add_argument("--log.level", dest="log_level",
                        choices=("debug", "info", "warning", "error"),
                        help="the least severe level logged (logging.level; default info)")
    parser.set_defaults(func=run)


def listen_address(text: str) -> tuple[str, int]:
    """[HOST]:PORT, as exporters' --web.listen-address takes it: [::1]:9471, 127.0.0.1:9471,
    :9471 (every interface)."""
    host, colon, port = text.rpartition(":")
    if not colon:
        raise argparse.ArgumentTypeError(f"{text!r}: expected [HOST]:PORT (:9471, "
                                         "127.0.0.1:9471, [::]:9471)")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if any(c.isspace() or c in "[]/" for c in host):
        raise argparse.ArgumentTypeError(f"{text!r}: {host!r} is not a host")
    return host or "0.0.0.0", tcp_port(port)


def _telemetry_path(text: str) -> str:
    from exporter.shared.config import ConfigError
    from exporter.sidecar.config import telemetry_path

    try:
        return telemetry_path(text, "--web.telemetry-path")
    except ConfigError as err:
        raise argparse.ArgumentTypeError(str(err).split(": ", 1)[1]) from None


def _log_formats() -> tuple[str, ...]:
    from exporter.shared.logs import LOG_FORMATS

    return LOG_FORMATS


def run(args: argparse.Namespace) -> int:
    from exporter.agents.grpc_server import ListenError
    from exporter.shared.config import ConfigError
    from exporter.shared.logs import configure_logging
    from exporter.sidecar.config import Flags, load_config

    try:
        config = load_config(args.config)
    except ConfigError as err:
        print(f"allocwatch sidecar: invalid settings: {err}", file=sys.stderr)
        return 2
    flags = Flags(args.listen_address, args.telemetry_path, args.log_format, args.log_level)
    in_force = flags.apply(config)
    if args.check_config:
        from exporter.commands._settings_text import settings_text

        print("settings OK; in force, every default filled in:")
        print(settings_text(in_force))
        return 0
    configure_logging(in_force.logging.level, in_force.logging.format)
    from exporter.sidecar.app import run_sidecar

    try:
        run_sidecar(config, args.exit_after_training, args.exit_grace, config_path=args.config,
                    flags=flags)
    except (ListenError, OSError) as err:
        logging.getLogger("exporter.sidecar").error("cannot start the sidecar",
                                                    extra={"reason": str(err)})
        print(f"allocwatch sidecar: {err}", file=sys.stderr)
        return 1
    return 0
