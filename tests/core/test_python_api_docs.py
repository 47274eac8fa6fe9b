"""The Python API documents itself: help(allocator_ext) shows what each public name does, not
only the signature pybind11 generates, and no parameter is left as `arg0`."""

from __future__ import annotations

import inspect
import pydoc

import pytest

import allocator_ext as ae

# pybind11 writes the signature as the docstring's first line; a documented method has more.
BINDING_CLASSES = [ae.Allocator, ae.SimDevice]


def _binding_members() -> list[tuple[str, object]]:
    members = []
    for cls in BINDING_CLASSES:
        for name, member in vars(cls).items():
            if not name.startswith("_"):
                members.append((f"{cls.__name__}.{name}", member))
    return members


def _text(member: object) -> str:
    doc = inspect.getdoc(member) or ""
    if isinstance(member, property):
        return doc
    lines = doc.splitlines()
    signature = f"{getattr(member, '__name__', '')}("
    return "\n".join(lines[1:]).strip() if lines and lines[0].startswith(signature) else doc


@pytest.mark.parametrize("name,member", _binding_members(), ids=lambda x: x
                         if isinstance(x, str) else "")
def test_every_binding_method_says_what_it_does(name: str, member: object) -> None:
    assert len(_text(member)) >= 20, f"{name} has no docstring beyond its signature"
    assert "arg0" not in (inspect.getdoc(member) or ""), f"{name} has an unnamed parameter"


@pytest.mark.parametrize("name", [n for n in ae.__all__])
def test_every_public_name_of_the_package_has_a_docstring(name: str) -> None:
    value = getattr(ae, name)
    if isinstance(value, str):  # DEFAULT_CONFIG, NATIVE_CONFIG: settings strings
        ae.parse_config(value)
        return
    assert len(_text(value)) >= 20, f"allocator_ext.{name} has no docstring"


def test_help_of_the_package_reads_as_documentation() -> None:
    text = pydoc.render_doc(ae, renderer=pydoc.plaintext)
    assert "Allocate `size` bytes" in text and "take_interval_peaks" in text
    assert "The device cannot hold a request" in text  # OutOfMemoryError
    assert "arg0" not in text
