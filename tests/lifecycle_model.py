"""A reference model of the row lifecycle policies, written from the README / server.lifecycle docstring, not
from the server's code: plain dicts and Python ints, one id at a time. Tests feed it the ids each round pushed
(merged over workers) and the ids pulls touched, and compare the rows it predicts with the rows a server holds.

Budget accounting is the documented formula: rows x bytes of a row (weights and optimizer states of row_size
float32s, the columns last/count (4 + 4 bytes) and stamp (8, with ttl_seconds), the change flag (1, when the server
writes snapshots), the row id (8)) plus the hash index's buckets x 4 bytes (2048 buckets while a table never held
more than 1024 rows), plus the pending-admission table with the same formula (count 4, last 4, flag, id).
"""
from __future__ import annotations

MASK = (1 << 64) - 1
GAMMA = 0x9E3779B97F4A7C15
ADMIT_SALT = 0x61646D6974


def mix64(z: int) -> int:
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return z ^ (z >> 31)


def absorb(h: int, v: int) -> int:
    return mix64(((h ^ v) + GAMMA) & MASK)


def coin(seed: int, key: int, row: int, count: int) -> float:
    """u for the count-th pushed round of `row`: (mix64(state(seed ^ salt, key, row) + count * GAMMA) >> 11) / 2**53."""
    state = absorb(absorb(absorb(0, (seed ^ ADMIT_SALT) & MASK), key & MASK), row)
    return (mix64((state + count * GAMMA) & MASK) >> 11) / 2.0 ** 53


def buckets_for(peak_rows: int) -> int:
    """Buckets of a table created for 1024 rows that has held at most `peak_rows` (grown at load 0.5)."""
    buckets = 2048
    while peak_rows > buckets // 2:
        buckets *= 2
    return buckets


class KeyModel:
    def __init__(self, key: int, seed: int, min_count: int = 1, prob: float = 1.0, ttl_rounds: int = 0,
                 row_size: int = 4, num_states: int = 1, tracked: bool = False, budget_managed: bool = False):
        self.key, self.seed = key, seed
        self.min_count, self.prob, self.ttl = min_count, prob, ttl_rounds
        self.row_size, self.num_states, self.tracked = row_size, num_states, tracked
        self.rows: dict[int, dict] = {}       # id -> {"last": round, "count": rounds pushed}
        self.pending: dict[int, dict] = {}    # id -> {"count", "last"}
        self.round = 0
        self.peak = self.pending_peak = 0
        self.dropped = self.admitted = self.evicted = 0
        self.active = min_count > 1 or prob < 1 or ttl_rounds > 0 or budget_managed

    @property
    def admits_at_once(self) -> bool:
        return self.min_count == 1 and self.prob >= 1

    def pull(self, ids, touch: bool = True) -> None:
        """A pull: with touch materialization and no admission, missing rows are created."""
        if touch and self.admits_at_once:
            for i in ids:
                if i not in self.rows:
                    self.rows[i] = {"last": self.round, "count": 0}
            self.peak = max(self.peak, len(self.rows))

    def push_round(self, ids) -> None:
        """One round (dist_sync) of merged pushes: `ids` are the distinct ids any worker pushed."""
        self.round += 1
        self._count(ids)

    def push_async_round(self, pushes) -> None:
        """One round in dist_async: NUM_WORKER pushes (lists of ids), each counted on its own."""
        self.round += 1
        for ids in pushes:
            self._count(ids)

    def _count(self, ids) -> None:
        ids = sorted(set(ids))
        if not self.admits_at_once:     # every id without a row is counted in the pending table first
            fresh = sum(1 for i in ids if i not in self.rows and i not in self.pending)
            self.pending_peak = max(self.pending_peak, len(self.pending) + fresh)
        for i in ids:
            if i in self.rows:
                self.rows[i]["last"] = self.round
                self.rows[i]["count"] += 1
                continue
            p = self.pending.setdefault(i, {"count": 0, "last": 0})
            p["count"] += 1
            p["last"] = self.round
            admitted = self.prob >= 1 or coin(self.seed, self.key, i, p["count"]) < self.prob
            if p["count"] >= self.min_count and admitted:
                self.rows[i] = {"last": self.round, "count": p["count"]}
                del self.pending[i]
                self.admitted += not self.admits_at_once     # counted only where an admission policy decides
            else:
                self.dropped += 1
        if self.admits_at_once:
            self.pending.clear()
        self.peak = max(self.peak, len(self.rows))

    def sweep(self) -> None:
        """The TTL sweep at the end of a round."""
        if self.ttl and self.round % max(1, self.ttl // 8) == 0:
            for i in [i for i, r in self.rows.items() if r["last"] <= self.round - self.ttl]:
                del self.rows[i]
                self.evicted += 1

    def row_nbytes(self) -> int:
        columns = 8 if self.active else 0
        return self.row_size * 4 * (1 + self.num_states) + columns + (1 if self.tracked else 0) + 8

    def nbytes(self) -> int:
        out = len(self.rows) * self.row_nbytes() + 4 * buckets_for(self.peak)
        if not self.admits_at_once:
            out += len(self.pending) * (4 + 4 + (1 if self.tracked else 0) + 8) + 4 * buckets_for(self.pending_peak)
        return out

    def lru_order(self):
        """Rows in eviction order for LRU: older last push first, then smaller id."""
        return sorted(self.rows, key=lambda i: (self.rows[i]["last"] - self.round, i))


class ServerModel:
    """Several keys of one server in dist_sync, with the memory budget (LRU) across them."""

    def __init__(self, keys: list[KeyModel], budget: int = 0, low: float = 0.9):
        self.keys = {k.key: k for k in keys}
        self.budget, self.low = budget, low

    def end_round(self, key: int) -> None:
        self.keys[key].sweep()
        if self.budget:
            self.enforce()

    def accounted(self) -> int:
        return sum(k.nbytes() for k in self.keys.values())

    def enforce(self) -> None:
        total = self.accounted()
        if total <= self.budget:
            return
        excess = total - int(self.budget * self.low)
        order = sorted(((k.rows[i]["last"] - k.round, k.key, i) for k in self.keys.values() for i in k.rows))
        freed = 0
        for _, key, i in order:
            if freed >= excess:
                break
            model = self.keys[key]
            del model.rows[i]
            model.evicted += 1
            freed += model.row_nbytes()
