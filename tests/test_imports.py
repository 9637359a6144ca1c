"""The library's import graph: packages in layers, dependencies pointing one way.

Read from the source with ``ast``: every runtime import, also those inside functions, so a
dependency cannot hide behind a lazy import (``if TYPE_CHECKING:`` imports are for
annotations only). A module may import its own package and any package of a lower layer,
never one of its own layer or above; so there is no cycle between packages and none between
modules. No ``shardlib`` module imports the model zoo ``models`` (the trainer and planner
take model factories).
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

LAYERS = (
    ("core",),
    ("parallel", "dataset", "distributed"),
    ("analysis", "checkpoint"),
    ("interop",),
    ("train",),
    ("planner",),
    ("tools",),
)
"""Lowest first; the README's map states the same order."""
LAYER = {package: rank for rank, packages in enumerate(LAYERS) for package in packages}


def _modules() -> dict[str, Path]:
    out = {}
    for path in (ROOT / "shardlib").rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _runtime_nodes(tree: ast.AST):
    """Every node except those under ``if TYPE_CHECKING:`` (imports for annotations only)."""
    todo = [tree]
    while todo:
        node = todo.pop()
        yield node
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            todo.extend(node.orelse)
            continue
        todo.extend(ast.iter_child_nodes(node))


def _imports(path: Path) -> set[str]:
    found = set()
    for node in _runtime_nodes(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found |= {f"{node.module}.{alias.name}" for alias in node.names}
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {m: {i for i in _imports(p) if i in modules and i != m} for m, p in modules.items()}


def _package(module: str) -> str | None:
    """``shardlib.parallel.context.kernels`` -> ``parallel``; the top-level ``shardlib`` -> None."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def test_every_package_has_a_layer():
    packages = {_package(m) for m in _modules()} - {None}
    assert packages <= set(LAYER), sorted(packages - set(LAYER))


def test_imports_point_down_the_layers():
    """A lower layer never imports a higher one, nor a sibling package of its own layer."""
    wrong = []
    for module, deps in _graph().items():
        here = _package(module)
        for dep in deps:
            there = _package(dep)
            if here is None or there == here:
                continue  # the public API (shardlib/__init__) may import anything below it
            if there is None or LAYER[there] >= LAYER[here]:
                wrong.append(f"{module} -> {dep}")
    assert sorted(wrong) == []


def test_no_shardlib_module_imports_models():
    offenders = {
        m: sorted(i for i in _imports(p) if i == "models" or i.startswith("models."))
        for m, p in _modules().items()
    }
    assert {m: i for m, i in offenders.items() if i} == {}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    cycles, state = [], {}  # state 1: on the current path, 2: finished

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                cycles.append(path[path.index(dep) :] + [dep])
            elif dep not in state:
                visit(dep, [*path, dep])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    return cycles


def test_no_import_cycle_between_modules():
    assert _cycles(_graph()) == []


def test_no_import_cycle_between_packages():
    """Collapsed to packages (``core``, ``parallel``, ...), the graph has no cycle either."""
    packages: dict[str, set[str]] = {}
    for module, deps in _graph().items():
        here = _package(module) or "shardlib"
        packages.setdefault(here, set()).update(
            _package(d) or "shardlib" for d in deps if (_package(d) or "shardlib") != here
        )
    assert _cycles(packages) == []


def test_the_graph_is_read():
    """The walk sees the library's real edges (a broken walk would pass the tests above)."""
    graph = _graph()
    assert "shardlib.core.rules" in graph["shardlib.parallel.plan"]
    assert "shardlib.parallel.plan" in graph["shardlib.train.config"]
    assert _cycles({"a": {"b"}, "b": {"a"}}) == [["a", "b", "a"]]
    assert len(graph) > 40
