"""allocwatch ctl: talk to a running sidecar's admin API.

Here the command's options; `subcommands` runs them, with the admin API's `client`, the
`output` formats and `diagnose`, the out-of-memory checklist.
"""

from __future__ import annotations

import argparse

from allocator_ext.protocol.service import DEFAULT_HISTORY_ENTRIES, MAX_HISTORY_ENTRIES
from exporter.commands._arguments import HelpFormatter, count, seconds

HELP = "talk to a running sidecar: list agents, change allocator settings, reclaim, snapshot"
DESCRIPTION = """\
Talks to the admin API of a running sidecar (docs/sidecar.md, "Admin API"). Commands go to every
connected agent that matches all the selectors given (none: every agent of that sidecar), and
each agent answers with its result and the settings now in force.

  allocwatch ctl agents                                  who is connected, with live figures
  allocwatch ctl set garbage_collection_threshold:0.8 --rank 0
                                                         change only the keys named (validated
                                                         first: a bad key or value changes nothing)
  allocwatch ctl reclaim [--all]                         release cached blocks down to the GC
                                                         threshold (--all: every unused one)
  allocwatch ctl snapshot [--frames] -o snap.pickle.gz   a memory snapshot (PyTorch's layout)
  allocwatch ctl reset-peaks
  allocwatch ctl record-history start|stop [--max-entries N]
                                                         memory history on or off, in a running
                                                         job; a snapshot taken then replays
  allocwatch ctl diagnose --rank 0 [--replay] [--apply]  walk the out-of-memory checklist

Address: --admin unix:///run/allocwatch/admin.sock (the default; $ALLOCWATCH_ADMIN) or
--admin http://127.0.0.1:PORT --token-file FILE (or the token itself in
$ALLOCWATCH_ADMIN_TOKEN); with TLS,
--admin https://HOST:PORT --tls-ca-file CA.crt (and --tls-cert-file/--tls-key-file where the
sidecar asks for client certificates). In Kubernetes:
  kubectl exec POD -c allocwatch-sidecar -- allocwatch ctl agents

Exit status: 0 every selected agent answered OK, 1 some did not, 2 the request was refused
(bad value, bad token, no agent selected), 3 the sidecar cannot be reached."""

SUBCOMMANDS = {
    "agents": "list the agents (connected, and departed but not yet expired) and their figures",
    "set": "change allocator settings (PYTORCH_CUDA_ALLOC_CONF syntax; only the keys named)",
    "reclaim": "release cached memory (garbage collection down to the threshold, or --all)",
    "snapshot": "have the agent write a memory snapshot; fetch it with -o",
    "reset-peaks": "reset the peak statistics",
    "record-history": "switch the allocator's memory history on (start) or off (stop)",
    "diagnose": "walk the out-of-memory troubleshooting order for one agent",
}


def _common_options(parser: argparse.ArgumentParser, suppress: bool) -> None:
    # On `ctl` and on each subcommand, so options go before or after it; the subcommands'
    # copies default to SUPPRESS so that they never undo a value given before the subcommand.
    def default(value: object) -> object:
        return argparse.SUPPRESS if suppress else value

    where = parser.add_argument_group("sidecar and selection")
    where.add_argument("--admin", metavar="ADDRESS", default=default(None),
                       help="unix:///path/admin.sock, http://127.0.0.1:PORT or https://HOST:PORT "
                            "(default: $ALLOCWATCH_ADMIN, else unix:///run/allocwatch/admin.sock)")
    where.add_argument("--token-file", metavar="FILE", default=default(None),
                       help="file holding the bearer token, for http(s):// (default: the "
                            "token itself in $ALLOCWATCH_ADMIN_TOKEN)")
    where.add_argument("--tls-ca-file", metavar="FILE", default=default(None),
                       help="for https://: the CA that signed the sidecar's certificate "
                            "(default: $ALLOCWATCH_ADMIN_TLS_CA, else the system's CAs)")
    where.add_argument("--tls-cert-file", metavar="FILE", default=default(None),
                       help="for https://: a client certificate, where the sidecar asks for one "
                            "(default: $ALLOCWATCH_ADMIN_TLS_CERT)")
    where.add_argument("--tls-key-file", metavar="FILE", default=default(None),
                       help="its key (default: $ALLOCWATCH_ADMIN_TLS_KEY)")
    where.add_argument("--rank", type=int, default=default(None), help="only this rank")
    where.add_argument("--host", default=default(None), help="only agents on this host")
    where.add_argument("--job", default=default(None), help="only this training job")
    where.add_argument("--agent", metavar="KEY", default=default(None),
                       help="only this agent (its key, as `ctl agents` shows)")
    where.add_argument("--json", action="store_true", default=default(False),
                       help="print the API's JSON answer")
    where.add_argument("--timeout", type=seconds(), metavar="S", default=default(120.0),
                       help="seconds to wait for the sidecar (default 120)")


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("ctl", help=HELP, description=DESCRIPTION,
                                   formatter_class=HelpFormatter)
    _common_options(parser, suppress=False)
    commands = parser.add_subparsers(dest="ctl_command", metavar="COMMAND", required=True)
    sub = {}
    for name, text in SUBCOMMANDS.items():
        sub[name] = commands.add_parser(name, help=text, description=text,
                                        formatter_class=HelpFormatter)
        _common_options(sub[name], suppress=True)
    sub["set"].add_argument("settings", help="e.g. expandable_segments:True,"
                                             "garbage_collection_threshold:0.8")
    sub["reclaim"].add_argument("--all", action="store_true",
                                help="release every unused cached block (empty_cache), not only "
                                     "down to the garbage-collection threshold")
    sub["snapshot"].add_argument("--frames", action="store_true",
                                 help="include stack frames (they hold source paths)")
    sub["snapshot"].add_argument("-o", "--output", metavar="FILE",
                                 help="fetch the snapshot into FILE (a directory: one file per "
                                      "agent); open it with PyTorch's memory viewer")
    history = sub["record-history"]
    history.add_argument("state", choices=["start", "stop"],
                         help="start: record every allocation, free and segment change from now "
                              "on (what a snapshot's trace holds); stop: stop recording")
    history.add_argument("--max-entries", type=count(MAX_HISTORY_ENTRIES, minimum=1),
                         metavar="N", help=f"with start: keep the last N entries (default: the "
                                           f"agent's, {DEFAULT_HISTORY_ENTRIES:,}; at most "
                                           f"{MAX_HISTORY_ENTRIES:,})")
    diagnose = sub["diagnose"]
    diagnose.add_argument("--window", type=seconds(), default=5.0, metavar="S",
                          help="read the counters twice, S seconds apart, to see rates "
                               "(default 5; above 0)")
    diagnose.add_argument("--device", type=int, metavar="N",
                          help="which CUDA device of the agent (default: its first)")
    diagnose.add_argument("--replay", action="store_true",
                          help="take a snapshot and replay it under each candidate setting")
    diagnose.add_argument("--apply", action="store_true",
                          help="apply the recommended setting to that agent")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from exporter.commands.ctl.subcommands import main

    return main(args)
