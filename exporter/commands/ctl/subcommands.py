"""`allocwatch ctl`'s subcommands: each builds a request from its arguments, sends it to the
sidecar's admin API and prints the answer."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, TextIO

from exporter.commands.ctl.client import AdminClient, CtlError, client_for
from exporter.commands.ctl.diagnose import run_diagnosis
from exporter.commands.ctl.output import human_bytes, print_agents, print_results
from exporter.shared.settings import validate_settings


def selectors(args: argparse.Namespace) -> dict[str, Any]:
    found = {"rank": args.rank, "host": args.host, "job": args.job, "agent": args.agent}
    return {k: v for k, v in found.items() if v is not None}


def _emit(args: argparse.Namespace, answer: dict[str, Any], out: TextIO) -> int:
    if args.json:
        print(json.dumps(answer, indent=2), file=out)
    else:
        print_results(answer, out)
    return 0 if answer["ok"] else 1


def cmd_agents(args: argparse.Namespace, client: AdminClient, out: TextIO) -> int:
    answer = client.get("/v1/agents", **selectors(args))
    if args.json:
        print(json.dumps(answer, indent=2), file=out)
    else:
        print_agents(answer["agents"], out)
    return 0


def cmd_set(args: argparse.Namespace, client: AdminClient, out: TextIO) -> int:
    try:  # a typo is refused here, before any agent is asked (the sidecar checks it again)
        validate_settings(args.settings)
    except ValueError as err:
        raise CtlError(str(err)) from None
    return _emit(args, client.post("/v1/settings", {"settings": args.settings,
                                                    **selectors(args)}), out)


def cmd_reclaim(args: argparse.Namespace, client: AdminClient, out: TextIO) -> int:
    mode = "all" if args.all else "gc"
    return _emit(args, client.post("/v1/reclaim", {"mode": mode, **selectors(args)}), out)


def cmd_reset_peaks(args: argparse.Namespace, client: AdminClient, out: TextIO) -> int:
    return _emit(args, client.post("/v1/reset-peaks", selectors(args)), out)


def cmd_record_history(args: argparse.Namespace, client: AdminClient, out: TextIO) -> int:
    if args.state == "stop" and args.max_entries is not None:
        raise CtlError("--max-entries goes with start: stop keeps no entries")
    # 0 in the request: the agent's default.
    body = {"enabled": args.state == "start", "max_entries": args.max_entries or 0,
            **selectors(args)}
    return _emit(args, client.post("/v1/record-history", body), out)


def cmd_snapshot(args: argparse.Namespace, client: AdminClient, out: TextIO) -> int:
    target = Path(args.output) if args.output else None
    if target is not None and not target.is_dir() and not target.parent.is_dir():
        # Refused before any agent is asked: a snapshot nobody can fetch is work for nothing.
        raise CtlError(f"-o {args.output}: there is no directory {target.parent}")
    answer = client.post("/v1/snapshot", {"frames": args.frames, **selectors(args)})
    status = _emit(args, answer, out)
    if target is not None:
        taken = [r for r in answer["results"] if "snapshot" in r]
        if len(taken) > 1 and not target.is_dir():
            raise CtlError(f"-o {args.output}: {len(taken)} agents answered; give a directory "
                           "or select one agent (--rank/--host/--job/--agent)")
        for r in taken:
            data = client.request("GET", r["snapshot"]["download"])
            path = target / Path(r["snapshot"]["path"]).name if target.is_dir() else target
            try:
                path.write_bytes(data)
            except OSError as err:
                raise CtlError(f"-o {args.output}: cannot write {path}: "
                               f"{err.strerror or err}", 1) from None
            print(f"  wrote {path} ({human_bytes(len(data))})", file=sys.stderr)
    return status


def cmd_diagnose(args: argparse.Namespace, client: AdminClient, out: TextIO) -> int:
    return run_diagnosis(args, client, selectors(args), out)


COMMANDS = {
    "agents": cmd_agents,
    "set": cmd_set,
    "reclaim": cmd_reclaim,
    "snapshot": cmd_snapshot,
    "reset-peaks": cmd_reset_peaks,
    "record-history": cmd_record_history,
    "diagnose": cmd_diagnose,
}


def main(args: argparse.Namespace, out: TextIO | None = None) -> int:
    out = out or sys.stdout
    try:
        return COMMANDS[args.ctl_command](args, client_for(args), out)
    except CtlError as err:
        print(f"allocwatch ctl: {err}", file=sys.stderr)
        return err.status
