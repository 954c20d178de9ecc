"""The dependency direction of the package, read from the source (every import, at any depth of the file).

protocol and store import nothing of the project; initializers, optimizers and compression only the store's
kernels (initializers and optimizers also the compiled fast path, kvstore_lazy.protocol.fast); checkpoint only
ndfile (MXNet's NDArray files, numpy only), initializers (to rebuild absent rows) and the store's fsync_path;
server imports protocol/store/initializers/optimizers/compression but no zmq, no transport or membership;
only the runtime wires transport, membership and server together; only worker and integration import mxnet.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "kvstore_lazy"

# module prefix -> project modules it may import (prefixes)
ALLOWED = {
    "kvstore_lazy.protocol": {"kvstore_lazy.protocol"},
    "kvstore_lazy.store": {"kvstore_lazy.store"},
    # and the compiled fast path's loader (a leaf: _fast.c imports nothing), for its uniform values
    "kvstore_lazy.numerics.initializers": {"kvstore_lazy.store", "kvstore_lazy.protocol.fast"},
    "kvstore_lazy.numerics.compression": set(),
    "kvstore_lazy.numerics.optimizers": {"kvstore_lazy.store", "kvstore_lazy.protocol.fast"},   # small dense updates
    "kvstore_lazy.server": {"kvstore_lazy.server", "kvstore_lazy.protocol", "kvstore_lazy.store",
                            "kvstore_lazy.numerics.initializers", "kvstore_lazy.numerics.optimizers",
                            "kvstore_lazy.numerics.compression",
                            "kvstore_lazy.cli"},   # server/__main__.py runs the command line
    "kvstore_lazy.transport": {"kvstore_lazy.protocol"},
    "kvstore_lazy.node.membership": {"kvstore_lazy.protocol"},
    "kvstore_lazy.persist.journal": {"kvstore_lazy.protocol", "kvstore_lazy.persist.checkpoint"},
    # sidecars and densify; the store's fsync_path
    "kvstore_lazy.persist.checkpoint": {"kvstore_lazy.persist.ndfile", "kvstore_lazy.numerics.initializers",
                                        "kvstore_lazy.store"},
    "kvstore_lazy.persist.ndfile": set(),
    "kvstore_lazy.node.promexport": {"kvstore_lazy.protocol"},   # fed by the runtime; reads no server internals
    "kvstore_lazy.node.placement": set(),
}
ONLY = {   # third-party module -> the only project modules that may import it
    "zmq": {"kvstore_lazy.transport"},
    "mxnet": {"kvstore_lazy.worker", "kvstore_lazy.worker.integration"},
}
WIRING = {"kvstore_lazy.transport", "kvstore_lazy.node.membership", "kvstore_lazy.server"}


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


def violations(graph: dict[str, set[str]]) -> list[str]:
    bad = []
    for module, imported in graph.items():
        project = {i for i in imported if _within(i, ["kvstore_lazy"]) and i in graph}
        for prefix, allowed in ALLOWED.items():
            if _within(module, [prefix]):
                bad += [f"{module} imports {i}" for i in sorted(project) if not _within(i, allowed | {prefix})]
        for third, owners in ONLY.items():
            if any(_within(i, [third]) for i in imported) and not _within(module, owners):
                bad.append(f"{module} imports {third}")
        wired = {p for p in WIRING if any(_within(i, [p]) for i in project)}
        if len(wired) > 1 and module != "kvstore_lazy.node.runtime" and not _within(module, WIRING):
            bad.append(f"{module} wires {sorted(wired)} (only kvstore_lazy.node.runtime does)")
    return bad


def test_the_package_keeps_its_dependency_direction():
    graph = package_imports()
    assert "kvstore_lazy.server.core" in graph and "kvstore_lazy.node.runtime" in graph
    assert violations(graph) == []


@pytest.mark.parametrize("module, source, expected", [
    ("kvstore_lazy.server.core", "def f():\n    import zmq\n", "kvstore_lazy.server.core imports zmq"),
    ("kvstore_lazy.protocol.kv", "from ..server import core\n", "kvstore_lazy.protocol.kv imports kvstore_lazy.server"),
    ("kvstore_lazy.server.keys", "from ..node import membership\n",
     "kvstore_lazy.server.keys imports kvstore_lazy.node.membership"),
    ("kvstore_lazy.store.rows", "import mxnet as mx\n", "kvstore_lazy.store.rows imports mxnet"),
    ("kvstore_lazy.cli", "from .transport import zmq_van\nfrom .server import core\n", "kvstore_lazy.cli wires"),
])
def test_a_wrong_import_is_found(module, source, expected):
    graph = package_imports()
    graph[module] = imports_of(source, module)
    assert any(v.startswith(expected) for v in violations(graph)), violations(graph)
