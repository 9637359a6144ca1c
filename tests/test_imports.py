"""The library's import graph: dependencies point one way (models -> ops -> core).

Read from the source with ``ast``: every runtime import, also those inside functions, so a
cycle cannot hide behind a lazy import (``if TYPE_CHECKING:`` imports are for annotations).
No cycle among ``shardlib`` modules, and no ``shardlib`` module imports the model zoo
``models`` (the trainer and planner take model factories).
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


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


def test_no_shardlib_module_imports_models():
    offenders = {
        m: sorted(i for i in _imports(p) if i == "models" or i.startswith("models."))
        for m, p in _modules().items()
    }
    assert {m: i for m, i in offenders.items() if i} == {}


def test_no_import_cycle_inside_shardlib():
    graph, cycles = _graph(), []
    state: dict[str, int] = {}  # 1: on the current path, 2: finished

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for dep in sorted(graph[module]):
            if state.get(dep) == 1:
                cycles.append(path[path.index(dep) :] + [dep])
            elif dep not in state:
                visit(dep, [*path, dep])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert cycles == []


def test_the_graph_is_read():
    """The walk sees the library's real edges (a broken walk would pass the tests above)."""
    graph = _graph()
    assert "shardlib.rules" in graph["shardlib.parallel"]
    assert "shardlib.parallel" in graph["shardlib.train.config"]
    assert len(graph) > 40
