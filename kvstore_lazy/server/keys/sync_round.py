"""One key's dist_sync round (kvstore_dist_server.h's merge buffer and its list of waiting requests).

Owns: the pushes of a round that is not complete yet, and when it is complete. A key merges its round one of two
ways, the key's ``merge`` says which by what it takes: push by push as they arrive (``merge(merged, grad, count)``:
dense keys, into one reused buffer), or once when the round completes (``merge(pushes)``: row_sparse keys, whose
gradients are ``(ids, values)`` pairs; the round keeps them, arrays the requests hold anyway, and the key merges
them all in one pass, instead of re-merging the growing union of rows at every push: O(rows pushed) a round, not
O(N x rows)). Both give the same bits: each row summed in arrival order.
Does not own: how a key merges (the key passes its ``merge``), how many requests a round takes (the server's
NUM_WORKER), what happens to the merged gradient (the server applies it through the key).
A row_sparse push may come with its rows' slots in the key's table (server/fastpath.py: what the worker's pull of
those rows found); the round keeps them beside the push and the key's ``merge_slots`` gives the merged rows' slots
in the same pass, handed to the update with the merged gradient.
"""
from __future__ import annotations

from typing import Any, Callable

from kvstore_lazy.protocol.kv import DataRequest


class SyncRound:
    """One key's dist_sync round: pushes merged until NUM_WORKER *requests* (not distinct workers) arrived."""

    def __init__(self) -> None:
        self.requests: list[DataRequest] = []
        self.pushes: list[tuple[Any, Any]] = []   # a row_sparse round's gradients, merged when it completes
        self.slots: list[Any] = []                # their rows' slots, if known (else None), beside them
        self._folded: Any = None                  # a dense round's sum so far
        self._merge: Callable | None = None
        self._merge_slots: Callable | None = None

    @property
    def pending(self) -> bool:
        return bool(self.requests)

    @property
    def merged(self) -> Any:
        """The round's pushes so far merged (None before the first): what the round would apply if it ended now.
        A row_sparse round merges its pushes here (snapshots' checks and tests read it mid-round; the round itself
        merges once, when it completes)."""
        if self.pushes:
            assert self._merge is not None
            return self._merge(self.pushes)
        return self._folded

    def add(self, request: DataRequest, grad, merge: Callable, num_workers: int, slots=None,
            merge_slots: Callable | None = None):
        """Take one push; the round's (merged gradient, requests, merged rows' slots or None) once it is complete,
        else None. A row_sparse gradient (a tuple ``(ids, values)``) is kept and merged with the round's others by
        ``merge(pushes)`` when the round completes, or by ``merge_slots(pushes, slots)`` if a push of the round came
        with its rows' `slots`; any other is merged at once by ``merge(merged, grad, count)``."""
        if isinstance(grad, tuple):
            self.pushes.append(grad)
            self.slots.append(slots)
            if slots is not None:
                self._merge_slots = merge_slots
        else:
            self._folded = merge(self._folded, grad, len(self.requests))
        self._merge = merge
        if len(self.requests) + 1 < num_workers:
            self.requests.append(request)
            return None
        try:
            if self._merge_slots is not None and self.pushes:
                merged, slots = self._merge_slots(self.pushes, self.slots)
            else:
                merged, slots = self.merged, None
        except BaseException:
            if isinstance(grad, tuple):
                self.pushes.pop()           # the round as it was before this push
                self.slots.pop()
            raise
        done = merged, self.requests + [request], slots
        self.requests, self.pushes, self.slots, self._folded = [], [], [], None
        self._merge = self._merge_slots = None
        return done

    def describe(self) -> list:
        """The waiting requests as (sender, timestamp): for snapshots' checks and tests."""
        return [(r.sender, r.meta.timestamp) for r in self.requests]
