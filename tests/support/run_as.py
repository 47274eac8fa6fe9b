"""python run_as.py UID GID MODULE ARG...: MODULE's main() run under UID:GID, with no
supplementary group, for a machine where that user cannot reach this interpreter's files (its
Python lives under a home directory only root may enter). Everything the sidecar and `ctl`
import (with `ctl diagnose --replay`'s replay), ours and the standard library's lazy imports,
is imported first, as the caller; then the process drops to the user for good, before it opens
a single file or socket of the test. Where the user can run the interpreter itself,
support.pod uses setpriv instead."""

from __future__ import annotations

import importlib
import os
import pkgutil
import sys

# The standard library's imports that happen on first use, inside functions.
LAZY_STDLIB = ("encodings.idna", "concurrent.futures.thread", "concurrent.futures.process",
               "http.client", "http.server", "gzip", "json", "pickle", "shlex", "ssl")


def preload() -> None:
    import exporter

    for module in pkgutil.walk_packages(exporter.__path__, "exporter."):
        importlib.import_module(module.name)
    # What `ctl diagnose --replay` imports: the replay of a downloaded snapshot.
    import allocator_ext.replay

    for module in pkgutil.walk_packages(allocator_ext.replay.__path__, "allocator_ext.replay."):
        importlib.import_module(module.name)
    for name in LAZY_STDLIB:
        importlib.import_module(name)


def drop_to(uid: int, gid: int) -> None:
    os.setgroups([])
    os.setresgid(gid, gid, gid)
    os.setresuid(uid, uid, uid)
    assert os.getresuid() == (uid, uid, uid) and os.getgroups() in ([], [gid])


def main() -> None:
    uid, gid, module, *args = sys.argv[1:]
    preload()
    drop_to(int(uid), int(gid))
    sys.argv = [module, *args]
    raise SystemExit(importlib.import_module(module).main())


if __name__ == "__main__":
    main()
