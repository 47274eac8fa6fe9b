"""The PyTorch releases the native back end serves, as CI fetches them (.ci/torch_releases.py):
each one's CUDA wheel's include/, version.py and libc10*.so, and its CUDA runtime wheel, under
$ALLOCWATCH_TORCH_RELEASES/<version>/ (default ~/.cache/allocwatch/torch-releases) laid out as
site-packages. Tests build the back end against them without installing any.

Where a release is missing the tests that need it skip, saying how to fetch it; with
ALLOCWATCH_REQUIRE_TORCH_RELEASES=1 (which .ci/run sets) they fail instead, so CI never passes
by skipping them."""

from __future__ import annotations

import os
import runpy
import types
from pathlib import Path

import pytest

from allocator_ext.native.releases import RELEASES

VERSIONS = [r.version for r in RELEASES]
# The release measured on the GPU machine: the simulated-device tests use its libraries.
GPU_RELEASE = "2.11.0"
# The first test that asks for the back ends waits for every build (tests/pytorch/conftest.py),
# some minutes on a loaded machine: its time limit.
BUILD_TIMEOUT_S = 1200


def releases_dir() -> Path:
    configured = os.environ.get("ALLOCWATCH_TORCH_RELEASES")
    if configured:
        return Path(configured)
    return Path.home() / ".cache" / "allocwatch" / "torch-releases"


def folder(version: str) -> Path:
    """DIR/<version>, the release's fetched files; skips (or fails, in CI) where absent."""
    found = releases_dir() / version
    if not (found / ".complete").is_file():
        why = (f"torch {version}'s headers and libraries are not in {releases_dir()}: "
               f"python3 .ci/torch_releases.py {version}")
        if os.environ.get("ALLOCWATCH_REQUIRE_TORCH_RELEASES") == "1":
            pytest.fail(why)
        pytest.skip(why)
    return found


def torch_module(root: Path) -> types.SimpleNamespace:
    """What build.plan() reads of a torch module, for a CUDA build of torch unpacked at
    `root/torch` (a release folder, or an unpacked wheel)."""
    torch_dir = root / "torch"
    version = runpy.run_path(str(torch_dir / "version.py"))
    return types.SimpleNamespace(
        __file__=str(torch_dir / "__init__.py"), __version__=version["__version__"],
        version=types.SimpleNamespace(cuda=version["cuda"], git_version=version["git_version"]),
        _C=types.SimpleNamespace(_GLIBCXX_USE_CXX11_ABI=True))


def cuda_include(root: Path) -> Path:
    """The CUDA runtime headers fetched beside the release (nvidia/<cu13|cuda_runtime>/include)."""
    found = sorted(p for p in (root / "nvidia").glob("*/include")
                   if (p / "cuda_runtime_api.h").is_file())
    assert len(found) == 1, f"{root}: expected one CUDA runtime include folder, found {found}"
    return found[0]
