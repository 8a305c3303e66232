"""The import graph of changecap_jax: no cycles, and the library never imports data_prep.

Every module is parsed with ``ast``; imports at any depth count (a function-level import is
still a dependency, only a deferred one), as do ``from changecap_jax import x`` forms naming a
submodule.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "changecap_jax"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def package_modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted((ROOT / PACKAGE).rglob("*.py"))}


def imported_names(path: Path, name: str) -> set[str]:
    """Every dotted name ``path`` imports, made absolute; ``from a import b`` gives both a and
    a.b (a.b is kept only when it is a module, by the caller)."""
    is_package = path.name == "__init__.py"
    package = name if is_package else name.rpartition(".")[0]
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            names.add(source)
            names.update(f"{source}.{alias.name}" for alias in node.names)
    return names


def import_graph() -> dict[str, set[str]]:
    """module -> the changecap_jax modules it imports (their nearest existing module) and the
    packages whose ``__init__`` Python runs first to import them (``models/__init__.py``
    imports every model: importing ``models.base`` runs it)."""
    modules = package_modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets = set()
        for imported in imported_names(path, name):
            while imported and imported not in modules:
                imported = imported.rpartition(".")[0]
            while imported:
                # The importer's own packages are already being imported when it runs.
                if imported != name and not name.startswith(imported + "."):
                    targets.add(imported)
                imported = imported.rpartition(".")[0]
        graph[name] = targets
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return [_one_cycle(graph, component) for component in components]


def _one_cycle(graph: dict[str, set[str]], component: list[str]) -> list[str]:
    """A concrete path start -> ... -> start inside a strongly connected component."""
    members = set(component)
    start = component[0]
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        node = frontier.pop(0)
        for target in sorted(graph[node] & members):
            if target == start:
                return paths[node] + [start]
            if target not in paths:
                paths[target] = paths[node] + [target]
                frontier.append(target)
    return component


def test_no_import_cycles() -> None:
    cycles = find_cycles(import_graph())
    assert not cycles, "import cycles in changecap_jax:\n" + "\n".join(
        " -> ".join(cycle) for cycle in cycles)


def test_library_never_imports_data_prep() -> None:
    offenders = sorted(
        {name for name, path in package_modules().items()
         for imported in imported_names(path, name)
         if imported == "data_prep" or imported.startswith("data_prep.")})
    assert not offenders, ("changecap_jax must not import the data_prep scripts (they import "
                           "the library); these do: " + ", ".join(offenders))
