"""Loaded at interpreter start-up in processes launched by `allocwatch run` (this folder is put
first on PYTHONPATH): installs allocwatch's allocator and starts the agent before the training
script runs, so no code change is needed — torchrun's workers included, since they inherit the
environment. Nothing here may break the user's program: failures become one line on stderr."""

import os
import sys

_LAUNCHERS = {"torchrun", "torch.distributed.run", "torch.distributed.launch"}


def _is_launcher() -> bool:
    """torchrun's own process: it starts the workers and touches no GPU, so it gets no
    allocator and no agent (its workers do, as they inherit the environment)."""
    argv = getattr(sys, "orig_argv", sys.argv)
    if len(argv) > 1 and os.path.basename(argv[1]) in _LAUNCHERS:
        return True
    return any(a == "-m" and b in _LAUNCHERS for a, b in zip(argv, argv[1:], strict=False))


def _allocwatch_autostart() -> None:
    if os.environ.get("ALLOCWATCH_RUN") != "1" or _is_launcher():
        return
    try:
        from allocator_ext.torch_integration import install_at_startup

        install_at_startup()
    except Exception as e:  # noqa: BLE001 - the training process comes first
        print(f"allocwatch: not installed in pid {os.getpid()}: {e}", file=sys.stderr)


def _chain_to_the_next_sitecustomize() -> None:
    """A site's own sitecustomize further down sys.path still runs."""
    here = os.path.dirname(os.path.abspath(__file__))
    import importlib.util

    for entry in sys.path:
        if not entry or os.path.abspath(entry) == here:
            continue
        candidate = os.path.join(entry, "sitecustomize.py")
        if os.path.isfile(candidate):
            spec = importlib.util.spec_from_file_location("_site_sitecustomize", candidate)
            if spec and spec.loader:
                spec.loader.exec_module(importlib.util.module_from_spec(spec))
            return


_allocwatch_autostart()
_chain_to_the_next_sitecustomize()
