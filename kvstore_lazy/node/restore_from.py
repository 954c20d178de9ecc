"""A fresh job's servers started from another job's snapshots, whatever its server count
(KVSTORE_LAZY_RESTORE_FROM), and the new job's declarations checked against what was restored.

Owns: loading this server's part of that directory (``persist.reshard``
re-cuts it for this job's server count, ``persist.ranged`` reads only the rows of this server's ranges) as a
``Loaded`` snapshot that ``durability`` restores like its own, and
:class:`DeclarationCheck`: a lazy declaration of the new job (LAZY_DECLARE) for a key the snapshot restored must
declare it as the snapshot has it (shape, dtype, initializer, seed): the rows restored and the rows computed for
ids never stored must come from one declaration, so another one ends the server (status 2) with one line naming
the key and both values, instead of a model silently made of two.
Does not own: when a server restores (``durability.load_snapshot``: its own snapshot directory first, this only if
that has nothing), the re-cut itself (``persist.reshard``), the resume gate (``server.resume``).
The directory is ``Config.restore_from`` (KVSTORE_LAZY_RESTORE_FROM, read with every other setting).
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

from kvstore_lazy.node.errors import StartupError
from kvstore_lazy.persist import ranged, reshard, snapshots
from kvstore_lazy.protocol import mxnet as mx
from kvstore_lazy.protocol.message import Message

log = logging.getLogger("kvstore_lazy")

ENV = "KVSTORE_LAZY_RESTORE_FROM"   # named in messages
CHECKED = ("rows", "row_shape", "dtype", "init", "seed")    # what a declaration must keep


def load(directory: str, rank: int, num_servers: int) -> snapshots.Loaded:
    """This server's part of the snapshot directory `directory` (any server count), or StartupError naming the
    file that is missing, damaged or of an unknown format."""
    if not Path(directory).is_dir():
        raise StartupError(f"{ENV}={directory}: not a directory (the snapshot directory to restore from)")
    counter = ranged.Counter()
    try:
        loaded = reshard.restore_for(directory, rank, num_servers, counter=counter)
    except snapshots.SnapshotError as exc:
        raise StartupError(f"{ENV}={directory}: {exc}") from None
    rows = sum(len(t["row_ids"]) for t in loaded.tables.values() if t["meta"]["kind"] == "row_sparse")
    log.info("%s=%s: rank %d of %d restores %d keys, %d rows (%d bytes of key files read: %d of rows, %d of ids "
             "and headers)", ENV, directory, rank, num_servers, len(loaded.tables), rows, counter.total,
             counter.rows, counter.ids)
    return loaded


class DeclarationCheck:
    """The declarations a server restored (key -> LazySpec JSON), against the new job's LAZY_DECLAREs."""

    def __init__(self, specs: dict[int, dict], where: str) -> None:
        self.specs = {int(k): {f: v.get(f) for f in CHECKED} for k, v in specs.items()}
        self.where = where

    def check(self, msg: Message) -> None:
        """StartupError if `msg` declares a restored key otherwise than the snapshot did."""
        if not (msg.meta.simple_app and msg.meta.head == mx.LAZY_DECLARE and self.specs):
            return
        try:
            body = json.loads(bytes(msg.meta.body))
            key = int(body["key"])
        except (ValueError, KeyError, TypeError):
            return                               # not a declaration: the server refuses it as usual
        known = self.specs.get(key)
        if known is None:
            return
        new = {f: body.get(f) for f in CHECKED}
        differ = [f for f in CHECKED if _norm(f, new[f]) != _norm(f, known[f])]
        if differ:
            both = "; ".join(f"{f} {new[f]!r} (restored: {known[f]!r})" for f in differ)
            raise StartupError(f"key {key} is declared by this job with {both}: the snapshot restored from "
                               f"{self.where} has it otherwise; refusing to mix two declarations in one model "
                               f"(declare it as before, or start without the snapshot)")


def _norm(name: str, value):
    if name == "dtype" and value is None:
        return "float32"
    if name == "seed" and value is None:
        return 0
    return value
