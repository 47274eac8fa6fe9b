"""allocwatch run: a training command with allocwatch installed, no code change."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from exporter.commands._arguments import HelpFormatter

HELP = "run a training command with allocwatch's allocator and agent installed"
DESCRIPTION = """\
Runs COMMAND with allocwatch's allocator installed as PyTorch's CUDA allocator and the agent
publishing to a sidecar, without changing the training code. Every Python process it starts
(torchrun's workers too) installs both the moment it imports torch, before CUDA starts;
processes that never import torch, and torchrun's own launcher, are left alone.

  allocwatch run -- python train.py --epochs 3
  allocwatch run --target unix:///run/allocwatch/agent.sock -- torchrun --nproc-per-node 8 train.py
  allocwatch run --config native,expandable_segments:True -- python train.py
  allocwatch run --keep-pytorch-allocator -- python train.py     (agent only)

Settings: --config, else ALLOCWATCH_ALLOC_CONF, else PYTORCH_CUDA_ALLOC_CONF's keys, on top of
allocwatch's defaults. The exit status is COMMAND's."""


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("run", help=HELP, description=DESCRIPTION,
                              formatter_class=HelpFormatter)
    p.add_argument("--config", metavar="STR", help="allocator settings (PYTORCH_CUDA_ALLOC_CONF "
                   "syntax; 'native' for PyTorch's defaults)")
    p.add_argument("--target", metavar="ADDR", type=_target,
                   help="the sidecar's agent address (unix:///path or host:port); default: "
                        "ALLOCWATCH_TARGET, else no agent")
    p.add_argument("--keep-pytorch-allocator", action="store_true",
                   help="leave PyTorch's allocator in place; the agent reports its statistics")
    p.add_argument("command", nargs=argparse.REMAINDER, help="the command, after --")
    p.set_defaults(func=run)


def _target(text: str) -> str:
    from allocator_ext.protocol.service import check_target

    try:
        return check_target(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def command_environment(args: argparse.Namespace, environ: dict[str, str]) -> dict[str, str]:
    import allocator_ext

    env = dict(environ)
    autostart = str(Path(allocator_ext.__file__).resolve().parent / "_autostart")
    # The package itself must stay importable in the child, wherever it was installed from.
    package_root = str(Path(allocator_ext.__file__).resolve().parent.parent)
    inherited = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    paths = [autostart, package_root, *inherited]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env["ALLOCWATCH_RUN"] = "1"
    if args.config:
        env["ALLOCWATCH_ALLOC_CONF"] = args.config
    if args.target:
        env["ALLOCWATCH_TARGET"] = args.target
    if args.keep_pytorch_allocator:
        env["ALLOCWATCH_ALLOCATOR"] = "0"
    return env


def run(args: argparse.Namespace) -> int:
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        print("allocwatch run: no command given (usage: allocwatch run -- python train.py)",
              file=sys.stderr)
        return 2
    if args.config:
        import allocator_ext
        from allocator_ext.protocol.service import check_settings_text

        try:
            allocator_ext.parse_config(check_settings_text(args.config))
        except ValueError as e:
            print(f"allocwatch run: {e}", file=sys.stderr)
            return 2
    env = command_environment(args, dict(os.environ))
    try:
        os.execvpe(command[0], command, env)
    except OSError as e:
        print(f"allocwatch run: cannot run {command[0]}: {e.strerror}", file=sys.stderr)
        return 127
    return 0  # not reached
