"""No import circle in ``unirl/``: the module graph, read from the source, has no cycle.

Every import counts, wherever it is written: at the top of a module, inside a function (a lazy
import is still a dependency, only a later one) and under ``if TYPE_CHECKING:`` (a type-only
import still ties the two modules' meanings together). ``from a import b`` where ``a.b`` is a
module is an import of ``a.b``; otherwise it is an import of ``a`` (its ``__init__``). An import of
``a.b`` is not counted as one of the package ``a``: every module would otherwise import the
``unirl/__init__`` that imports the backends. A circle means two modules that cannot be understood
(or split, or tested) one without the other; break it by moving the shared piece down, not by
hiding the import.
"""

from __future__ import annotations

import ast
from pathlib import Path

import unirl

ROOT = Path(unirl.__file__).parent


def module_names(root: Path = ROOT) -> dict[str, Path]:
    """Module name -> file, for every ``.py`` under ``root`` (a package is its ``__init__``)."""
    names = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names[".".join(parts)] = path
    return names


def _resolve(module: str | None, level: int, importer: str, is_package: bool) -> str:
    """The absolute name of ``from <level dots><module> import ...`` in ``importer``."""
    if level == 0:
        return module or ""
    base = importer.split(".")
    base = base if is_package else base[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join([*base, module] if module else base)


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The ``unirl`` modules that ``name`` imports anywhere in its source."""
    found = set()
    is_package = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            source = _resolve(node.module, node.level, name, is_package)
            for alias in node.names:
                submodule = f"{source}.{alias.name}"
                found.add(submodule if submodule in known else source)
    return {m for m in found if m in known and m != name}


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    names = module_names(root)
    known = set(names)
    return {name: imports_of(name, path, known) for name, path in names.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The shortest cycle through each module of each strongly connected component of more than
    one module, each cycle once (Tarjan for the components, then a breadth-first search)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(start: str) -> None:
        # Iterative Tarjan: (node, iterator over its successors).
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, successors = work[-1]
            for nxt in successors:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
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

    found: list[list[str]] = []
    seen: set[tuple[str, ...]] = set()
    for component in sorted(components):
        members = set(component)
        for start in component:
            cycle = _shortest_cycle(graph, members, start)
            turn = cycle.index(min(cycle[:-1]))
            canonical = tuple(cycle[turn:-1] + cycle[:turn])
            if canonical not in seen:
                seen.add(canonical)
                found.append([*canonical, canonical[0]])
    return found


def _shortest_cycle(graph: dict[str, set[str]], members: set[str], start: str) -> list[str]:
    """The shortest cycle from ``start`` back to it inside ``members`` (breadth-first)."""
    parents: dict[str, str | None] = {start: None}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for nxt in sorted(graph[node] & members):
                if nxt == start:
                    path = [node]
                    while parents[path[0]] is not None:
                        path.insert(0, parents[path[0]])
                    return [*path, start]
                if nxt not in parents:
                    parents[nxt] = node
                    following.append(nxt)
        frontier = following
    raise AssertionError(f"{start} is in a strongly connected component but on no cycle")


def test_the_graph_sees_every_kind_of_import(tmp_path):
    """The scan against a small hand-written package: a top-level, a function-local, a
    TYPE_CHECKING, a relative and a ``from package import submodule`` import each make an
    edge; a cycle through them is found."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg.sub import c\n")
    (pkg / "sub" / "c.py").write_text("def f():\n    from ..b import x\n")
    (pkg / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import pkg.d\nx = 1\n"
    )
    (pkg / "d.py").write_text("from . import a\nfrom pkg.sub import VALUE\n")
    graph = import_graph(pkg)
    assert graph == {
        "pkg": set(),
        "pkg.a": {"pkg.sub.c"},
        "pkg.b": {"pkg.d"},
        "pkg.d": {"pkg.a", "pkg.sub"},
        "pkg.sub": set(),
        "pkg.sub.c": {"pkg.b"},
    }
    assert cycles(graph) == [["pkg.a", "pkg.sub.c", "pkg.b", "pkg.d", "pkg.a"]]


def test_no_import_cycle_in_unirl():
    found = cycles(import_graph())
    listed = "\n  ".join(" -> ".join(cycle) for cycle in found)
    assert not found, (
        f"{len(found)} import cycles in unirl/ (the shortest through each module of a circle):\n  {listed}"
    )


def room_graph(graph: dict[str, set[str]], package: str) -> dict[str, set[str]]:
    """The graph between the rooms of ``package``: each direct child (a module or a sub-package
    with everything under it) is one node; an import between two children is one edge."""

    def room(module: str) -> str | None:
        if not module.startswith(package + "."):
            return None
        return f"{package}.{module[len(package) + 1 :].split('.')[0]}"

    rooms: dict[str, set[str]] = {}
    for module, imported in graph.items():
        source = room(module)
        if source is None:
            continue
        rooms.setdefault(source, set())
        for target in filter(None, map(room, imported)):
            if target != source:
                rooms[source].add(target)
                rooms.setdefault(target, set())
    return rooms


def test_room_graph_collapses_children(tmp_path):
    """Two modules without a circle between them still make one between their rooms when each
    room imports the other: the drawing at that level is a circle."""
    pkg = tmp_path / "pkg"
    for room in ("low", "high"):
        (pkg / room).mkdir(parents=True)
        (pkg / room / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "low" / "a.py").write_text("from pkg.high import b\n")
    (pkg / "high" / "b.py").write_text("x = 1\n")
    (pkg / "high" / "c.py").write_text("from pkg.low import d\n")
    (pkg / "low" / "d.py").write_text("y = 1\n")
    graph = import_graph(pkg)
    assert cycles(graph) == []
    rooms = room_graph(graph, "pkg")
    assert rooms == {"pkg.low": {"pkg.high"}, "pkg.high": {"pkg.low"}}
    assert cycles(rooms) == [["pkg.high", "pkg.low", "pkg.high"]]


def test_no_circle_between_rooms_at_any_level():
    """Every package's rooms (its modules and sub-packages) import each other one way only: the
    drawing of each level has no circle, so no import runs upward at any level."""
    graph = import_graph()
    packages = sorted({m for m in graph if any(o.startswith(m + ".") for o in graph)})
    found = [
        " -> ".join(cycle) for package in packages for cycle in cycles(room_graph(graph, package))
    ]
    assert not found, "circles between rooms:\n  " + "\n  ".join(found)
