"""Fetches, once, what CI needs of each PyTorch release the native back end serves
(allocator_ext/native/releases.py) to build it against that release's own headers and libraries
without installing it: torch's include/ folder, version.py and libc10*.so from the release's
CUDA wheel on PyPI, and the CUDA runtime headers and library of the matching NVIDIA wheel.

    python3 .ci/torch_releases.py [--into DIR] [VERSION ...]

Each release lands in DIR/<version>/ laid out as site-packages would hold it (torch/...,
nvidia/...), so that libc10_cuda.so finds its CUDA runtime through its own rpath. A release
already there is kept: CI keeps DIR between runs ($ALLOCWATCH_TORCH_RELEASES, else
~/.cache/allocwatch/torch-releases). Nothing is installed: only the members above are read
out of each wheel on the index, by HTTP range requests (about 10 MB of a 500-900 MB torch
wheel), each checked against the wheel's RECORD; where the index cannot serve ranges, the whole
wheel is downloaded with pip (--no-deps) into a temporary folder and deleted once read.
"""

from __future__ import annotations

import argparse
import base64
import bisect
import csv
import hashlib
import io
import json
import os
import runpy
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import zipfile
from pathlib import Path

from packaging.tags import sys_tags
from packaging.utils import canonicalize_name, parse_wheel_filename

from allocator_ext.native.releases import RELEASES

# The CUDA runtime wheel each CUDA version of torch's wheels depends on (its headers and
# libcudart; CUDA 13's wheel is named without the -cuXX suffix).
RUNTIME_WHEELS = {
    "12.8": "nvidia-cuda-runtime-cu12===12.8.90",
    "13.0": "nvidia-cuda-runtime===13.0.96",
    "13.2": "nvidia-cuda-runtime===13.2.86",
}
COMPLETE = ".complete"
INDEX = os.environ.get("PIP_INDEX_URL", "https://pypi.org/simple").rstrip("/")


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


def extract(wheel: Path | zipfile.ZipFile, into: Path, wanted) -> int:
    """Extracts the members of `wheel` for which wanted(name) is true; returns their count."""
    count = 0
    with wheel if isinstance(wheel, zipfile.ZipFile) else zipfile.ZipFile(wheel) as z:
        for info in z.infolist():
            if wanted(info.filename):
                z.extract(info, into)
                count += 1
    return count


class NoRanges(Exception):
    """The index cannot serve the wheel's members alone: download it whole."""


def wheel_on_index(requirement: str) -> tuple[str, str]:
    """(file name, URL) of the wheel pip would pick for `requirement` (NAME===VERSION) here,
    from the index's JSON page (PEP 691): this interpreter's best tag, then the highest build."""
    project, version = requirement.split("===")
    request = urllib.request.Request(f"{INDEX}/{canonicalize_name(project)}/",
                                     headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as answer:
            page = json.load(answer)
    except (OSError, ValueError) as e:
        raise NoRanges(f"{INDEX} has no JSON page for {project}: {e}") from None
    preference = {tag: rank for rank, tag in enumerate(sys_tags())}
    found = []
    for entry in page.get("files", []):
        name = entry["filename"]
        if not name.endswith(".whl") or entry.get("yanked"):
            continue
        _, wheel_version, build, tags = parse_wheel_filename(name)
        ranks = [preference[t] for t in tags if t in preference]
        if str(wheel_version) == version and ranks:
            found.append((min(ranks), build, name, entry["url"]))
    if not found:
        raise NoRanges(f"no wheel of {requirement} for this interpreter on {INDEX}")
    best = min(rank for rank, *_ in found)
    _, _, name, url = max(f for f in found if f[0] == best)  # the highest build tag
    return name, url


class RangedFile(io.RawIOBase):
    """A remote file read by HTTP range requests, for zipfile: the spans asked for beforehand
    (prefetch) and anything read outside them, a block at a time, are kept in memory."""

    BLOCK = 1 << 20

    def __init__(self, url: str) -> None:
        self.url = url
        self.pos = 0
        self.spans: list[tuple[int, bytes]] = []  # (start, data), sorted by start
        tail = self._get(f"bytes=-{4 * self.BLOCK}")  # the central directory, usually whole
        self.size = self._total
        self._keep(self.size - len(tail), tail)

    def _get(self, byte_range: str) -> bytes:
        request = urllib.request.Request(self.url, headers={"Range": byte_range})
        try:
            with urllib.request.urlopen(request, timeout=120) as answer:
                if answer.status != 206:
                    raise NoRanges(f"{self.url} answers a range request with {answer.status}")
                self._total = int(answer.headers["Content-Range"].rsplit("/", 1)[1])
                return answer.read()
        except (urllib.error.URLError, OSError, ValueError) as e:
            raise NoRanges(f"{self.url}: {e}") from None

    def _keep(self, start: int, data: bytes) -> None:
        bisect.insort(self.spans, (start, data), key=lambda span: span[0])

    def _cached(self, start: int, size: int) -> bytes | None:
        i = bisect.bisect_right(self.spans, start, key=lambda span: span[0]) - 1
        if i >= 0:
            begin, data = self.spans[i]
            if start + size <= begin + len(data):
                return data[start - begin:start - begin + size]
        return None

    def prefetch(self, start: int, end: int) -> None:
        self._keep(start, self._get(f"bytes={start}-{end - 1}"))

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        self.pos = offset + (0, self.pos, self.size)[whence]
        return self.pos

    def readinto(self, buffer) -> int:
        size = min(len(buffer), self.size - self.pos)
        data = self._cached(self.pos, size)
        if data is None:  # a block from here on: the last span starting here, found next
            self.prefetch(self.pos, min(self.size, self.pos + max(size, self.BLOCK)))
            data = self._cached(self.pos, size)
            assert data is not None
        buffer[:size] = data
        self.pos += size
        return size


def ranged_wheel(requirement: str, wanted) -> tuple[str, zipfile.ZipFile]:
    """The wheel of `requirement` on the index as a zip file whose wanted members (and its
    RECORD) are fetched, each stretch of neighbouring members in one request."""
    name, url = wheel_on_index(requirement)
    remote = RangedFile(url)
    wheel = zipfile.ZipFile(io.BufferedReader(remote, buffer_size=1 << 16))
    members = sorted((info.header_offset, info) for info in wheel.infolist()
                     if wanted(info.filename) or info.filename.endswith(".dist-info/RECORD"))
    stretches: list[list[int]] = []
    for offset, info in members:
        # The local header (30 bytes, the name and an extra field of at most 64 KiB), then the
        # compressed data; a gap under 1 MiB is fetched rather than asked for apart.
        end = offset + 30 + len(info.orig_filename.encode()) + (1 << 16) + info.compress_size
        if stretches and offset <= stretches[-1][1] + RangedFile.BLOCK:
            stretches[-1][1] = max(stretches[-1][1], end)
        else:
            stretches.append([offset, end])
    for start, end in stretches:
        remote.prefetch(start, min(end, remote.size))
    return name, wheel


def checked_members(wheel: zipfile.ZipFile, wanted):
    """wanted(name) for each member whose content matches its hash in the wheel's RECORD
    (a member that does not match stops the fetch; zipfile also checks each CRC)."""
    record_name = next(n for n in wheel.namelist() if n.endswith(".dist-info/RECORD"))
    hashes = {row[0]: row[1] for row in csv.reader(io.StringIO(
        wheel.read(record_name).decode())) if len(row) >= 2 and row[1]}

    def check(name: str) -> bool:
        if not wanted(name) or name.endswith("/"):  # a folder has no hash
            return wanted(name)
        algorithm, _, expected = hashes.get(name, "sha256=").partition("=")
        actual = base64.urlsafe_b64encode(hashlib.new(algorithm, wheel.read(name)).digest())
        if actual.rstrip(b"=").decode() != expected:
            raise SystemExit(f"{name}: its content does not match the wheel's RECORD")
        return True

    return check


def fetch_members(requirement: str, wanted, into: Path, scratch: Path) -> tuple[str, int]:
    """Extracts the members of `requirement`'s wheel for which wanted(name) is true into
    `into`: by range requests, else from the whole wheel downloaded into `scratch`. Returns
    the wheel's name and the count."""
    try:
        name, wheel = ranged_wheel(requirement, wanted)
        return name, extract(wheel, into, checked_members(wheel, wanted))
    except NoRanges as why:
        print(f"{requirement}: {why}; downloading the whole wheel", flush=True)
    downloaded = download(requirement, scratch)
    count = extract(downloaded, into, wanted)
    downloaded.unlink()
    return downloaded.name, count


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
        wheel, members = fetch_members(f"torch==={version}", torch_member, tree,
                                       work / "torch-wheel")
        found = runpy.run_path(str(tree / "torch" / "version.py"))
        if found.get("cuda") != cuda:
            raise SystemExit(f"{wheel}: CUDA {found.get('cuda')}, where the release table "
                             f"says {cuda} (allocator_ext/native/releases.py)")
        runtime, more = fetch_members(RUNTIME_WHEELS[cuda], lambda n: n.startswith("nvidia/")
                                      and ("/include/" in n or "/lib/" in n), tree,
                                      work / "runtime-wheel")
        members += more
        (tree / COMPLETE).write_text(f"torch {found['__version__']} ({wheel}) and "
                                     f"{runtime}: {members} files\n")
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
