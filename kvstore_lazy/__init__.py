"""kvstore-lazy: a drop-in Python parameter server for MXNet 1.9.1 with lazily materialized row_sparse rows.

The public API is what ``__all__`` lists, importable from here (``from kvstore_lazy import init_lazy``) and kept so
by tests/test_public_api.py: a move inside the package cannot break a user's import silently.

- In a training process (imports mxnet on first use): the worker API of :mod:`kvstore_lazy.worker`: ``init_lazy``,
  ``declare``, ``declared``, ``track``, ``key_id``, ``lazy_spec_body``, ``fetch_rows``, ``fetch_states``,
  ``restore_states``, ``save_rows``, ``save_ndarrays``, ``stats``, ``snapshot``, ``register_virtual_keys``.
- Checkpoint tools (numpy only): ``densify`` (a stock file with the absent rows computed), ``inspect`` (what a
  checkpoint or a snapshot directory holds), ``lazy_params`` (a checkpoint's sidecar).
- Operations: ``launch`` (the launcher: ``kvstore_lazy.launch.main(["-n", "2", "-s", "2", "python", "train.py"])``),
  ``cli`` (``kvstore-lazy <command>``: ``kvstore_lazy.cli.main([...])``).

Rooms, by who runs them (imports only point down; tests/test_layers.py keeps it so):
``protocol`` (sans-IO codec) and ``store`` (row tables, the disk tier) import nothing of the project above them;
``numerics`` (initializers, optimizers, compression) are pure numpy; ``server`` (request semantics) uses those but
no zmq; ``persist`` writes and reads every file; ``transport`` is the only zmq code; ``node`` is the server process
that wires transport and server together; ``worker`` runs in the training process (the only code that imports
mxnet); ``launch`` starts whole jobs; ``config`` reads every variable, ``paths`` names every file.
"""
from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# public name -> (module, attribute); imported on first use, so a server never imports mxnet through this module
_EXPORTS = {name: ("kvstore_lazy.worker", name) for name in (
    "init_lazy", "declare", "declared", "track", "key_id", "lazy_spec_body", "fetch_rows", "fetch_states",
    "restore_states", "save_rows", "save_ndarrays", "stats", "snapshot", "register_virtual_keys")}
_EXPORTS.update({
    "densify": ("kvstore_lazy.persist.densify", "densify"),
    "inspect": ("kvstore_lazy.persist.densify", "inspect"),
    "lazy_params": ("kvstore_lazy.persist.sidecar", "lazy_params"),
})
_MODULES = {"launch": "kvstore_lazy.launch", "cli": "kvstore_lazy.cli"}   # subpackages: the module is the name

__all__ = ["__version__", "init_lazy", "declare", "declared", "track", "key_id", "lazy_spec_body", "fetch_rows",
           "fetch_states", "restore_states", "save_rows", "save_ndarrays", "stats", "snapshot",
           "register_virtual_keys", "densify", "inspect", "lazy_params", "launch", "cli"]


def __getattr__(name: str) -> Any:
    if name in _MODULES:
        return importlib.import_module(_MODULES[name])
    try:
        module, attribute = _EXPORTS[name]
    except KeyError:
        raise AttributeError(f"module 'kvstore_lazy' has no attribute {name!r}") from None
    return getattr(importlib.import_module(module), attribute)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS) | set(_MODULES))
