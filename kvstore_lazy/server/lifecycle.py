"""Row lifecycle: which ids get a row (admission), which rows leave (age, a memory budget). Reproducibly.

Owns: what the policies do and when (this docstring is their reference), each key's policy state
(:class:`RowPolicy`: its round clock, the counts of ids waiting for admission, its stats counters) and the server's
memory budget (:class:`Lifecycle`: the accounting and the choice of rows to evict across keys). The policy of one
lazy key (:class:`Policy`: from its declaration, ``init_lazy(..., admit_min_count=...)``, else the server-wide
defaults) and the server-wide settings read from the environment (:class:`Settings`) are plain checked values,
defined in :mod:`~kvstore_lazy.server.policy` and named here too.
Does not own rows: :class:`~kvstore_lazy.server.keys.RowSparseKey` keeps its table and consults its RowPolicy
where a row enters (a push merged into a round, a pull) and where rows leave (``expire``, ``evict``).

Policies (per key, all off by default: a key without one behaves exactly as before):

- ``admit_min_count`` N: an id gets a row once it was pushed in N rounds (dist_sync) or N pushes (dist_async);
- ``admit_prob`` p: at each such round an id without a row is admitted if ``coin(seed, key, row id, count) < p``;
- ``ttl_rounds`` T: a row not pushed in the last T rounds of its key is removed; ``ttl_seconds`` S: not pushed for
  S seconds of the server clock;
- a server-wide ``memory_budget`` (bytes) with ``evict`` lru|lfu: when the accounted bytes of all row tables pass
  its ``row_budget`` (the budget less the share it keeps for the buffers of snapshots, fetches, passes and merges:
  ``Settings.reserve``), the lowest-scoring rows of every lazy key go until ``low_watermark`` x that is left.

Until an id is admitted a pull answers its deterministic initial value without storing it (as
``KVSTORE_LAZY_MATERIALIZE=push``) and a push is counted and its gradient rows dropped (``dropped`` in the stats). In
dist_sync admission is decided on the round's merged gradient, so every worker's rows of a round are applied or
dropped together and an id counts once per round however many workers pushed it. The push that admits a row is
applied to it. An evicted row that comes back is a new row: initial value, fresh optimizer state, counts from zero.

Determinism. Every decision is a pure function of the requests in the order the server handled them plus the
snapshot it started from, so journal replay after a crash repeats it exactly:

- a key's clock is its *round*: dist_sync, the rounds completed for the key; dist_async, one round per NUM_WORKER
  pushes of the key (pushes 1..W are round 1, ...). Rows are stamped with the round of their last push (a row a
  pull created, with the rounds completed then);
- removals happen only at *eviction points*: the end of a key's round (dist_sync: its merged update; dist_async:
  every NUM_WORKER-th push), never in the middle of one. A TTL sweep of a key runs at the rounds that are multiples
  of ``max(1, ttl_rounds // 8)`` (so a row lives between T and T + T//8 rounds unpushed) and removes the rows whose
  last push round is ``<= round - ttl_rounds``; with ``ttl_seconds`` at the first point after the clock moved by S/8
  since the last sweep, removing rows whose last push time is ``<= clock - S``. Then the budget is checked;
- ``clock`` (seconds, for ``ttl_seconds``) changes only through :meth:`Lifecycle.set_clock`, which the runtime calls
  once a second and writes to the journal like a request, so a replay sees the same times at the same places;
- the budget's accounting is :meth:`RowTable.nbytes` (rows x bytes of a row in every arena, plus the index: exact, a
  function of the history, the same after a snapshot reload) plus the pending-admission tables, never RSS;
- eviction order is by score, then key, then row id: never by slot (slots depend on history and on reloads). LRU
  score: the row's last push round minus its key's round (older first). LFU: rounds with a push (fewer first), then
  LRU among equals;
- the admission coin is ``u < p`` with ``u = (mix64(state(seed ^ ADMIT_SALT, key, row) + count * GAMMA) >> 11) / 2**53``
  (``state``, ``mix64``, ``GAMMA`` as in :mod:`kvstore_lazy.numerics.initializers`; ``count`` = 1 at the first pushed
  round):
  a function of the row, not of the server count or the order of workers.

So count, probability and TTL in rounds give the same rows on any number of servers (a partitioned key's rounds are
the same on every server: every worker pushes every server each step). The budget is per server.

Bounded memory for unbounded id streams: the ids waiting for admission of a key are counted exactly in a row table
of their own (id, count, last round counted: 8 + 4 + 4 bytes, a change flag with snapshots, plus 4 to 8 of index;
30 bytes an id measured), capped at ``admit_cap`` ids (``KVSTORE_LAZY_ADMIT_CAP``, default 2**20 per key: about
32 MiB at most). Over the cap, at the end of a round, the ids
counted longest ago (then the smallest ids) are forgotten until 90% of the cap is left (``forgotten`` in the stats):
counting is exact within that window, no id is ever admitted by mistake (unlike a sketch, no false admissions), and
an id seen again after it was forgotten starts over.
"""
from __future__ import annotations

from typing import Any

import logging

import numpy as np

from kvstore_lazy.numerics.initializers import GAMMA, row_states
from kvstore_lazy.server.policy import Policy, Settings, parse_bytes
from kvstore_lazy.store import kernels
from kvstore_lazy.store.rows import RowTable

log = logging.getLogger("kvstore_lazy.server")

# Policy, Settings and parse_bytes live in server.policy; they are named here too, where the rest of the project
# (the runtime, the benchmarks, tests) imports them from
__all__ = ["Lifecycle", "Policy", "RowPolicy", "Settings", "admission_coin", "kth_smallest", "parse_bytes"]

ADMIT_SALT = 0x61646D6974       # "admit": the admission coin's stream is not the initializer's
CAP_LOW = 0.9                   # pending ids over the cap are forgotten down to this share of it
TTL_SWEEPS = 8                  # sweeps per TTL: a row lives at most ttl + ttl / TTL_SWEEPS unpushed
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def admission_coin(seed: int, key: int, row_ids: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """``u`` in [0, 1) for each (row id, count): see the module docstring."""
    z = row_states((int(seed) ^ ADMIT_SALT) & ((1 << 64) - 1), key, row_ids)
    z += np.asarray(counts, np.uint64) * np.uint64(GAMMA)
    for shift, mult in ((np.uint64(30), _M1), (np.uint64(27), _M2)):
        z ^= z >> shift
        z *= mult
    z ^= z >> np.uint64(31)
    return (z >> np.uint64(11)) * 2.0 ** -53


COUNTERS = ("admitted", "dropped", "evicted_ttl", "evicted_budget", "forgotten")


class RowPolicy:
    """One lazy key's lifecycle state: its round clock, the ids waiting for admission, counters for the stats.

    The key calls, in this order per update: :meth:`begin` (the clock moves), :meth:`admit` (which pushed rows may
    have a row), then, once the rows exist and are updated, :meth:`pushed`; :meth:`created` for rows a pull or a
    state transfer made. At an eviction point (:attr:`point`) the key asks :meth:`expired` and the server's
    :class:`Lifecycle` asks :meth:`scores`.
    """

    def __init__(self, policy: Policy, lifecycle: "Lifecycle", key: int, seed: int) -> None:
        self.policy, self.lifecycle, self.key, self.seed = policy, lifecycle, key, seed
        self.round = 0               # rounds of this key so far (the clock rows are stamped with)
        self.pushes = 0              # dist_async: pushes of this key so far
        self.point = False           # the update now running ends a round: an eviction point
        self.counters = dict.fromkeys(COUNTERS, 0)
        self.swept_round, self.swept_clock = 0, 0.0
        self.pending = None if policy.admits_at_once else self._pending_table()
        self._admitted: tuple[np.ndarray, np.ndarray] | None = None   # (ids, counts) admitted by this update

    def _pending_table(self, rows: dict | None = None, buckets: int | None = None) -> RowTable:
        columns = {"last": np.int32}
        track = self.lifecycle.settings.track_changes
        if rows is None:
            return RowTable(1, np.uint32, columns=columns, track_changes=track)
        return RowTable.load(rows, columns=columns, track_changes=track, buckets=buckets)

    # -- what the key's table carries

    @property
    def columns(self) -> dict:
        """Per-row columns of the key's table: last push round, rounds pushed, and (ttl_seconds) last push time."""
        columns: dict[str, type] = {"last": np.int32, "count": np.uint32}
        if self.policy.ttl_seconds:
            columns["stamp"] = np.float64
        return columns

    @property
    def stores_on_pull(self) -> bool:
        """Whether a pull may create a row (not while rows wait for admission)."""
        return self.policy.admits_at_once

    # -- an update

    def begin(self, sync: bool) -> None:
        """A merged round (dist_sync) or one push (dist_async) is about to be applied: advance the clock."""
        if sync:
            self.round += 1
            self.point = True
        else:
            self.pushes += 1
            workers = self.lifecycle.num_workers
            self.round = (self.pushes - 1) // workers + 1
            self.point = self.pushes % workers == 0

    def admit(self, table: RowTable, row_ids: np.ndarray) -> np.ndarray | None:
        """Which of the pushed ``row_ids`` (unique) have or now get a row (a bool mask), counting the others; None
        when every id does."""
        self._admitted = None
        if self.pending is None:
            return None
        has_row = table.lookup(row_ids) >= 0
        if has_row.all():
            return None
        new_ids = row_ids[~has_row]
        slots = self.pending.ensure(new_ids, lambda ids: np.zeros((len(ids), 1), np.uint32))
        counts = self.pending.arrays()[0][slots, 0]
        counts += 1
        self.pending.arrays()[0][slots, 0] = counts
        self.pending.column("last")[slots] = self.round
        self.pending.mark_changed(slots)
        ok = counts >= self.policy.admit_min_count
        if self.policy.admit_prob < 1.0 and ok.any():
            ok[ok] = admission_coin(self.seed, self.key, new_ids[ok], counts[ok]) < self.policy.admit_prob
        if ok.any():
            self.pending.remove_slots(slots[ok])
            self._admitted = new_ids[ok], counts[ok]
            self.counters["admitted"] += int(ok.sum())
        self.counters["dropped"] += int((~ok).sum())
        self._trim_pending()
        has_row[~has_row] = ok
        return has_row

    def created(self, table: RowTable, lo: int, hi: int) -> None:
        """Rows ``lo .. hi - 1`` were just created (by a pull, a state transfer or an admitted push)."""
        table.column("last")[lo:hi] = self.round
        if self.policy.ttl_seconds:
            table.column("stamp")[lo:hi] = self.lifecycle.clock

    def pushed(self, table: RowTable, slots: np.ndarray) -> None:
        """The rows at ``slots`` were updated by this round's push."""
        table.column("last")[slots] = self.round
        count = table.column("count")
        count[slots] += np.uint32(1)
        if self._admitted is not None:      # an admitted row has been pushed in `count` rounds, this one included
            ids, counts = self._admitted
            count[table.lookup(ids)] = counts
            self._admitted = None
        if self.policy.ttl_seconds:
            table.column("stamp")[slots] = self.lifecycle.clock

    def pushed_on_disk(self, payload: np.ndarray) -> None:
        """:meth:`pushed` for rows a push updated where they are on disk: ``payload``, their records' payloads
        (the columns are its ``c_<name>`` fields), stamped in place. No admitted ids among them (they had rows)."""
        payload["c_last"] = self.round
        payload["c_count"] += np.uint32(1)
        if self.policy.ttl_seconds:
            payload["c_stamp"] = self.lifecycle.clock

    # -- eviction points

    def sweep(self) -> dict:
        """At an eviction point: the TTL cut-offs of a sweep due now (``{"last": round, "stamp": seconds}``: rows
        whose column is ``<=`` the value expire), empty when no sweep is due (see the module docstring)."""
        cuts: dict[str, Any] = {}
        ttl = self.policy.ttl_rounds
        if ttl and self.round % max(1, ttl // TTL_SWEEPS) == 0 and self.round != self.swept_round:
            self.swept_round = self.round
            cuts["last"] = self.round - ttl
        seconds, clock = self.policy.ttl_seconds, self.lifecycle.clock
        if seconds and clock - self.swept_clock >= seconds / TTL_SWEEPS:
            self.swept_clock = clock
            cuts["stamp"] = clock - seconds
        return cuts

    @staticmethod
    def dead(columns: dict, cuts: dict) -> np.ndarray:
        """Which rows (``columns``: their column arrays) a sweep with ``cuts`` removes."""
        mask = np.zeros(len(next(iter(columns.values()))), bool)
        for name, cut in cuts.items():
            mask |= columns[name] <= cut
        return mask

    def expired(self, table: RowTable, cuts: dict | None = None) -> np.ndarray:
        """Slots whose TTL ran out, at a sweep (``cuts`` from :meth:`sweep`, which is asked when not given)."""
        cuts = self.sweep() if cuts is None else cuts
        n = len(table)
        if not cuts or not n:
            return np.zeros(0, np.int64)
        return np.flatnonzero(self.dead({name: table.column(name)[:n] for name in cuts}, cuts))

    def scores(self, table: RowTable, rows=None) -> np.ndarray:
        """Eviction scores (lower goes first) of the slots `rows` (a slice or slots; every slot by default): LRU
        int32 (the last push round minus the key's round, <= 0), LFU int64 (rounds pushed, then that)."""
        rows = slice(0, len(table)) if rows is None else rows
        age = table.column("last")[rows] - np.int32(self.round)
        if self.lifecycle.settings.evict == "lru":
            return age
        return (table.column("count")[rows].astype(np.int64) << 32) + (age.astype(np.int64) + (1 << 31))

    def _trim_pending(self) -> None:
        cap = self.lifecycle.settings.admit_cap
        if len(self.pending) <= cap:
            return
        rows = self.pending.export()
        drop = len(rows["row_ids"]) - int(cap * CAP_LOW)
        order = np.lexsort((rows["row_ids"], rows["columns"]["last"]))[:drop]   # counted longest ago, then id
        self.pending.remove_slots(self.pending.lookup(rows["row_ids"][order]))
        self.counters["forgotten"] += drop

    # -- stats and snapshots

    def pending_bytes(self) -> int:
        return self.pending.nbytes() if self.pending is not None else 0

    def stats(self) -> dict:
        c = self.counters
        return {"pending": len(self.pending) if self.pending is not None else 0,
                "pending_bytes": self.pending_bytes(), "admitted": c["admitted"], "dropped": c["dropped"],
                "evicted": c["evicted_ttl"] + c["evicted_budget"], "evicted_ttl": c["evicted_ttl"],
                "evicted_budget": c["evicted_budget"], "forgotten": c["forgotten"], "round": self.round}

    def state(self) -> dict:
        """JSON-able state (the pending table's rows go separately: :meth:`pending_rows`)."""
        return {"policy": self.policy.to_json(), "round": self.round, "pushes": self.pushes,
                "counters": dict(self.counters), "swept_round": self.swept_round, "swept_clock": self.swept_clock,
                "pending_buckets": self.pending.buckets if self.pending is not None else None}

    def pending_rows(self, changes: bool = False) -> dict | None:
        if self.pending is None:
            return None
        return self.pending.changes() if changes else self.pending.export()

    def clear_changes(self) -> None:
        if self.pending is not None:
            self.pending.clear_changes()

    @classmethod
    def restore(cls, state: dict, lifecycle: "Lifecycle", key: int, seed: int,
                pending: dict | None) -> "RowPolicy":
        """Inverse of :meth:`state` + :meth:`pending_rows` (a snapshot's policy, not today's settings, rules)."""
        policy = cls(Policy().updated(Policy.check(state["policy"])), lifecycle, key, seed)
        policy.round, policy.pushes = int(state["round"]), int(state["pushes"])
        policy.counters.update({k: int(v) for k, v in state["counters"].items() if k in COUNTERS})
        policy.swept_round, policy.swept_clock = int(state["swept_round"]), float(state["swept_clock"])
        if policy.pending is not None and pending is not None:
            policy.pending = policy._pending_table(pending, state.get("pending_buckets"))
        return policy


def kth_smallest(parts: list, k: int):
    """The ``k``-th smallest (0-based) of the integer values of all ``parts`` (arrays, left as they are, or callables
    giving a part's values as consecutive chunks: :func:`score_chunks`). Scores of a narrow int32 range (LRU's
    rounds: one value per round, so a range about the rounds the rows span) through a histogram, two passes over
    them chunk by chunk (~4x faster than a partition over millions of rows, and a chunk at a time); any other
    through a partition of one copy of them all."""
    def chunks():
        return (c for p in parts for c in (p() if callable(p) else [p]) if len(c))
    low = high = None
    total, narrow = 0, True
    for c in chunks():
        lo, hi = int(c.min()), int(c.max())
        low, high = lo if low is None else min(low, lo), hi if high is None else max(high, hi)
        total, narrow = total + len(c), narrow and c.dtype == np.int32
    if low is None or high is None:
        raise ValueError("kth_smallest of no values")
    if narrow and high - low <= max(total, 1 << 16):
        counts = sum(kernels.count_values(c, low, high) for c in chunks())
        return np.int32(low + int(np.searchsorted(np.cumsum(counts), k + 1)))
    every = np.concatenate(list(chunks()))
    every.partition(k)
    return every[k]


SCORE_CHUNK = 1 << 20       # slots whose scores a budget pass holds at once


def score_chunks(entry):
    """``(first slot, scores)`` of `entry`'s rows, SCORE_CHUNK slots at a time."""
    n = len(entry)
    for lo in range(0, n, SCORE_CHUNK):
        yield lo, entry.scores(slice(lo, min(n, lo + SCORE_CHUNK)))


def _below_and_tied(entry, threshold) -> tuple[np.ndarray, np.ndarray]:
    """Slots of `entry` whose score is below `threshold`, and those equal to it."""
    below, tied = [np.zeros(0, np.int64)], [np.zeros(0, np.int64)]
    for lo, x in score_chunks(entry):
        below.append(np.flatnonzero(x < threshold) + lo)
        tied.append(np.flatnonzero(x == threshold) + lo)
    return np.concatenate(below), np.concatenate(tied)


class Lifecycle:
    """The server-wide part: settings, the clock for ``ttl_seconds``, and the memory budget across keys."""

    def __init__(self, settings: Settings | None = None, num_workers: int = 1) -> None:
        self.settings = settings or Settings()
        self.num_workers = max(int(num_workers), 1)
        self.clock = 0.0
        self.wants_clock = bool(self.settings.defaults.ttl_seconds)   # a key with ttl_seconds exists
        self.budget_passes = 0
        self._warned = False
        self.keys: dict = {}          # the server's keys (the dict apply gets): for headroom()
        self.defer = False            # the budget's pass waits for run_due (see apply)
        self.due = False              # a round end's pass not run yet

    def policy_for(self, policy: Policy, key: int, seed: int) -> RowPolicy | None:
        """The state a lazy key with ``policy`` keeps, or None when nothing would ever act on its rows."""
        if policy.admits_at_once and not policy.expires and not self.settings.memory_budget:
            return None
        self.wants_clock |= bool(policy.ttl_seconds)
        return RowPolicy(policy, self, key, seed)

    def adopt(self, policy: RowPolicy | None) -> None:
        """A restored key's policy."""
        if policy is not None:
            self.wants_clock |= bool(policy.policy.ttl_seconds)

    def set_clock(self, seconds: float) -> None:
        """The runtime's clock tick (journaled; see the module docstring). The clock never goes back."""
        self.clock = max(self.clock, float(seconds))

    def apply(self, entry, grad, optimizer, sync: bool, keys: dict, slots=None) -> None:
        """Apply one update to ``entry`` (a merged round or an async push) and, at an eviction point, run the key's
        TTL sweep and the budget. With ``defer`` the budget's pass is left for :meth:`run_due`: the server runs it
        after the round's replies are sent and in any case before it handles anything else, so the same rows go at
        the same point of the request stream (only the workers stop waiting for it: with a disk tier a pass that
        demotes a tenth of the budget takes tens of ms). ``slots``: the rows' slots a pull found, for a row_sparse
        key with no policy (``RowSparseKey.apply``)."""
        self.keys = keys
        policy = getattr(entry, "policy", None)
        if policy is None:
            if slots is None:
                entry.apply(grad, optimizer, sync)
            else:
                entry.apply(grad, optimizer, sync, slots)
            return
        policy.begin(sync)
        entry.apply(grad, optimizer, sync)
        if policy.point:
            entry.expire()
            if self.settings.memory_budget:
                self.due = True
                if not self.defer:
                    self.run_due()

    def run_due(self) -> int:
        """The budget's pass an eviction point left (see :meth:`apply`), if any, then the keys' upkeep (a disk
        tier's compaction); the rows evicted."""
        if not self.due:
            return 0
        self.due = False
        evicted = self.enforce_budget(self.keys)
        for entry in self._tables(self.keys):
            entry.upkeep()
        return evicted

    # -- the budget

    def headroom(self) -> int:
        """Bytes left under the memory budget now (0 with no budget)."""
        if not self.settings.memory_budget:
            return 0
        return max(0, self.settings.row_budget - self.accounted(self.keys))

    @staticmethod
    def _tables(keys: dict) -> list:
        return [e for e in keys.values() if e.kind == "row_sparse"]

    def accounted(self, keys: dict) -> int:
        """Bytes of every row table and pending table on this server (exact, deterministic; not RSS)."""
        return sum(e.accounted_bytes() for e in self._tables(keys))

    def enforce_budget(self, keys: dict) -> int:
        """Over the row budget (the memory budget less its reserve for the phases' buffers): evict the
        lowest-scoring rows of lazy keys (score, then key, then row id) until the accounted bytes are at the low
        watermark of it. Returns the rows evicted. Its temporaries are a few bytes a row (the scores and one copy of
        them), not copies of the rows or their ids."""
        budget = self.settings.row_budget
        total = self.accounted(keys)
        if total <= budget:
            return 0
        low = self.settings.low_watermark
        assert low is not None, "Settings.__post_init__ resolves the default"
        excess = total - int(budget * low)
        entries = [e for _, e in sorted((e.key, e) for e in self._tables(keys) if e.policy is not None and len(e))]
        if not entries:
            return self._cannot(total, keys)
        sizes = np.array([entry.row_nbytes() for entry in entries], np.int64)
        # at most this many rows are needed (all of the smallest size): the score of the want-th lowest row
        want = min(sum(len(e) for e in entries), -(-excess // int(sizes.min())))
        # the scores are found a chunk of slots at a time (every row's at once: 4-8 bytes a row in memory, ~6 with
        # the comparisons', past what a budget of millions of rows leaves over)
        threshold = kth_smallest([lambda e=e: (x for _, x in score_chunks(e)) for e in entries], want - 1)
        # the rows below it, then ties by (key, row id), then all of them in (score, key, row id) order
        below, tied = (list(z) for z in zip(*(_below_and_tied(entry, threshold) for entry in entries)))
        need = want - sum(len(b) for b in below)
        keep_ties = []
        for entry, slots in zip(entries, tied):
            order = np.argsort(entry.ids_at(slots), kind="stable")[:max(need, 0)]
            keep_ties.append(slots[order])
            need -= len(order)
        parts = [np.concatenate([b, t]) for b, t in zip(below, keep_ties)]
        owner = np.concatenate([np.full(len(p), i, np.int32) for i, p in enumerate(parts)])
        slots = np.concatenate(parts)
        score = np.concatenate([entry.scores(p).astype(np.int64) for entry, p in zip(entries, parts)])
        ids = np.concatenate([entry.ids_at(p) for entry, p in zip(entries, parts)])
        order = np.lexsort((ids, owner, score))
        cut = int(np.searchsorted(np.cumsum(sizes[owner[order]]), excess)) + 1
        chosen = order[:cut]
        # only slots, owner and chosen are needed from here: the scores and the rest go before the evictions (with
        # a disk tier their demotions' buffers would otherwise come on top: RSS past the budget's fixed overhead)
        del below, tied, keep_ties, parts, score, ids, order
        evicted = 0
        for index, entry in enumerate(entries):
            mine = slots[chosen[owner[chosen] == index]]
            if len(mine):
                evicted += entry.evict(mine)
        self.budget_passes += 1
        if self.accounted(keys) > budget:
            self._cannot(self.accounted(keys), keys)
        return evicted

    def _cannot(self, total: int, keys: dict | None = None) -> int:
        """Warn once that the budget cannot be held, naming what holds the bytes no pass can move (largest first)
        and what to set for each."""
        if not self._warned:
            self._warned = True
            log.warning("memory budget %d bytes (%d for rows, %d kept for the phases' buffers) exceeded (%d "
                        "accounted) by what no budget pass can move: %s", self.settings.memory_budget,
                        self.settings.row_budget, self.settings.reserve, total, self._unmovable(keys or {}))
        return 0

    def _unmovable(self, keys: dict) -> str:
        """The parts of the accounted bytes a pass cannot free, each with its remedy."""
        parts = {"index": 0, "plain": 0, "pending": 0}
        on_disk, per_row = 0, 0.0
        for entry in self._tables(keys):
            disk = entry.disk.index_nbytes() if entry.disk is not None else 0
            pending = entry.policy.pending_bytes() if entry.policy is not None else 0
            if entry.disk is not None:
                on_disk += len(entry.disk)
                per_row = max(per_row, float(entry.disk.index_row_nbytes()))
            parts["index"] += disk
            parts["pending"] += pending
            if entry.policy is None:
                parts["plain"] += entry.accounted_bytes() - disk - pending
        total = self.accounted(keys)
        remedy = {
            "index": "the disk tier's index of its rows on disk, %%d bytes (%d rows: %.1f bytes a row now, %.0f "
                     "bytes an entry plus the buckets for each further row; about 1.4 once written to disk as a run, "
                     "its filters, fences and newest entries staying in memory: raise "
                     "KVSTORE_LAZY_MEMORY_BUDGET for this many rows on disk, to more than %d bytes now)"
                     % (on_disk, parts["index"] / max(on_disk, 1), per_row, Settings.budget_for(total)),
            "plain": "rows of row_sparse keys not declared lazy, %d bytes (the budget evicts only lazy keys' rows: "
                     "declare them with kvstore_lazy.worker.init_lazy, or raise KVSTORE_LAZY_MEMORY_BUDGET)",
            "pending": "ids waiting for admission, %d bytes (lower KVSTORE_LAZY_ADMIT_CAP)"}
        named = [remedy[k] % v for k, v in sorted(parts.items(), key=lambda kv: -kv[1]) if v > 0]
        return "; ".join(named) or "rows of lazy keys the pass could not reach (raise KVSTORE_LAZY_MEMORY_BUDGET)"

    def stats(self, keys: dict) -> dict:
        return {"memory_budget": self.settings.memory_budget, "accounted_bytes": self.accounted(keys),
                "evict": self.settings.evict, "budget_passes": self.budget_passes, "clock": self.clock}

    def state(self) -> dict:
        return {"clock": self.clock, "budget_passes": self.budget_passes}

    def restore(self, state: dict | None) -> None:
        if state:
            self.clock = float(state.get("clock", 0.0))
            self.budget_passes = int(state.get("budget_passes", 0))
