"""The native back end built against the releases allocator_ext/native/releases.py lists, once
per test session and in parallel (a build takes tens of seconds), for the tests that compile,
load and drive it (test_native_build.py, test_native_sim.py): the releases those tests of the
session ask for, all of them at the first test's request (under pytest-xdist, once for all the
workers). Where ALLOCWATCH_TEST_BUILDS names a folder, each is kept there between runs
(support.kept_builds)."""

from __future__ import annotations

import ctypes
import os
import shutil
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest
from support import kept_builds, torch_releases

from allocator_ext.native import build

# A back end is built against the C++ runtime of the process that builds it
# (build.process_libstdcxx): in a training process, the one torch loaded. It is loaded here as
# torch loads it, at collection, so that every build of the session links the same way whichever
# tests ran before (a session of these files alone never imports torch).
ctypes.CDLL("libstdc++.so.6")


class ReleaseBuilds:
    """Each release's back end, built exactly as install() builds it (build.plan, linked against
    the release's own libc10)."""

    def __init__(self, root: Path, wanted: list[str], kept: bool = False) -> None:
        self.root = root
        self.kept = kept
        self.wanted = wanted
        self._lock = threading.Lock()
        self._futures: dict[str, Future[Path]] = {}
        self._pool = ThreadPoolExecutor(max_workers=max(1, os.cpu_count() or 1))

    def plan(self, version: str) -> build.Plan:
        release = torch_releases.folder(version)
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("ALLOCWATCH_CUDA_INCLUDE", str(torch_releases.cuda_include(release)))
            return build.plan(torch_releases.torch_module(release))

    def library(self, version: str) -> Path:
        if shutil.which(os.environ.get("CXX", "g++")) is None:
            pytest.skip("no C++ compiler")
        self.plan(version)  # skips (or fails) here where the release is not fetched
        with self._lock:
            for v in [version, *self.wanted]:
                if v in self._futures:
                    continue
                try:
                    p = self.plan(v)
                except (pytest.skip.Exception, pytest.fail.Exception):
                    continue  # that release's own test says so
                self._futures[v] = self._pool.submit(self._built, p)
        return self._futures[version].result()

    def _built(self, p: build.Plan) -> Path:
        # Kept: in a folder of its own, named by its command and toolchain (its sources are in
        # its key), and never with a failure remembered for the next run.
        if self.kept:
            return kept_builds.ensure_built(p, self.root)
        return build.ensure_built(p, self.root)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


@pytest.fixture(scope="session")
def release_builds(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    wanted = []
    for item in request.session.items:
        if "release_builds" in getattr(item, "fixturenames", ()):
            callspec = getattr(item, "callspec", None)
            version = callspec.params.get("version") if callspec else None
            version = version or torch_releases.GPU_RELEASE
            if version not in wanted:
                wanted.append(version)
    # One folder for the whole run: under pytest-xdist every worker's session asks for the
    # builds, and build.ensure_built's lock lets one process compile each while others wait.
    kept = kept_builds.kept_root()
    if kept is not None:
        root = kept / "release_builds"
        root.mkdir(parents=True, exist_ok=True)
        kept_builds.prune(root)
    else:
        base = tmp_path_factory.getbasetemp()
        root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "release_builds"
        root.mkdir(exist_ok=True)
    builds = ReleaseBuilds(root, wanted, kept=kept is not None)
    yield builds
    builds.close()
