"""The import graph of allocator_ext and exporter, read from the source with `ast` (every import
at any depth, those inside functions too), as the architecture's specification:

- no cycle among the modules;
- dependencies run one way: the agent side (anything in allocator_ext) reaches nothing of
  exporter but exporter.protocol, which both sides share;
- the sidecar and the command line load neither the compiled core nor torch nor matplotlib when
  they are imported: those imports stay inside the functions that need them.

A failure prints the chain of imports, each with its file and line.
"""

from __future__ import annotations

import ast
import collections
import dataclasses
import functools
from pathlib import Path

import pytest
from support.paths import REPO

PACKAGES = ("allocator_ext", "exporter")
# Built from C++, so there is no source to read: they import nothing of ours.
COMPILED = {"allocator_ext._core"}
SHARED = "exporter.protocol"  # the one part of exporter the agent side may import
HEAVY = ("torch", "matplotlib")
# Modules that exist to drive torch (the workload library): torch at their top is fine, as long
# as nothing imports them at its own top.
TORCH_MODULES = {"allocator_ext.workloads"}


@dataclasses.dataclass(frozen=True)
class Import:
    source: str   # the importing module
    target: str   # the imported module (ours) or top-level package (anyone's)
    file: str
    line: int
    lazy: bool    # inside a function: runs only when called

    def __str__(self) -> str:
        return f"{self.source} -> {self.target} ({self.file}:{self.line}"\
               f"{', in a function' if self.lazy else ''})"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def source_modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            if "__pycache__" not in path.parts:
                found[_module_name(path)] = path
    return found


def _ours(name: str) -> bool:
    return name.split(".")[0] in PACKAGES


def _resolve(name: str, known: set[str]) -> str:
    """The module an import of `name` runs last: `name` itself, or its longest known prefix."""
    while name not in known and "." in name:
        name = name.rsplit(".", 1)[0]
    return name


def _lazy_nodes(tree: ast.AST) -> set[int]:
    """ids of the import statements that sit inside a function."""
    inside: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            inside.update(id(n) for n in ast.walk(node) if isinstance(n, (ast.Import,
                                                                          ast.ImportFrom)))
    return inside


def imports_of(name: str, path: Path, known: set[str]) -> list[Import]:
    tree = ast.parse(path.read_text(), filename=str(path))
    lazy = _lazy_nodes(tree)
    is_package = path.name == "__init__.py"
    found = []
    for node in ast.walk(tree):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the importing module's package
                package = name if is_package else name.rsplit(".", 1)[0]
                for _ in range(node.level - 1):
                    package = package.rsplit(".", 1)[0]
                base = f"{package}.{base}" if base else package
            # `from package import module` imports that module; `from module import name`
            # imports the module itself.
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base
                       for alias in node.names]
        for target in targets:
            resolved = _resolve(target, known) if _ours(target) else target.split(".")[0]
            found.append(Import(name, resolved, str(path.relative_to(REPO)), node.lineno,
                                id(node) in lazy))
    return found


@functools.cache
def import_graph() -> dict[str, list[Import]]:
    modules = source_modules()
    known = set(modules) | COMPILED
    graph: dict[str, list[Import]] = {name: [] for name in known}
    for name, path in modules.items():
        for edge in imports_of(name, path, known):
            if edge.target != name:  # `from package import name` inside the package itself
                graph[name].append(edge)
    return graph


def _ours_only(graph: dict[str, list[Import]]) -> dict[str, list[Import]]:
    return {m: [e for e in edges if e.target in graph] for m, edges in graph.items()}


def find_cycles(graph: dict[str, list[Import]]) -> list[list[Import]]:
    """One cycle (as its chain of imports) for each strongly connected group of modules."""
    graph = _ours_only(graph)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[set[str]] = []

    def connect(module: str) -> None:  # Tarjan's algorithm
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for edge in graph[module]:
            if edge.target not in index:
                connect(edge.target)
                low[module] = min(low[module], low[edge.target])
            elif edge.target in on_stack:
                low[module] = min(low[module], index[edge.target])
        if low[module] == index[module]:
            group = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.add(member)
                if member == module:
                    break
            if len(group) > 1:
                groups.append(group)

    for module in sorted(graph):
        if module not in index:
            connect(module)
    cycles = []
    for group in groups:
        start = min(group)
        chain = _shortest_chain(graph, {start}, lambda m, start=start: m == start, group)
        cycles.append(chain)
    return cycles


def _shortest_chain(graph: dict[str, list[Import]], sources: set[str], wanted,
                    within: set[str] | None = None, lazy_ok: bool = True) -> list[Import]:
    """The shortest chain of imports from one of `sources` to a module for which wanted() is
    true (at least one step); [] when there is none."""
    queue = collections.deque((source, []) for source in sorted(sources))
    seen: set[str] = set()
    while queue:
        module, chain = queue.popleft()
        for edge in graph.get(module, []):
            if (within is not None and edge.target not in within) or (edge.lazy and not lazy_ok):
                continue
            if wanted(edge.target):
                return [*chain, edge]
            if edge.target not in seen:
                seen.add(edge.target)
                queue.append((edge.target, [*chain, edge]))
    return []


def _show(chains: list[list[Import]]) -> str:
    return "\n\n".join("\n".join(f"  {edge}" for edge in chain) for chain in chains)


def _offences(graph: dict[str, list[Import]], sources: list[str], wanted,
              lazy_ok: bool = True) -> list[list[Import]]:
    """For each import that reaches a wanted module, the shortest chain leading to it from one
    of `sources`."""
    chains: dict[Import, list[Import]] = {}
    for source in sources:
        chain = _shortest_chain(graph, {source}, wanted, lazy_ok=lazy_ok)
        if chain and (chain[-1] not in chains or len(chain) < len(chains[chain[-1]])):
            chains[chain[-1]] = chain
    return [chains[edge] for edge in sorted(chains, key=str)]


def test_no_module_imports_itself_back() -> None:
    cycles = find_cycles(import_graph())
    if cycles:
        pytest.fail(f"import cycles:\n{_show(cycles)}", pytrace=False)


def test_the_agent_side_imports_nothing_of_exporter_but_the_protocol() -> None:
    graph = _ours_only(import_graph())

    def sidecar_side(module: str) -> bool:
        return module.startswith("exporter.") and not (
            module == SHARED or module.startswith(f"{SHARED}."))

    chains = _offences(graph, [m for m in sorted(graph) if m.split(".")[0] == "allocator_ext"],
                       sidecar_side)
    if chains:
        pytest.fail(f"allocator_ext reaches exporter beyond {SHARED}:\n{_show(chains)}",
                    pytrace=False)


def test_importing_exporter_loads_neither_the_core_nor_torch_nor_matplotlib() -> None:
    graph = import_graph()

    def heavy(module: str) -> bool:
        return module.split(".")[0] in ("allocator_ext", *HEAVY)

    chains = _offences(graph, [m for m in sorted(graph) if m.split(".")[0] == "exporter"],
                       heavy, lazy_ok=False)
    if chains:
        pytest.fail(f"imported at module level:\n{_show(chains)}", pytrace=False)


def test_torch_and_matplotlib_are_imported_only_where_they_are_used() -> None:
    eager = [edge for module, edges in import_graph().items() for edge in edges
             if not edge.lazy and ((edge.target in HEAVY and module not in TORCH_MODULES)
                                   or edge.target in TORCH_MODULES)]
    if eager:
        pytest.fail("imported at module level:\n" + "\n".join(f"  {e}" for e in eager),
                    pytrace=False)


def test_the_reader_sees_lazy_imports_and_resolves_packages_to_modules() -> None:
    # The graph is only as good as its reader: an import inside a function counts, and
    # `from package import module` is an edge to that module, not to the package.
    graph = import_graph()
    torch_integration = {(e.target, e.lazy) for e in graph["allocator_ext.torch_integration"]}
    assert ("allocator_ext.agent", True) in torch_integration
    assert ("allocator_ext._core", False) in torch_integration
    client = {e.target for e in graph["allocator_ext.agent.client"]}
    assert "allocator_ext.agent.convert" in client and "allocator_ext.agent" not in client
    assert find_cycles({"a": [Import("a", "b", "a.py", 1, True)],
                        "b": [Import("b", "a", "b.py", 2, False)]})
