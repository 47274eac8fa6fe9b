"""deploy/image/: the sidecar image recipe is slim, non-root, pinned, torch-free, and its lock
satisfies pyproject.toml's dependencies."""

from __future__ import annotations

import re

import pytest
from support.deploy import DEPLOY, REPO

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip("tomli", reason="Python 3.10 needs tomli to read pyproject.toml")

IMAGE = DEPLOY / "image"
DOCKERFILE = (IMAGE / "Dockerfile").read_text()


def locked() -> dict[str, tuple[str, int]]:
    """name → (version, number of hashes) from requirements.txt."""
    pins: dict[str, tuple[str, int]] = {}
    current = None
    for line in (IMAGE / "requirements.txt").read_text().splitlines():
        if m := re.match(r"^([A-Za-z0-9_.\-]+)==([^\s\\]+)", line):
            current = m.group(1).lower().replace("_", "-")
            pins[current] = (m.group(2), 0)
        elif "--hash=sha256:" in line and current:
            version, hashes = pins[current]
            pins[current] = (version, hashes + 1)
        elif line.strip() and not line.lstrip().startswith("#"):
            assert line.startswith(" "), f"unpinned line in requirements.txt: {line!r}"
    return pins


def test_base_image_is_a_pinned_slim_python() -> None:
    bases = re.findall(r"^ARG PYTHON_IMAGE=(\S+)$", DOCKERFILE, flags=re.M)
    assert len(bases) == 1
    assert re.fullmatch(r"python:3\.\d+\.\d+-slim-\w+(@sha256:[0-9a-f]{64})?", bases[0])
    assert all(
        line.split()[1] in ("${PYTHON_IMAGE}",)
        for line in DOCKERFILE.splitlines()
        if line.startswith("FROM")
    )


def test_runs_as_a_numeric_non_root_user() -> None:
    users = re.findall(r"^USER (\S+)$", DOCKERFILE, flags=re.M)
    assert users and users[-1].split(":")[0].isdigit() and users[-1].split(":")[0] != "0"


def test_installs_only_from_the_hashed_lock() -> None:
    assert "pip install --require-hashes --no-deps -r /tmp/requirements.txt" in DOCKERFILE
    assert "pip install --no-deps /tmp/wheels/" in DOCKERFILE
    assert "torch" not in " ".join(locked())


def test_lock_pins_every_dependency_of_pyproject_with_hashes() -> None:
    packaging = pytest.importorskip("packaging.requirements", reason="packaging is not installed")
    pins = locked()
    for name, (_, hashes) in pins.items():
        assert hashes >= 1, f"{name} has no hash"
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    for spec in project["dependencies"]:
        requirement = packaging.Requirement(spec)
        name = requirement.name.lower().replace("_", "-")
        assert name in pins, f"{name} (pyproject.toml) is not in deploy/image/requirements.txt"
        assert requirement.specifier.contains(pins[name][0]), (
            f"{name}=={pins[name][0]} violates {spec}"
        )


def test_entrypoint_matches_the_manifests() -> None:
    assert 'ENTRYPOINT ["allocwatch"]' in DOCKERFILE
    assert "EXPOSE 9471" in DOCKERFILE
    ignore = [
        line
        for line in (IMAGE / "Dockerfile.dockerignore").read_text().splitlines()
        if line and not line.startswith("#")
    ]
    assert ignore[0] == "*"  # an allow-list: nothing reaches the build unless named
    for needed in (
        "!pyproject.toml",
        "!exporter",
        "!allocator_ext",
        "!deploy/image/requirements.txt",
    ):
        assert needed in ignore
