"""The shape of the package, read from the source (every import, at any depth of the file), and kept so.

Rooms and who may import whom: ``protocol`` (the sans-IO codec) imports nothing of the project; ``store`` only
``paths``; ``numerics`` only the store's kernels and the compiled fast path's loader; ``server`` (request semantics,
sans-IO) protocol/store/numerics/config/paths; ``persist`` (every file format) numerics (to rebuild absent rows),
the store (fsync), paths and the protocol (how stock workers route keys, to reshard); ``transport`` (the only zmq
code) the protocol; ``node`` (the server process) wires transport and server together; ``worker`` (the training
process, the only mxnet code) and ``launch`` never import ``node``. The sans-IO rooms never import a process room.
No import circles. Only ``transport`` imports zmq, only ``worker`` imports mxnet. Entry points (``__main__``
modules) only hand over to ``kvstore_lazy.cli``.

Sizes as a symptom: no class over 400 lines, no module over 600, no function over 60.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "kvstore_lazy"

P = "kvstore_lazy."
SANS_IO = {P + "protocol", P + "store", P + "numerics", P + "server"}
PROCESS = {P + "node", P + "transport", P + "worker", P + "launch"}
# room -> project modules it may import (prefixes); its own room is always allowed
ALLOWED = {
    P + "protocol": set(),
    P + "store": {P + "paths"},
    P + "numerics": {P + "store.kernels", P + "protocol.fast"},
    P + "server": {P + "protocol", P + "store", P + "numerics", P + "config", P + "paths"},
    P + "persist": {P + "numerics.initializers", P + "store", P + "paths", P + "protocol"},   # reshard: routing
    P + "transport": {P + "protocol"},
    P + "node": {P + "protocol", P + "transport", P + "server", P + "store", P + "numerics", P + "persist",
                 P + "config", P + "paths"},
    P + "worker": {P + "protocol", P + "persist", P + "numerics", P + "config", P + "paths"},
    P + "launch": {P + "config", P + "paths", P + "persist"},
    P + "config": set(),
    P + "paths": set(),
}
ONLY = {   # third-party module -> the only rooms that may import it
    "zmq": {P + "transport"},
    "mxnet": {P + "worker"},
}
ENTRY_POINTS = {P + "server.__main__", P + "launch.__main__", P + "__main__"}   # may import kvstore_lazy.cli
MAX_CLASS, MAX_MODULE, MAX_FUNCTION = 400, 600, 60


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(source: str, module: str, is_package: bool = False) -> set[str]:
    """Every module `source` imports (relative imports resolved against `module`), wherever the import stands."""
    package = module if is_package else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            found.add(target)
            found.update(f"{target}.{alias.name}" for alias in node.names)   # "from . import membership"
    return found


def _within(name: str, prefixes) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def package_imports() -> dict[str, set[str]]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        name = module_name(path)
        out[name] = imports_of(path.read_text(), name, path.name == "__init__.py")
    return out


def project_edges(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """module -> the project modules it imports (names that are modules of the graph, not their attributes)."""
    return {m: {i for i in imported if i in graph and i != m} for m, imported in graph.items()}


def room_of(module: str) -> str | None:
    return next((room for room in ALLOWED if _within(module, [room])), None)


def violations(graph: dict[str, set[str]]) -> list[str]:
    bad = []
    edges = project_edges(graph)
    for module, imported in graph.items():
        room = room_of(module)
        for target in sorted(edges[module]):
            if module in ENTRY_POINTS and target == P + "cli":
                continue
            if target == "kvstore_lazy":
                continue   # the package itself, as in "from kvstore_lazy import worker": the module named counts
            if room is not None and not _within(target, ALLOWED[room] | {room}):
                bad.append(f"{module} imports {target}")
            elif _within(module, SANS_IO) and _within(target, PROCESS):
                bad.append(f"{module} imports {target} (a sans-IO room imports a process room)")
        for third, owners in ONLY.items():
            if any(_within(i, [third]) for i in imported) and not _within(module, owners):
                bad.append(f"{module} imports {third}")
    return bad + [f"import circle: {' -> '.join(c)}" for c in circles(edges)]


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each as a sorted list."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_the_package_keeps_its_dependency_direction():
    graph = package_imports()
    assert {P + "server.core", P + "node", P + "transport.zmq_van", P + "worker"} <= set(graph)
    assert violations(graph) == []


def test_every_module_is_in_a_room():
    homeless = [m for m in package_imports() if m != "kvstore_lazy" and room_of(m) is None
                and m not in ENTRY_POINTS and m != P + "cli"]
    assert homeless == []


@pytest.mark.parametrize("module, source, expected", [
    (P + "server.core", "def f():\n    import zmq\n", P + "server.core imports zmq"),
    (P + "protocol.kv", "from ..server import core\n", P + "protocol.kv imports kvstore_lazy.server.core"),
    (P + "server.core", "from ..node import membership\n", P + "server.core imports kvstore_lazy.node.membership"),
    (P + "store.rows", "import mxnet as mx\n", P + "store.rows imports mxnet"),
    (P + "worker.integration", "from kvstore_lazy.node import trust\n",
     P + "worker.integration imports kvstore_lazy.node.trust"),
    (P + "launch", "import kvstore_lazy.node.membership\n", P + "launch imports kvstore_lazy.node.membership"),
    (P + "protocol.message", "import zmq\n", P + "protocol.message imports zmq"),
    (P + "store.rows", "from kvstore_lazy.server import core\n", "import circle: "),
])
def test_a_wrong_import_is_found(module, source, expected):
    graph = package_imports()
    graph[module] = graph[module] | imports_of(source, module)
    if expected == "import circle: ":   # server.core imports the store; the store importing it back is a circle
        assert any(v.startswith(expected) and module in v for v in violations(graph)), violations(graph)
    else:
        assert any(v.startswith(expected) for v in violations(graph)), violations(graph)


def sizes() -> list[str]:
    """Classes, modules and functions of the package over their size."""
    over = []
    for path in sorted(PACKAGE.rglob("*.py")):
        source = path.read_text()
        where = path.relative_to(PACKAGE.parent)
        lines = source.count("\n")
        if lines > MAX_MODULE:
            over.append(f"module {where}: {lines} lines (at most {MAX_MODULE})")
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                size = node.end_lineno - node.lineno + 1
                limit = MAX_CLASS if isinstance(node, ast.ClassDef) else MAX_FUNCTION
                if size > limit:
                    kind = "class" if isinstance(node, ast.ClassDef) else "function"
                    over.append(f"{kind} {where}:{node.name}: {size} lines (at most {limit})")
    return over


def test_no_class_module_or_function_is_over_its_size():
    assert sizes() == []


def test_the_size_check_sees_a_long_function(tmp_path, monkeypatch):
    long = tmp_path / "kvstore_lazy" / "long.py"
    long.parent.mkdir()
    long.write_text("def f():\n" + "    x = 1\n" * 70)
    monkeypatch.setattr(__import__(__name__), "PACKAGE", long.parent)
    assert sizes() == ["function kvstore_lazy/long.py:f: 71 lines (at most 60)"]
