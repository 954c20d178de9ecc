"""The compiled fast path (``_fast.c``, a CPython extension module built by setup.py), loaded and checked once.

Owns: finding ``_fast.so`` and refusing one built from another ``_fast.c`` (the module returns the SHA-256 of its
source, compared with the file beside it when that is there, as ``store/kernels.py`` does for the kernels).
Does not own: what the functions compute; each is documented in ``_fast.c`` beside the Python code it must agree
with (``pbmeta``'s reference codec, ``kv``'s checks, ``store.rows``' RowIndex, ``store.kernels``' wrappers,
``initializers``, ``optimizers``' float parser), and returns None (False) for whatever it does not take, so the
Python paths stay the definition.
"""
from __future__ import annotations

import hashlib
from pathlib import Path
from types import ModuleType

SOURCE = Path(__file__).with_name("_fast.c")
REBUILD = "`pip install .` builds it (in a source checkout: `make venv`, or `pip install -e .`)"


class FastLoadError(ImportError):
    """The compiled fast path is missing, cannot be imported, or was built from another _fast.c."""


def load() -> ModuleType:
    try:
        from kvstore_lazy.protocol import _fast
    except ImportError as exc:
        raise FastLoadError(f"kvstore_lazy's compiled fast path (kvstore_lazy/protocol/_fast.so) cannot be imported "
                            f"({exc}): {REBUILD}") from None
    if SOURCE.exists():
        want = hashlib.sha256(SOURCE.read_bytes()).hexdigest()
        if _fast.digest() != want:
            raise FastLoadError(f"{_fast.__file__} was built from another {SOURCE.name} (sha256 "
                                f"{_fast.digest()[:12]}..., the source beside it is {want[:12]}...): rebuild it; "
                                f"{REBUILD}")
    return _fast


native = load()
