"""The house's layers, read from the source (ast; nothing is imported).

* ``vlens/worker/`` runs inside vLLM's workers: it imports nothing of the
  notebook side, not even inside a function;
* no import circles anywhere in ``vlens/``, counting imports inside
  functions and the package ``__init__`` each import runs;
* no module over 450 lines, no function over 100 (the toy world's
  generator aside).
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "vlens"

# what the worker may not import: the notebook process's modules
NOTEBOOK_SIDE = (
    "vlens.session", "vlens._runner", "vlens.checks", "vlens.widgets", "vlens.plots",
    "vlens.remote", "vlens.engine", "vlens.results", "vlens.edits", "vlens.methods",
    "vlens.testing", "vlens.cli", "vlens.calls", "vlens._progress", "vlens.lens",
)


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _import_nodes(tree: ast.AST):
    """Every import the module can run: at the top, in functions, in
    classes; not those under ``if TYPE_CHECKING:`` (never run)."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                yield from _import_nodes(ast.Module(body=[child], type_ignores=[]))
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        yield from _import_nodes(node)


def _parents(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def _graph(own_packages: bool = True) -> dict[str, set[str]]:
    """module -> the vlens modules importing it runs (directly).
    ``own_packages``: count the module's own packages (their ``__init__``
    runs before it; a package re-exporting its modules is no circle)."""
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        is_pkg = path.name == "__init__.py"
        here = name if is_pkg else name.rsplit(".", 1)[0]
        deps: set[str] = set()
        for node in _import_nodes(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                if node.level:
                    base = here.split(".")[: len(here.split(".")) - node.level + 1]
                    mod = ".".join(base + ([node.module] if node.module else []))
                else:
                    mod = node.module or ""
                targets = [mod] + [f"{mod}.{a.name}" for a in node.names]
            for t in targets:
                if t in modules:
                    deps.add(t)
                    deps.update(p for p in _parents(t) if p in modules)
        own = [p for p in _parents(name) if p in modules] + [name]
        if own_packages:  # importing a module runs its packages' __init__ first
            deps.update(own)
        else:  # already running when this module runs
            deps.difference_update(own)
        deps.discard(name)
        graph[name] = deps
    return graph


def _reach(graph: dict[str, set[str]], start: str) -> dict[str, str]:
    """Modules reachable from ``start``, each with the module that imports it."""
    seen: dict[str, str] = {}
    todo = [start]
    while todo:
        m = todo.pop()
        for d in graph.get(m, ()):
            if d not in seen:
                seen[d] = m
                todo.append(d)
    return seen


def test_the_graph_sees_the_packages():
    graph = _graph()
    assert "vlens.worker.hooks" in graph and "vlens.protocol.plan" in graph
    assert "vlens.worker.planner" in graph["vlens.worker.hooks"]


def test_the_worker_imports_nothing_of_the_notebook_side():
    graph = _graph()
    bad = []
    for name in graph:
        if not name.startswith("vlens.worker"):
            continue
        via = _reach(graph, name)
        for m, parent in via.items():
            if m.startswith(NOTEBOOK_SIDE):
                bad.append(f"{name} reaches {m} (imported by {parent})")
    assert not bad, "\n".join(bad)


def test_no_import_circles():
    graph = _graph(own_packages=False)
    circles = []
    for name in graph:
        via = _reach(graph, name)
        if name in via:  # walk back the path that closes the circle
            path, m = [name], via[name]
            while m != name and m not in path:
                path.append(m)
                m = via[m]
            circles.append(" <- ".join(path + [name]))
    assert not circles, "\n".join(sorted(circles))


# the toy world's generator: one table of facts, written out as data
SIZE_EXEMPT = {"vlens/models/world.py"}


def test_no_module_over_450_lines_and_no_function_over_100():
    too_long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE.parent).as_posix()
        if rel in SIZE_EXEMPT:
            continue
        src = path.read_text()
        if len(src.splitlines()) > 450:
            too_long.append(f"{rel}: {len(src.splitlines())} lines")
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > 100:
                    too_long.append(f"{rel}:{node.lineno} {node.name}: {n} lines")
    assert not too_long, "\n".join(too_long)


def test_no_module_imports_a_private_name_of_another():
    """A name starting with ``_`` is its module's own; what another module
    needs has a public name in a proper home (the server once imported
    ``_runner._engine_prompt``, ``engine._saved_config``,
    ``session._resolve_model``)."""
    private = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("vlens"):
                private += [f"{path.relative_to(PACKAGE.parent)}: {node.module}.{a.name}"
                            for a in node.names if a.name.startswith("_")]
    assert not private, "\n".join(private)
