"""The disk index out of RAM: row id -> record location in sorted runs on disk (an LSM index), not a hash table.

Owns: :class:`RunIndex` (a bounded in-RAM memtable of recent changes over immutable sorted *runs* on disk, each
with its fence pointers and a bloom filter in RAM), lookups over them, when the memtable is written and which runs
are merged, taking in what the background thread wrote, and the manifest naming the runs of a commit. Does not
own: the background thread, the groups' and the cache's arrays (:mod:`.runwork`), a run file's bytes
(:mod:`.runfile`: the format, writing, reading, the merge itself; the inner loops in ``store/kernels_runs.c``),
the locations' meaning (:mod:`.layout`), the commit point (the caller writes :meth:`RunIndex.commit`'s manifest
into its own commit file), or when a commit happens. The index of a
:class:`~kvstore_lazy.store.segments.SegmentStore` without a dense row range (through :mod:`.index`;
docs/design/disk-tier.md, "The index out of RAM").

Entries are (id uint64, loc uint32): the location ``slot << shift | offset`` of :mod:`.index`, :data:`EMPTY`
(0xFFFFFFFF) for "absent" in what :meth:`RunIndex.lookup` returns, and :data:`TOMBSTONE` (0xFFFFFFFE) stored for a
removed id, hiding its older entries. A segment store with segments of two records or more never uses 0xFFFFFFFE
as a location (its last slot is excluded: ``layout.max_slots``), so :meth:`RunIndex.set` refuses both values.

Runs and groups. A flush or a merge writes its sorted output as a *group* of run files of at most
``table_entries`` entries each (4 memtables, within [2^18, 2^22]): disjoint id ranges, ascending. Groups are
ordered oldest to newest; a newer group's entry of an id hides an older group's.

In RAM a run keeps its fences (8 bytes a 4 KiB block of 340 entries: 0.024 bytes an entry) and its bloom filter, a
split-block bloom filter as Parquet's (32-byte blocks of eight 32-bit words, one bit set in each word by a key, so a
probe is one cache line; :mod:`.runfile`): ``bloom_bits`` (10) bits an entry, 1.3% false positives. So 1.274 bytes
an entry in runs, plus the memtable (a hash table of at most ``memtable_entries`` entries, 17 to 22 bytes each,
emptied at every flush; while the one before it is written, that one too) and the cache of recent lookups (12 bytes
a slot, ``cache_entries`` slots: 1/8 of the memtable's entries by default): :meth:`RunIndex.ram_bytes`, exact in its
arrays. The 1-byte goal is ``bloom_bits=7.8`` (3.7% false positives: more reads for absent ids, and for present ones
in older runs).

A lookup of a batch (:meth:`RunIndex.lookup`, no loop over ids in Python): the memtable, the memtable being written
(if any), the cache, then the groups newest to oldest for the ids still unresolved. In each group one compiled probe
(:class:`~.runfile.Probe`) finds for each id the run whose range holds it, tests that run's filter and finds its
block by the fences; the distinct blocks are read by batched calls (:func:`kernels.pread_records`: adjacent blocks
one read, through io_uring where there is one; a large batch half on a pool thread), checked, and each id
binary-searched in its block. A present id costs one block read in the group that holds it, plus a read for each
newer group whose filter lies (1.3%); an absent id a read per group whose filter lies. The newest source wins; a
tombstone hides older entries. What the groups answered goes into the cache (direct-mapped, by the id's hash): a row
looked up again before the next flush (a pull's check of what is on disk, then its read; a hot row that stays on
disk) reads no block. Every later change of an id goes to the memtable, which is looked at first, so a cached
location cannot be stale until a flush moves changes into the runs: a flush empties the cache.

Flush and merge, off the request thread. When a set would take the memtable past ``memtable_entries`` it is frozen
(still looked up) and a new one takes its place; the index's background thread (:class:`~.runwork.Worker`) sorts
the frozen one and writes it as a new group, which the request thread takes in at its next call (one memtable at
most waits to be written: a second full one waits for the first). Then the newest groups are merged into one while
they sum to at least 1/:data:`MERGE_RATIO` of the group before them, so each group is more than 4 times the size of
the next newer one: at most ``log4(n / memtable) + 1`` groups. A merge runs on the same thread (a flush goes first,
between two of its run files), streams its inputs in chunks (:data:`~.runwork.CHUNK` entries of all inputs) through
a k-way merge (the newest entry of an id kept, tombstones dropped when it includes the oldest group), and hands
over each run file as it is written: the request thread puts it in the merge's output group (probed before the
inputs) and marks the input groups as answering only the ids above the output's last one, so the input runs it
covers leave (their filters freed) as the merge goes: a merge holds one output file's filter more than the index
did, for a moment. A removal of an id no run may hold (not in the cache of lookups, which only runs fill, and
the bloom filters say so: in RAM) empties its memtable entry in place (:data:`EMPTY`, left out by the flush)
instead of writing a tombstone. Every temporary is bounded by a chunk, a batch, a run file or the memtable, never
by the index's size.

Crash consistency. The runs in use are named by :meth:`RunIndex.manifest` (JSON-able: the run files oldest first,
the groups they form, and the id each group answers above while a merge takes it in). :meth:`RunIndex.commit`
writes the memtable (however small), waits for it and the merges it leads to, and returns the manifest: every run it
lists is durable (a run file is fsynced, renamed and its directory fsynced before it is handed over), the index is
exactly those runs, and no other is being written. The caller writes it into its commit file, then calls
:meth:`RunIndex.committed`: run files that the previous committed manifest listed and a merge replaced are deleted
only then (a run never listed in a manifest handed out is deleted as soon as it is replaced). :meth:`RunIndex.open`
with a manifest restores exactly that state and deletes the run files (and temp files) it does not list: what was
written after it, by the background thread too. Run files are never written again after their rename, so a
snapshot hard-links them (``commit.commit``). Damage is a :class:`~.errors.SegmentError` naming the file
(and block); a failed write a :class:`~.errors.DiskError` naming the directory, raised at the next call after the
background thread met it, the index as it was before the flush or the run file that failed (a memtable whose write
failed is kept, and written again at the next flush or commit).
"""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np

from kvstore_lazy.store.disk.errors import SegmentError
from kvstore_lazy.store.disk.runfile import (BLOCK_BYTES, EMPTY, RUN_GLOB, TEMP_SUFFIX, TOMBSTONE, Format, Run,
                                             merged, open_run, rechunk, run_name)
from kvstore_lazy.store.disk.runwork import CHUNK, Group, Job, Recent, Worker, memtable_order
from kvstore_lazy.store.rows import RowTable, as_row_ids

__all__ = ["RunIndex", "EMPTY", "TOMBSTONE", "FORMAT", "run_name"]

FORMAT = "kvstore-lazy-runs/2"
FORMATS = (FORMAT, "kvstore-lazy-runs/1")   # /1: no groups (each run its own)
BLOOM_BITS = 10.0
MEMTABLE_ENTRIES = 1 << 17
MERGE_RATIO = 4                     # merge the newest groups while they sum to >= 1/4 of the group before them
TABLE_SHARE, TABLE_MIN, TABLE_MAX = 4, 1 << 18, 1 << 22     # a run file: 4 memtables, within these
CACHE_SHARE, CACHE_MIN, CACHE_MAX = 8, 1 << 6, 1 << 17      # cache slots: 1/8 of the memtable's entries, within


def _pow2_within(n: int, low: int, high: int) -> int:
    return 1 << max(low.bit_length() - 1, min(high.bit_length() - 1, max(1, n).bit_length() - 1))


class RunIndex:
    """Row id -> uint32 location, in a memtable of at most ``memtable_entries`` entries over sorted runs in
    ``directory`` (see the module docstring). Not thread-safe: one caller thread (the background thread is the
    index's own)."""

    def __init__(self, directory, memtable_entries: int = MEMTABLE_ENTRIES, bloom_bits: float = BLOOM_BITS,
                 block_bytes: int = BLOCK_BYTES, _manifest: dict | None = None, *, table_entries: int | None = None,
                 cache_entries: int | None = None) -> None:
        """A new, empty index in ``directory`` (made if missing; SegmentError if it holds runs already: open them
        with :meth:`open`). ``table_entries``: entries a run file holds at most (default: 4 memtables, within
        [2^18, 2^22]); ``cache_entries``: slots of the cache of recent lookups (default: 1/8 of the memtable's
        entries as a power of two, within [2^6, 2^17]; 0: none)."""
        self.directory = Path(directory)
        if memtable_entries < 1 or not 0 < bloom_bits <= 64:
            raise ValueError(f"memtable_entries {memtable_entries} must be >= 1, bloom_bits {bloom_bits} in (0, 64]")
        if table_entries is not None and table_entries < 1:
            raise ValueError(f"table_entries {table_entries} must be >= 1")
        self.memtable_entries, self.bloom_bits = int(memtable_entries), float(bloom_bits)
        self.fmt = Format(block_bytes)
        self.table_entries = int(table_entries) if table_entries is not None else \
            min(max(TABLE_SHARE * self.memtable_entries, TABLE_MIN), TABLE_MAX)
        cache = _pow2_within(self.memtable_entries // CACHE_SHARE, CACHE_MIN, CACHE_MAX) \
            if cache_entries is None else (_pow2_within(cache_entries, 2, 1 << 40) if cache_entries > 0 else 0)
        self._cache = Recent(cache)
        self._groups: list[Group] = []                # oldest first
        self._mem = self._new_memtable()
        self._frozen: RowTable | None = None            # the memtable being written (or whose write failed)
        self._flush: Job | None = None
        self._merge: Job | None = None
        self._live = 0
        self._retired: list[str] = []                   # replaced runs a handed-out manifest lists
        self._committed: set[str] = set()               # runs of the last manifest the caller committed
        self._handed: set[str] = set()                  # runs of the manifest commit() handed out since
        self.counters = {"lookups": 0, "blocks_read": 0, "bloom_negatives": 0, "bloom_false": 0, "cache_hits": 0,
                         "flushes": 0, "merges": 0, "entries_written": 0}
        self._work = Worker(self.directory, self.fmt, self.bloom_bits, self.table_entries)
        if _manifest is None:
            self.directory.mkdir(parents=True, exist_ok=True)
            if any(self.directory.glob(RUN_GLOB)):
                raise SegmentError(f"{self.directory} already holds index runs (open them with a manifest)")

    @classmethod
    def open(cls, directory, manifest: dict, memtable_entries: int = MEMTABLE_ENTRIES,
             verify: bool = False, **options) -> "RunIndex":
        """The index as ``manifest`` (from :meth:`commit`) names it; run files it does not list (written after it)
        are deleted. With ``verify`` every block of every run is read and checked. SegmentError naming the file
        if a run is missing, damaged or not what the manifest says. ``options``: as for the constructor."""
        return _open(cls, Path(directory), manifest, memtable_entries, verify, options)

    # -- the API

    def __len__(self) -> int:
        """Ids stored (exact: tombstones and shadowed entries are not counted)."""
        return self._live

    @property
    def _runs(self) -> list[Run]:
        """Every run in use, oldest group first (each group's in id order)."""
        return [run for group in self._groups for run in group.runs]

    def lookup(self, row_ids) -> np.ndarray:
        """The location of each id (any order, repeats allowed), :data:`EMPTY` where absent."""
        self._harvest()
        ids = as_row_ids(row_ids)
        self.counters["lookups"] += len(ids)
        out = np.full(len(ids), EMPTY, np.uint32)
        if not len(ids):
            return out
        if len(ids) > 1 and (ids[1:] < ids[:-1]).any():
            order = np.argsort(ids, kind="stable")
            sids = ids[order]
        else:                                           # (a request's ids come sorted)
            order = np.arange(len(ids))
            sids = ids
        pending = np.arange(len(ids))                   # positions in sids still unresolved (ascending)
        for table in (self._mem, self._frozen):
            if table is not None and len(table) and len(pending):
                slots = table.lookup(sids[pending])
                hit = slots >= 0
                out[order[pending[hit]]] = table.arrays()[0][slots[hit], 0]
                pending = pending[~hit]
        if len(pending) and self._groups:
            locs = self._cache.get(sids[pending])
            hit = locs != EMPTY
            out[order[pending[hit]]] = locs[hit]
            self.counters["cache_hits"] += int(hit.sum())
            pending = pending[~hit]
            found, locs = _probe_groups(self._groups, sids[pending], self.counters)
            out[order[pending[found]]] = locs
            self._cache.put(sids[pending[found]], locs)
        out[out == TOMBSTONE] = EMPTY
        return out

    def set(self, row_ids, locs, old=None) -> np.ndarray:
        """Point ``row_ids`` (unique: else ValueError) at ``locs`` (uint32 below :data:`TOMBSTONE`); returns their
        previous locations (:data:`EMPTY` for new ids). ``old``: the previous locations as the caller knows them
        (a demotion's rows are not on disk; a compaction moves records it knows live): then no lookup, and the
        live count trusts them. Nothing changes on a ValueError; a DiskError (a write in the background that
        failed) leaves the pieces before it applied."""
        ids = as_row_ids(row_ids)
        locs = np.asarray(locs)
        if locs.shape != ids.shape:
            raise ValueError(f"{len(ids)} ids, locations of shape {locs.shape}")
        if len(locs) and (locs.min() < 0 or locs.max() >= TOMBSTONE):
            raise ValueError(f"locations must be in [0, {TOMBSTONE:#x})")
        old = self._old(ids, old)
        self._put(ids, locs.astype(np.uint32), old)
        return old

    def remove(self, row_ids, old=None) -> np.ndarray:
        """Drop ``row_ids`` (unique: else ValueError); returns their previous locations (:data:`EMPTY` where
        absent: nothing to drop). ``old`` as for :meth:`set` (a promotion has just looked its rows up)."""
        ids = as_row_ids(row_ids)
        old = self._old(ids, old)
        present = old != EMPTY
        gone, was = ids[present], old[present]
        hidden = self._in_runs(gone)            # a tombstone only where a run may hold an older entry
        if not hidden.all():
            self._forget(gone[~hidden])
        self._put(gone[hidden], np.full(int(hidden.sum()), TOMBSTONE, np.uint32), was[hidden])
        return old

    def items(self, chunk: int = CHUNK) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """(ids, locs) of every id stored, ascending by id, at most ``chunk`` at a time: the index as it is at this
        call (don't change it while iterating)."""
        self._harvest()
        return rechunk(merged(self._sources(chunk), drop_tombstones=True), chunk)

    def flush(self) -> None:
        """Write the memtable as a run (if it holds anything) and wait until it is written and every merge that
        follows is done (:meth:`settle`)."""
        self._harvest()
        self._freeze()
        self.settle()

    def settle(self) -> None:
        """Wait until the background thread has nothing left to do (the memtable being written, merges), and take
        in what it did. DiskError or SegmentError if it failed."""
        while True:
            job = self._flush or self._merge
            if job is None:
                self._harvest()
                if self._flush is None and self._merge is None:
                    return
                continue
            self._harvest(wait_for=job)

    def manifest(self) -> dict:
        """The runs in use as a JSON-able dict (what :meth:`open` takes); the memtable is not in it (see
        :meth:`commit`)."""
        runs, groups = [], []
        for group in self._groups:
            if group.runs:
                runs += [[run.name, run.entries] for run in group.runs]
                groups.append([len(group.runs), None if group.after is None else int(group.after)])
        return {"format": FORMAT, "block_bytes": self.fmt.block_bytes, "bloom_bits": self.bloom_bits,
                "next_number": self._work.next_number(), "live": self._live, "runs": runs, "groups": groups}

    def commit(self) -> dict:
        """Write the memtable (however small), wait for that and for the merges it leads to (:meth:`flush`), and
        return the manifest: every run it lists is durable, the index is exactly those runs, and no other run
        file is being written. The caller writes it into its commit file, then calls :meth:`committed`."""
        self.flush()
        manifest = self.manifest()
        self._handed |= {name for name, _ in manifest["runs"]}
        return manifest

    def committed(self, manifest: dict, elsewhere: bool = False) -> None:
        """The caller's commit point now holds ``manifest`` (from :meth:`commit`), or with `elsewhere` another
        directory's commit does (a snapshot's, durable, whose own hard links keep its runs): delete the run files
        merges replaced that no manifest in use here lists."""
        names = {str(name) for name, _ in manifest["runs"]}
        if elsewhere:
            self._handed -= names
        else:
            self._committed, self._handed = names, set()
        keep = [name for name in self._retired if name in self._committed or name in self._handed]
        for name in set(self._retired) - set(keep):
            (self.directory / name).unlink(missing_ok=True)
        self._retired = keep

    def verify(self) -> None:
        """Read and check every block of every run (SegmentError naming the first damaged one)."""
        for run in self._runs:
            for _ in run.chunks(CHUNK):
                pass

    def close(self) -> None:
        """Stop the background thread (what it was writing is dropped: the last commit is what stays) and close
        the run files."""
        _drop_unseen(self._work.stop(), {run.name for run in self._runs})
        for run in self._runs:
            run.close()

    def __del__(self) -> None:
        try:
            self.close()
        except (OSError, AttributeError):
            pass

    # -- sizes and stats

    def ram_bytes(self) -> int:
        """RAM the index holds, exact in its arrays: every run's fences and bloom filter, the memtable's hash table
        (ids, locations, buckets) and the one being written, and the cache. A run's Python objects (a few hundred
        bytes) aside, and the background thread's temporaries: a flush's sorted copy of its memtable (12 bytes an
        entry), a merge's chunks and the filter of the run file it has just written until the caller's thread takes
        it in (when the runs it replaces free theirs)."""
        total = sum(run.ram_bytes() for run in self._runs) + self._mem.nbytes() + self._cache.nbytes()
        return total + (self._frozen.nbytes() if self._frozen is not None else 0)

    def disk_bytes(self) -> int:
        """Bytes of the run files in use (not counting replaced ones a committed manifest still lists)."""
        return sum(run.file_bytes for run in self._runs)

    def stats(self) -> dict:
        """Sizes, the counters, and ``reads_per_lookup``: blocks read per id looked up (a cold row's index reads)."""
        runs = self._runs
        return {"entries": self._live, "runs": len(runs), "groups": len(self._groups),
                "run_entries": [r.entries for r in runs], "memtable": len(self._mem),
                "frozen": 0 if self._frozen is None else len(self._frozen), "merging": self._merge is not None,
                "ram_bytes": self.ram_bytes(), "disk_bytes": self.disk_bytes(),
                "reads_per_lookup": self.counters["blocks_read"] / max(1, self.counters["lookups"]), **self.counters}

    # -- internals: the caller's thread

    def _new_memtable(self) -> RowTable:
        return RowTable(1, np.uint32, initial_capacity=min(self.memtable_entries, 1024), max_load=0.8,
                        lean_rehash=True)

    def _old(self, ids: np.ndarray, old) -> np.ndarray:
        """The previous locations of ``ids`` (unique, else ValueError): ``old`` checked, or looked up."""
        if len(ids) > 1:
            s = ids if (ids[1:] > ids[:-1]).all() else np.sort(ids)     # (sorted and unique: no sort)
            dup = np.flatnonzero(s[1:] == s[:-1])
            if len(dup):
                raise ValueError(f"row id {int(s[dup[0]])} given twice")
        if old is None:
            return self.lookup(ids)
        old = np.asarray(old)
        if old.shape != ids.shape or (len(old) and (old.min() < 0 or old.max() > EMPTY)):
            raise ValueError(f"{len(ids)} ids, previous locations of shape {old.shape}")
        self._harvest()
        return old.astype(np.uint32)

    def _put(self, ids: np.ndarray, locs: np.ndarray, old: np.ndarray) -> None:
        """Write entries into the memtable in pieces that fit, handing it to be written first when the next piece
        would not fit."""
        cap = self.memtable_entries
        for lo in range(0, len(ids), cap):
            part, part_locs, part_old = ids[lo:lo + cap], locs[lo:lo + cap], old[lo:lo + cap]
            if len(self._mem) + len(part) > cap:
                self._freeze()
            slots = self._mem.ensure(part, lambda new: np.zeros((len(new), 1), np.uint32))
            self._mem.arrays()[0][slots, 0] = part_locs
            was = part_old != EMPTY
            now = part_locs != TOMBSTONE
            self._live += int((now & ~was).sum()) - int((~now & was).sum())

    def _in_runs(self, ids: np.ndarray) -> np.ndarray:
        """A mask of the ``ids`` some run may hold, or the memtable being written: those in the cache of lookups (a
        group answered them since the last flush, which empties it), then by the groups' bloom filters (no read)."""
        out = np.zeros(len(ids), bool) if self._frozen is None else self._frozen.lookup(ids) >= 0
        if self._groups and len(ids):
            out |= self._cache.get(ids) != EMPTY        # (a promotion's rows: its lookup has just cached them)
            rest = np.flatnonzero(~out)
            part = ids[rest]
            if (part[1:] < part[:-1]).any():            # (the filters take ascending ids)
                order = np.argsort(part, kind="stable")
                rest, part = rest[order], part[order]
            out[rest] |= np.logical_or.reduce([group.may_hold(part) for group in self._groups])
        return out

    def _forget(self, ids: np.ndarray) -> None:
        """Drop present ``ids`` no run holds (no tombstone: nothing older to hide): their memtable entries say
        :data:`EMPTY`, absent to a lookup, left out by a flush (an array write: taking them out of the hash table
        moves its last rows into their holes); the id's next set takes its entry again."""
        slots = self._mem.lookup(ids)
        self._mem.arrays()[0][slots[slots >= 0], 0] = EMPTY
        self._live -= len(ids)

    def _sources(self, chunk: int) -> list[Iterator[tuple[np.ndarray, np.ndarray]]]:
        """Every group's and the memtables' entries, oldest first, sorted, in pieces that hold about ``chunk``
        entries together."""
        tables = [t for t in (self._frozen, self._mem) if t is not None and len(t)]
        share = max(1, chunk // (len(self._groups) + len(tables) or 1))
        sources = [group.stream(share) for group in self._groups]
        for table in tables:
            sources.append(rechunk(iter([_sorted(table)]), share))
        return sources

    def _freeze(self) -> None:
        """Hand the memtable to the background thread to be written as a group of runs, a new one taking its place,
        once the one before it is written (waited for; written again if its write failed). The first run is waited
        for too: a store makes its live bits when the index has runs (SegmentStore._ensure_bits)."""
        if self._flush is not None:
            self._harvest(wait_for=self._flush)
        if self._frozen is not None:            # its write failed: again, and wait
            self._start_flush()
            self._harvest(wait_for=self._flush)
        if len(self._mem):
            self._frozen, self._mem = self._mem, self._new_memtable()
            self._start_flush()
            if not self._groups:
                self._harvest(wait_for=self._flush)

    def _start_flush(self) -> None:
        frozen, n = self._frozen, len(self._frozen)
        self._flush = Job("flush", ids=frozen.row_ids_view()[:n], locs=frozen.arrays()[0][:n, 0])
        self._work.submit(self._flush)

    def _plan_merge(self) -> None:
        """Merge the newest groups into one while they sum to at least 1/MERGE_RATIO of the group before them (on
        the background thread; one merge at a time)."""
        if self._merge is not None or self._work.stopping or not self._groups:
            return
        j, total = len(self._groups) - 1, self._groups[-1].entries
        while j >= 1 and total * MERGE_RATIO >= self._groups[j - 1].entries:
            j -= 1
            total += self._groups[j].entries
        if len(self._groups) - j >= 2:
            self._start_merge(j)

    def _start_merge(self, j: int) -> None:
        """Merge the groups from the ``j``-th on into a new group (placed after them, probed before them), its run
        files numbered now (as many as it may write: a manifest lists run files in the order of their numbers)."""
        output = Group([])
        self._merge = Job("merge", inputs=self._groups[j:], output=output, drop=j == 0)
        most = -(-sum(group.entries for group in self._merge.inputs) // self.table_entries)
        first = self._work.take_number(most)
        self._merge.numbers = iter(range(first, first + most))
        self._groups.append(output)
        self._work.submit(self._merge)

    def _harvest(self, wait_for: Job | None = None) -> None:
        """Take in what the background thread finished, in order (an event that raises leaves the later ones for
        the next call); with ``wait_for``, until that job has ended."""
        while True:
            event = self._work.next_event(None if wait_for is None or wait_for.ended else wait_for)
            if event is None:
                return
            self._apply(event)

    def _apply(self, event: tuple) -> None:
        kind, job = event[0], event[1]
        if kind == "flushed":
            job.ended, self._flush, self._frozen = True, None, None
            runs = event[2]
            if runs:
                self._groups.append(Group(runs))
            self._cache.clear()                 # (the runs' content changed: the memtable's entries are in them)
            self.counters["flushes"] += 1
            self.counters["entries_written"] += sum(run.entries for run in runs)
            self._plan_merge()
        elif kind == "table":
            run = event[2]
            job.output.runs.append(run)
            job.output.changed()
            for group in job.inputs:            # they answer only above what the output holds now
                # (never lowered: after a failed merge an input answers above the partial output it handed over,
                # whose runs dropped its tombstones; a later merge's first file may end below that)
                group.after = run.last if group.after is None else max(group.after, run.last)
                covered = [r for r in group.runs if r.last <= run.last]
                if covered:
                    group.runs = [r for r in group.runs if r.last > run.last]
                    for old in covered:
                        self._retire(old)
                group.changed()
            self.counters["entries_written"] += run.entries
        elif kind == "merged":
            job.ended, self._merge = True, None
            for group in job.inputs:
                for old in group.runs:
                    self._retire(old)
                self._groups.remove(group)
            if not job.output.runs:
                self._groups.remove(job.output)
            self.counters["merges"] += 1
            self._plan_merge()
        elif kind == "failed":
            job.ended = True
            if job.kind == "flush":
                self._flush = None              # (the frozen memtable stays: written again by the next _freeze)
            else:
                self._merge = None
                if not job.output.runs:
                    self._groups.remove(job.output)
            raise event[2]

    def _retire(self, run: Run) -> None:
        """A run a merge replaced: out of every lookup (its filter freed); its file deleted, or kept until the next
        commit if a manifest in use lists it. Its descriptor closes with its last reference (the merge's reader
        may still hold it)."""
        run.drop_filter()
        if run.name in self._committed or run.name in self._handed:
            self._retired.append(run.name)
        else:
            run.path.unlink(missing_ok=True)


def _open(cls, directory: Path, manifest: dict, memtable_entries: int, verify: bool, options: dict) -> RunIndex:
    """RunIndex.open."""
    try:
        if manifest.get("format") not in FORMATS:
            raise SegmentError(f"{directory}: not a {FORMAT} index manifest (format {manifest.get('format')!r})")
        index = cls(directory, memtable_entries, float(manifest["bloom_bits"]), int(manifest["block_bytes"]),
                    _manifest=manifest, **options)
        listed = [(str(name), int(entries)) for name, entries in manifest["runs"]]
        groups = [(int(count), None if after is None else int(after))
                  for count, after in manifest.get("groups", [[1, None]] * len(listed))]
        live, next_number = int(manifest["live"]), int(manifest["next_number"])
    except (KeyError, TypeError, ValueError) as exc:
        if isinstance(exc, SegmentError):
            raise
        raise SegmentError(f"{directory}: cannot read the index manifest: {exc}") from None
    names = {name for name, _ in listed}
    if len(names) != len(listed):
        raise SegmentError(f"{directory}: the index manifest lists a run twice")
    if sum(count for count, _ in groups) != len(listed) or any(count < 1 for count, _ in groups):
        raise SegmentError(f"{directory}: the index manifest's groups do not cover its {len(listed)} runs")
    try:
        runs = []
        for name, entries in listed:
            run = open_run(directory / name, index.fmt)
            runs.append(run)
            if run.entries != entries or run.name != run_name(run.number):
                raise SegmentError(f"index run {run.path}: {run.entries} entries, number {run.number}; the "
                                   f"manifest says {entries}")
        at = 0
        for count, after in groups:
            members = runs[at:at + count]
            at += count
            if any(a.last >= b.fences[0] for a, b in zip(members, members[1:]) if a.blocks and b.blocks):
                raise SegmentError(f"{directory}: the index manifest's group of {members[0].name} has runs "
                                   "whose id ranges overlap")
            index._groups.append(Group(members, None if after is None else np.uint64(after)))
    except SegmentError:
        for run in runs:
            run.close()
        raise
    index._live = live
    index._work = Worker(directory, index.fmt, index.bloom_bits, index.table_entries, next_number)
    index._committed = set(names)
    for file in list(directory.glob(RUN_GLOB)) + list(directory.glob(RUN_GLOB + TEMP_SUFFIX)):
        if file.name not in names:
            file.unlink()                           # written after the manifest's commit: garbage
    if verify:
        index.verify()
    return index


def _sorted(table: RowTable) -> tuple[np.ndarray, np.ndarray]:
    """A memtable's (ids, locations), by id, its emptied entries (:meth:`RunIndex._forget`) left out."""
    n = len(table)
    ids, locs = table.row_ids_view()[:n], table.arrays()[0][:n, 0]
    order = memtable_order(ids, locs)
    return ids[order], locs[order]


def _probe_groups(groups: list[Group], ids: np.ndarray, counters: dict) -> tuple[np.ndarray, np.ndarray]:
    """(positions in ``ids`` (ascending) of those the groups hold, the location of each from the newest group that
    holds it, tombstones included)."""
    pending = np.arange(len(ids))
    found, locs = [], []
    for group in reversed(groups):
        if not len(pending):
            break
        at, got = group.probe()(ids[pending], group.after, counters)
        if len(at):
            found.append(pending[at])
            locs.append(got)
            keep = np.ones(len(pending), bool)
            keep[at] = False
            pending = pending[keep]
    if not found:
        return np.zeros(0, np.int64), np.zeros(0, np.uint32)
    return np.concatenate(found), np.concatenate(locs)


def _drop_unseen(events: list[tuple], listed: set[str]) -> None:
    """The run files of events never taken in, closed and deleted (no manifest lists them)."""
    for event in events:
        for run in event[2] if event[0] == "flushed" else [event[2]] if event[0] == "table" else []:
            run.close()
            if run.name not in listed:
                run.path.unlink(missing_ok=True)
