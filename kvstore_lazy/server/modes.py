"""The server-wide modes a request's semantics depend on, named once for every module of the server room.

Owns: the names of the materialize modes (``KVSTORE_LAZY_MATERIALIZE``, ``--materialize``): when an absent row of a
lazy key gets stored. Both :mod:`~kvstore_lazy.server.core` (which checks and keeps the mode) and
:mod:`~kvstore_lazy.server.fastpath` (which answers pulls the same way) read them from here, so neither imports
the other for a constant.
Does not own: which mode a server runs in (the runtime's config decides; ``KVServer.materialize`` holds it).
"""
from __future__ import annotations

MATERIALIZE_ON_TOUCH = "touch"   # first pull or push creates the row
MATERIALIZE_ON_PUSH = "push"     # pulls of absent rows get computed initial values, only pushes store rows
