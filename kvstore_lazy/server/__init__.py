"""The parameter server: request semantics in :mod:`.core` (sans-IO); ``python -m kvstore_lazy.server`` runs one."""
from .core import KVServer

__all__ = ["KVServer"]
