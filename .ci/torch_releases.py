"""Fetches, once, what CI needs of each PyTorch release the native back end serves
(allocator_ext/native/releases.py) to build it against that release's own headers and libraries
without installing it: torch's include/ folder, version.py and libc10*.so from the release's
CUDA wheel on PyPI, and the CUDA runtime headers and library of the matching NVIDIA wheel.

    python3 .ci/torch_releases.py [--into DIR] [VERSION ...]

Each release lands in DIR/<version>/ laid out as site-packages would hold it (torch/...,
nvidia/...), so that libc10_cuda.so finds its CUDA runtime through its own rpath. A release
already there is kept: CI keeps DIR between runs ($ALLOCWATCH_TORCH_RELEASES, else
~/.cache/allocwatch/torch-releases). Nothing is installed: each wheel is downloaded with
--no-deps into a temporary folder, the members above are read out of it, and it is deleted.
"""

from __future__ import annotations

import argparse
import os
import runpy
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

from allocator_ext.native.releases import RELEASES

# The CUDA runtime wheel each CUDA version of torch's wheels depends on (its headers and
# libcudart; CUDA 13's wheel is named without the -cuXX suffix).
RUNTIME_WHEELS = {
    "12.8": "nvidia-cuda-runtime-cu12===12.8.90",
    "13.0": "nvidia-cuda-runtime===13.0.96",
    "13.2": "nvidia-cuda-runtime===13.2.86",
}
COMPLETE = ".complete"


def default_dir() -> Path:
    configured = os.environ.get("ALLOCWATCH_TORCH_RELEASES")
    if configured:
        return Path(configured)
    return Path.home() / ".cache" / "allocwatch" / "torch-releases"


def download(requirement: str, into: Path) -> Path:
    """The one wheel of `requirement` (`===`: never a local build such as 2.13.0+cpu that a
    machine's own wheel folder may offer)."""
    into.mkdir(parents=True, exist_ok=True)
    # A machine's pip constraints (a cap on the torch it may install) would refuse a release
    # above them; an exact version downloaded and never installed is not theirs to choose.
    env = {**os.environ, "PIP_CONSTRAINT": os.devnull}
    done = subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
                           "--only-binary=:all:", "--dest", str(into), requirement],
                          capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise SystemExit(f"pip download {requirement} failed:\n{done.stderr[-2000:]}")
    wheels = sorted(into.glob("*.whl"))
    if len(wheels) != 1:
        raise SystemExit(f"pip download {requirement} left {[w.name for w in wheels]}")
    return wheels[0]


def extract(wheel: Path, into: Path, wanted) -> int:
    """Extracts the members of `wheel` for which wanted(name) is true; returns their count."""
    count = 0
    with zipfile.ZipFile(wheel) as z:
        for info in z.infolist():
            if wanted(info.filename):
                z.extract(info, into)
                count += 1
    return count


def torch_member(name: str) -> bool:
    return (name.startswith("torch/include/") or name == "torch/version.py"
            or name in ("torch/lib/libc10.so", "torch/lib/libc10_cuda.so"))


def fetch(version: str, cuda: str, root: Path) -> str:
    target = root / version
    if (target / COMPLETE).is_file():
        return "kept"
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root, prefix=f".{version}-") as scratch:
        work = Path(scratch)
        tree = work / "tree"
        wheel = download(f"torch==={version}", work / "torch-wheel")
        members = extract(wheel, tree, torch_member)
        wheel.unlink()
        found = runpy.run_path(str(tree / "torch" / "version.py"))
        if found.get("cuda") != cuda:
            raise SystemExit(f"{wheel.name}: CUDA {found.get('cuda')}, where the release table "
                             f"says {cuda} (allocator_ext/native/releases.py)")
        runtime = download(RUNTIME_WHEELS[cuda], work / "runtime-wheel")
        members += extract(runtime, tree, lambda n: n.startswith("nvidia/")
                           and ("/include/" in n or "/lib/" in n))
        runtime.unlink()
        (tree / COMPLETE).write_text(f"torch {found['__version__']} ({wheel.name}) and "
                                     f"{runtime.name}: {members} files\n")
        shutil.rmtree(target, ignore_errors=True)  # a partial one from an interrupted run
        tree.rename(target)
    return f"fetched {members} files"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--into", type=Path, default=default_dir(),
                        help="where the releases are kept (default: %(default)s)")
    parser.add_argument("versions", nargs="*", help="releases to fetch (default: every "
                        "release of allocator_ext/native/releases.py)")
    args = parser.parse_args()
    table = {r.version: r.cuda for r in RELEASES}
    for version in args.versions:
        if version not in table:
            parser.error(f"{version} is not in allocator_ext/native/releases.py "
                         f"({', '.join(table)})")
    for version in args.versions or list(table):
        started = time.monotonic()
        outcome = fetch(version, table[version], args.into)
        print(f"torch {version}: {outcome} in {time.monotonic() - started:.1f} s "
              f"({args.into / version})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
