"""The compiled fast path (``_fast.c`` and the units it lists, one CPython extension module built by setup.py),
loaded and checked once.

Owns: finding ``_fast.so`` and refusing one built from other sources than the ones beside it (the module returns
the SHA-256 of all its sources, :func:`sources_digest`, compared with the files beside it when they are there, as
``store/kernels.py`` does for the kernels; a change to any one unit or header refuses an older build). The same
check serves the transport's compiled module (``transport/zmq_van.py``: :func:`refuse_stale`).
Does not own: what the functions compute; each is documented in its unit beside the Python code it must agree with
(``pbmeta``'s reference codec, ``kv``'s checks, ``store.rows``' RowIndex, ``store.kernels``' wrappers,
``initializers``, ``optimizers``' float parser), and returns None (False) for whatever it does not take, so the
Python paths stay the definition. No socket: ZeroMQ's calls are the transport's (``transport/_zmqmsg.c``).
"""
from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from pathlib import Path
from types import ModuleType

SOURCE = Path(__file__).with_name("_fast.c")     # the module's first unit (it lists the others)
# every source of the module, as setup.py names them: the digest the module records is theirs
SOURCES = tuple(SOURCE.with_name(name) for name in (
    "_fast.c", "_fast.h", "_fast_pbmeta.c", "_fast_checks.c", "_fast_rows.c", "_fast_uniform.h", "_fast_uniform.c",
    "_fast_updates.c", "_fast_float.c"))
REBUILD = "`pip install .` builds it (in a source checkout: `make venv`, or `pip install -e .`)"


class FastLoadError(ImportError):
    """The compiled fast path is missing, cannot be imported, or was built from another _fast.c (or unit of it)."""


def sources_digest(sources: Iterable[Path]) -> str:
    """setup.py's digest of a compiled module's sources: SHA-256 over the files in the order of their names, each as
    its name, a NUL, its length in decimal, a NUL and its bytes."""
    digest = hashlib.sha256()
    for path in sorted(sources, key=lambda p: p.name):
        data = path.read_bytes()
        digest.update(b"%s\0%d\0" % (path.name.encode(), len(data)) + data)
    return digest.hexdigest()


def refuse_stale(module: ModuleType, sources: Sequence[Path], error: type[ImportError]) -> None:
    """Raise ``error`` unless ``module.digest()`` is the digest of ``sources`` (checked when they are beside it: they
    are installed with the package, and are there in a source checkout; one missing of several is a mismatch)."""
    present = [path for path in sources if path.exists()]
    if not present:
        return
    built, want = module.digest(), sources_digest(present)
    if built != want or len(present) < len(sources):
        raise error(f"{module.__file__} was built from another {sources[0].name} or another of its units "
                    f"({', '.join(path.name for path in sources)}: sha256 {built[:12]}..., the sources beside it "
                    f"are {want[:12]}...): rebuild it; {REBUILD}")


def load() -> ModuleType:
    try:
        from kvstore_lazy.protocol import _fast
    except ImportError as exc:
        raise FastLoadError(f"kvstore_lazy's compiled fast path (kvstore_lazy/protocol/_fast.so) cannot be imported "
                            f"({exc}): {REBUILD}") from None
    refuse_stale(_fast, SOURCES, FastLoadError)
    return _fast


native = load()
