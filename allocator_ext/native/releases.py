"""The PyTorch releases the native back end serves, each built against its own headers: what
install() accepts, how the back end is compiled for each, and the release of each line that CI
compiles against (`.ci/torch_releases.py` fetches their headers; docs/torch.md's version table
says how their allocator interfaces differ and what ran where).

A release outside this table keeps PyTorch's allocator: its interface is unknown until the back
end has been compiled against it and its differences handled in backend.cpp.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["RELEASES", "Release", "cxx_standard", "parse", "supported", "supported_range"]


@dataclass(frozen=True)
class Release:
    """One line of PyTorch releases (2.11.x): the patch release CI compiles against, and the
    CUDA version of its default wheel on PyPI."""

    version: str
    cuda: str

    @property
    def line(self) -> tuple[int, int]:
        return parse(self.version)


RELEASES = (
    Release("2.9.1", "12.8"),
    Release("2.10.0", "12.8"),
    Release("2.11.0", "13.0"),
    Release("2.12.1", "13.0"),
    Release("2.13.0", "13.0"),
    Release("2.14.1", "13.0"),
    Release("2.15.0", "13.2"),
)


def parse(version: str) -> tuple[int, int]:
    """(major, minor) of a torch version string ("2.11.0+cu130" -> (2, 11))."""
    parts = version.split("+")[0].split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        raise ValueError(f"not a torch version: {version!r}") from None


def supported(version: str) -> Release | None:
    """The table's release of `version`'s line, or None where the back end does not serve it."""
    line = parse(version)
    return next((r for r in RELEASES if r.line == line), None)


def supported_range() -> str:
    """The supported lines as a reader says them: "2.9 to 2.15"."""
    (low_major, low_minor), (high_major, high_minor) = RELEASES[0].line, RELEASES[-1].line
    return f"{low_major}.{low_minor} to {high_major}.{high_minor}"


def cxx_standard(version: str) -> str:
    """The C++ standard a release's headers need: 2.14's and later use C++20
    (std::strong_ordering in c10/util/intrusive_ptr.h); earlier ones are C++17."""
    return "c++20" if parse(version) >= (2, 14) else "c++17"
