"""The keys a server stores, one object each: a dense tensor or a table of rows, with its own sync round.

Owns: each key's stored values, float32 master copy, optimizer states and pending dist_sync round; how a round
merges pushes; how an update is applied; what a pull of the key returns; the key's snapshot and stats. Nothing
outside a key reads its fields: :class:`~kvstore_lazy.server.core.KVServer` and the state transfer go through the
methods here.
Does not own: the wire (requests arrive decoded as ``protocol.kv.DataRequest``), which key a request is for, the
optimizer (passed in), dist_sync vs dist_async (the server decides whether a push joins a round).

Names: ``local_ids`` are row ids as a worker sent them (relative to this server's first row of a partitioned key),
``row_ids`` global row ids (``local_ids + row_offset``, what the row table and the initializers use), ``slots``
arena indexes of the row table.

Behaviour follows MXNet 1.9.1's kvstore_dist_server.h: the first push is the init (stored as sent); a round's merged
gradient goes through the updater once (or, with no optimizer, replaces the stored value); under multi-precision the
stored value is a float32 master copy and pulls get it cast back (CreateMultiPrecisionCopies).

The units: :mod:`.sync_round` (a key's dist_sync round), :mod:`.dense` (:class:`DenseKey`), and the row_sparse key
one concern a module, each class built on the one before it and using only what is below it:
:mod:`.row_fields` (its fields, ids, checks and stats) -> :mod:`.row_disk` (its disk tier and lifecycle upkeep:
expiry, eviction, the budget's accounting) -> :mod:`.row_states` (its rows and optimizer states: how rows come into
the table, layout changes, state rows for worker checkpoints) -> :mod:`.row_snapshot` (snapshot, delta, inspect,
restore) -> :mod:`.row_sparse` (:class:`RowSparseKey`: the init, push, apply, pull). One object per key holds all of
its state (the layers are one class's parts, not objects of their own: no indirection in the per-request paths).
"""
from kvstore_lazy.server.keys.dense import DenseKey
from kvstore_lazy.server.keys.row_sparse import RowSparseKey
from kvstore_lazy.server.keys.sync_round import SyncRound

__all__ = ["DenseKey", "RowSparseKey", "SyncRound"]
