"""One key's dist_sync round (kvstore_dist_server.h's merge buffer and its list of waiting requests).

Owns: the pushes of a round that is not complete yet, merged by the key's own ``merge``, and when it is complete.
Does not own: how a key merges (the key passes its ``merge``), how many requests a round takes (the server's
NUM_WORKER), what happens to the merged gradient (the server applies it through the key).
"""
from __future__ import annotations

from typing import Callable

from kvstore_lazy.protocol.kv import DataRequest


class SyncRound:
    """One key's dist_sync round: pushes merged until NUM_WORKER *requests* (not distinct workers) arrived."""

    def __init__(self) -> None:
        self.requests: list[DataRequest] = []
        self.merged = None

    @property
    def pending(self) -> bool:
        return bool(self.requests)

    def add(self, request: DataRequest, grad, merge: Callable, num_workers: int):
        """Merge one push; the round's (merged gradient, requests) once it is complete, else None."""
        self.merged = merge(self.merged, grad, len(self.requests))
        self.requests.append(request)
        if len(self.requests) < num_workers:
            return None
        done = self.merged, self.requests
        self.requests, self.merged = [], None
        return done

    def describe(self) -> list:
        """The waiting requests as (sender, timestamp): for snapshots' checks and tests."""
        return [(r.sender, r.meta.timestamp) for r in self.requests]
