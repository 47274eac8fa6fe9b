"""The import graph of allocator_ext and exporter, read from the source with `ast` (every import
at any depth, those inside functions too), as the architecture's specification:

- no cycle among the modules, nor among the packages;
- dependencies run one way, by package: each package imports only packages in the layers below
  its own (LAYERS), and a package of its own layer only where SIBLINGS declares it; the
  protocol (allocator_ext.protocol) sits below both the agent and the sidecar, and nothing in
  allocator_ext reaches exporter;
- the sidecar and the command line load neither the compiled core nor torch nor matplotlib when
  they are imported: those imports stay inside the functions that need them.

A failure prints the chain of imports, each with its file and line.
"""

from __future__ import annotations

import ast
import collections
import dataclasses
import functools
import json
import subprocess
import sys
from pathlib import Path

import pytest
from support.paths import REPO

PACKAGES = ("allocator_ext", "exporter")
# Built from C++, so there is no source to read: they import nothing of ours.
COMPILED = {"allocator_ext._core"}
PROTOCOL = "allocator_ext.protocol"  # below both the agent and the sidecar
HEAVY = ("torch", "matplotlib")
# Modules that exist to drive torch (the workload library, a module or a package and everything
# in it): torch at their top is fine, as long as nothing else imports them at its own top.
TORCH_MODULES = {"allocator_ext.workloads"}


def _drives_torch(module: str) -> bool:
    return any(module == m or module.startswith(f"{m}.") for m in TORCH_MODULES)

# The packages in layers, lowest first. A package is a sub-package of allocator_ext or exporter,
# a module directly inside one (each its own unit), or the top package itself (its __init__).
# Imports inside functions count: a dependency is one wherever it is written.
LAYERS: tuple[tuple[str, ...], ...] = (
    (PROTOCOL,),                  # what the agent and the sidecar share
    ("allocator_ext._core",),     # the compiled allocator
    ("allocator_ext.replay", "allocator_ext.native", "allocator_ext.settings"),
    ("allocator_ext.agent",),
    ("allocator_ext.torch_integration",),
    ("allocator_ext", "allocator_ext._autostart", "allocator_ext.workloads"),
    ("exporter", "exporter.shared"),  # what the sidecar's subsystems share
    ("exporter.agents", "exporter.metrics", "exporter.admin", "exporter.policy"),
    ("exporter.sidecar",),        # the composition root: the daemon wired together
    ("exporter.commands",),
    ("exporter.cli",),
)
# (importer, imported) pairs of one layer where the first may import the second: none today.
SIBLINGS: frozenset[tuple[str, str]] = frozenset()

# The packages in layers, lowest first. A package is a sub-package of allocator_ext or exporter,
# a module directly inside one (each its own unit), or the top package itself (its __init__).
# Imports inside functions count: a dependency is one wherever it is written.
LAYERS: tuple[tuple[str, ...], ...] = (
    (PROTOCOL,),                  # what the agent and the sidecar share
    ("allocator_ext._core",),     # the compiled allocator
    ("allocator_ext.replay", "allocator_ext.native", "allocator_ext.settings"),
    ("allocator_ext.agent",),
    ("allocator_ext.torch_integration",),
    ("allocator_ext", "allocator_ext._autostart", "allocator_ext.workloads"),
    ("exporter", "exporter.shared"),  # what the sidecar's subsystems share
    ("exporter.agents", "exporter.metrics", "exporter.admin", "exporter.policy"),
    ("exporter.sidecar",),        # the composition root: the daemon wired together
    ("exporter.commands",),
    ("exporter.cli",),
)
# (importer, imported) pairs of one layer that may depend on each other's side: none today.
SIBLINGS: frozenset[tuple[str, str]] = frozenset()


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


def _type_checking(node: ast.AST) -> bool:
    test = node.test if isinstance(node, ast.If) else None
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _lazy_nodes(tree: ast.AST) -> set[int]:
    """ids of the import statements that do not run when the module is imported: inside a
    function, or under `if TYPE_CHECKING:`."""
    inside: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)) or \
                _type_checking(node):
            body = node.body if isinstance(node, ast.If) else [node]
            inside.update(id(n) for part in body for n in ast.walk(part)
                          if isinstance(n, (ast.Import, ast.ImportFrom)))
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


def test_allocator_ext_imports_nothing_of_exporter() -> None:
    graph = _ours_only(import_graph())
    chains = _offences(graph, [m for m in sorted(graph) if m.split(".")[0] == "allocator_ext"],
                       lambda module: module.split(".")[0] == "exporter")
    if chains:
        pytest.fail(f"allocator_ext reaches exporter:\n{_show(chains)}", pytrace=False)


def loaded_graph() -> dict[str, list[Import]]:
    """The import graph plus what Python runs implicitly: importing `a.b.c` first imports the
    packages `a` and `a.b`."""
    graph = {module: list(edges) for module, edges in import_graph().items()}
    modules = source_modules()
    for module in graph:
        parts = module.split(".")
        for n in range(1, len(parts)):
            parent = ".".join(parts[:n])
            if parent in graph:
                path = modules.get(module)
                where = str(path.relative_to(REPO)) if path else module
                graph[module].append(Import(module, parent, where, 0, False))
    return graph


def _heavy(module: str) -> bool:
    """What the sidecar's side must not load when imported: the compiled core, torch,
    matplotlib, and anything of allocator_ext but its protocol (and the package's own light
    __init__, which importing the protocol runs)."""
    if module.split(".")[0] in HEAVY:
        return True
    if module.split(".")[0] != "allocator_ext":
        return False
    return module != "allocator_ext" and module != PROTOCOL and \
        not module.startswith(f"{PROTOCOL}.")


def test_importing_exporter_loads_neither_the_core_nor_torch_nor_matplotlib() -> None:
    graph = loaded_graph()
    chains = _offences(graph, [m for m in sorted(graph) if m.split(".")[0] == "exporter"],
                       _heavy, lazy_ok=False)
    if chains:
        pytest.fail(f"imported at module level:\n{_show(chains)}", pytrace=False)


def test_importing_every_exporter_module_loads_neither_the_core_nor_torch() -> None:
    # The same, as Python does it: what the reader cannot see (an importlib call, a package's
    # __getattr__) shows here.
    modules = sorted(m for m in source_modules() if m.split(".")[0] == "exporter")
    code = ("import importlib, json, sys\n"
            f"for m in {modules!r}: importlib.import_module(m)\n"
            "print(json.dumps(sorted(sys.modules)))")
    loaded = json.loads(subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True,
                                       capture_output=True, text=True).stdout)
    heavy = [m for m in loaded if m == "allocator_ext._core" or m.split(".")[0] in HEAVY]
    assert not heavy, f"importing exporter's modules loaded {heavy}"
    assert f"{PROTOCOL}.proto.allocwatch.v1.agent_pb2" in loaded  # what was imported, was


def package_of(module: str) -> str:
    """The unit LAYERS names: the top package, a sub-package, or a module directly inside the
    top package."""
    parts = module.split(".")
    return ".".join(parts[:2])


@dataclasses.dataclass(frozen=True)
class PackageImport:
    source: str   # the importing package
    target: str   # the imported package
    via: Import   # one module-level import that makes it so

    @property
    def lazy(self) -> bool:
        return False  # a dependency is one wherever it is written

    def __str__(self) -> str:
        return f"{self.source} => {self.target}: {self.via}"


def package_graph(graph: dict[str, list[Import]]) -> dict[str, list[PackageImport]]:
    packages: dict[str, dict[str, PackageImport]] = {}
    for module, edges in _ours_only(graph).items():
        source = package_of(module)
        found = packages.setdefault(source, {})
        for edge in edges:
            target = package_of(edge.target)
            if target != source and target not in found:
                found[target] = PackageImport(source, target, edge)
    return {package: [found[t] for t in sorted(found)] for package, found in packages.items()}


def layer_offences(packages: dict[str, list[PackageImport]],
                   layers: tuple[tuple[str, ...], ...],
                   siblings: frozenset[tuple[str, str]]) -> list[str]:
    """Each package not in `layers`, and each import of a package in a layer above, or of one
    in the same layer that `siblings` does not declare."""
    level = {package: n for n, layer in enumerate(layers) for package in layer}
    problems = [f"{package}: in no layer (add it to LAYERS)"
                for package in sorted(packages) if package not in level]
    for package in sorted(packages):
        for edge in packages[package]:
            if package not in level or edge.target not in level:
                continue
            if level[edge.target] > level[package]:
                problems.append(f"imports a package of a higher layer: {edge}")
            elif level[edge.target] == level[package] and \
                    (package, edge.target) not in siblings:
                problems.append(f"imports an undeclared sibling: {edge}")
    return problems


def test_no_package_imports_itself_back() -> None:
    cycles = find_cycles(package_graph(import_graph()))  # type: ignore[arg-type]
    if cycles:
        pytest.fail(f"package cycles:\n{_show(cycles)}", pytrace=False)


def test_packages_import_only_the_layers_below_them() -> None:
    problems = layer_offences(package_graph(import_graph()), LAYERS, SIBLINGS)
    if problems:
        pytest.fail("\n".join(problems), pytrace=False)


def test_the_package_checks_see_an_arrow_back_up() -> None:
    # The checks are only as good as their reading: an import of a higher layer (even inside a
    # function), of an undeclared sibling, and a cycle between packages are each reported with
    # the import that makes them.
    layers = (("p.low",), ("p.high", "p.side"))
    packages = package_graph({
        "p.low.a": [Import("p.low.a", "p.high.b", "p/low/a.py", 3, True)],
        "p.high.b": [Import("p.high.b", "p.side.c", "p/high/b.py", 4, False),
                     Import("p.high.b", "p.low.a", "p/high/b.py", 5, False)],
        "p.side.c": [],
    })
    problems = layer_offences(packages, layers, frozenset())
    assert problems == [
        "imports an undeclared sibling: p.high => p.side: p.high.b -> p.side.c (p/high/b.py:4)",
        "imports a package of a higher layer: p.low => p.high: p.low.a -> p.high.b "
        "(p/low/a.py:3, in a function)",
    ]
    assert len(layer_offences(packages, layers, frozenset({("p.high", "p.side")}))) == 1
    assert layer_offences(packages, (("p.low",),), frozenset())[0] == \
        "p.high: in no layer (add it to LAYERS)"
    cycles = find_cycles(packages)  # type: ignore[arg-type]
    assert len(cycles) == 1
    assert "p/low/a.py:3" in _show(cycles) and "p/high/b.py:5" in _show(cycles)


def test_torch_and_matplotlib_are_imported_only_where_they_are_used() -> None:
    eager = [edge for module, edges in import_graph().items() for edge in edges
             if not edge.lazy and not _drives_torch(module)
             and (edge.target in HEAVY or _drives_torch(edge.target))]
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
