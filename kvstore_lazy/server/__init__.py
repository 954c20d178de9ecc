"""The parameter server: request semantics in :mod:`.core` (sans-IO); ``python -m kvstore_lazy.server`` runs one."""
from kvstore_lazy.server.core import KVServer

__all__ = ["KVServer"]
