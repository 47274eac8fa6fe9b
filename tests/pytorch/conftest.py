"""The native back end built against every release allocator_ext/native/releases.py lists, once
per test session and in parallel (a build takes tens of seconds), for the tests that compile,
load and drive it (test_native_build.py, test_native_sim.py)."""

from __future__ import annotations

import os
import shutil
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest
from support import torch_releases

from allocator_ext.native import build


class ReleaseBuilds:
    """Each release's back end, built exactly as install() builds it (build.plan, linked against
    the release's own libc10), the first time any of them is asked for."""

    def __init__(self, root: Path) -> None:
        self.root = root
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
            if not self._futures:
                for v in torch_releases.VERSIONS:
                    try:
                        p = self.plan(v)
                    except (pytest.skip.Exception, pytest.fail.Exception):
                        continue  # that release's own test says so
                    self._futures[v] = self._pool.submit(build.ensure_built, p, self.root)
        return self._futures[version].result()

    def close(self) -> None:
        self._pool.shutdown(wait=True)


@pytest.fixture(scope="session")
def release_builds(tmp_path_factory: pytest.TempPathFactory):
    builds = ReleaseBuilds(tmp_path_factory.mktemp("release_builds"))
    yield builds
    builds.close()
