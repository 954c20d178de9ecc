"""The disk index out of RAM: row id -> record location in sorted runs on disk (an LSM index), not a hash table.

Owns: :class:`RunIndex` (a bounded in-RAM memtable of recent changes over immutable sorted *runs* on disk, each
with its fence pointers and a bloom filter in RAM), lookups over them, the flush of the memtable, when runs are
merged, and the manifest naming the runs of a commit. Does not own: a run file's bytes (:mod:`.runfile`: the
format, writing, reading, the merge itself), the locations' meaning (:mod:`.layout`), the
commit point (the caller writes :meth:`RunIndex.commit`'s manifest into its own commit file), or when a commit
happens. The index of a :class:`~kvstore_lazy.store.segments.SegmentStore` without a dense row range (through
:mod:`.index`; docs/design/disk-tier.md, "The index out of RAM").

Entries are (id uint64, loc uint32): the location ``slot << shift | offset`` of :mod:`.index`, :data:`EMPTY`
(0xFFFFFFFF) for "absent" in what :meth:`RunIndex.lookup` returns, and :data:`TOMBSTONE` (0xFFFFFFFE) stored for a
removed id, hiding its older entries. A segment store with segments of two records or more never uses 0xFFFFFFFE
as a location (its last slot is excluded: ``layout.max_slots``), so :meth:`RunIndex.set` refuses both values.

In RAM a run keeps its fences (8 bytes a block: 0.024 bytes an entry) and its bloom filter, a split-block bloom
filter as Parquet's (32-byte blocks of eight 32-bit words, one bit set in each word by a key, so a probe is one
cache line; :mod:`.runfile`): ``bloom_bits`` (10) bits an entry, 1.3% false positives. So 10/8 + 8/340 = 1.274
bytes an entry in runs, exactly :meth:`RunIndex.ram_bytes`, plus the memtable (a hash table of at most
``memtable_entries`` entries, 17 to 22 bytes each, emptied at every flush). The 1-byte goal is ``bloom_bits=7.8``
(3.7% false positives: more reads for absent ids, and for present ones in older runs).

A lookup of a batch (:meth:`RunIndex.lookup`, one numpy pass per source, no loop over ids): the memtable first, then
the runs newest to oldest for the ids still unresolved; in each run the ids that pass the id range and the bloom
filter go to the fences (``searchsorted``), their distinct blocks are read in one batched call
(:func:`kernels.pread_records`: adjacent blocks one read, through io_uring where there is one), checked, and each id
binary-searched in its block, all of them at once in place. A present id costs one block read in the run that holds
it, plus a read for each newer run whose filter lies (1.3%); an absent id a read per run whose filter lies. The
newest source wins; a tombstone hides older entries.

Flush and merge. When a set would take the memtable past ``memtable_entries`` it is written first as a new run.
After each flush the newest runs are merged into one while they sum to at least 1/:data:`MERGE_RATIO` of the run
before them, so each run is more than 4 times the size of the next newer one: at most ``log4(n / memtable) + 1``
runs. A removal of an id no run may hold (their bloom filters say so, in RAM) drops its memtable entry instead
of writing a tombstone. A merge is a streaming k-way merge in chunks (:data:`CHUNK` entries of all inputs), newest
entry of an id kept, tombstones dropped when the merge includes the oldest run. Every temporary is bounded by a
chunk, a batch or the memtable, never by the index's size; a run being written keeps only its fences in RAM and
builds its bloom filter when its entry count is known (re-reading its own blocks), in the room of its inputs'
filters, which a merge frees first (and reads back from their files if it fails).

Crash consistency. The runs in use are named by :meth:`RunIndex.manifest` (JSON-able). :meth:`RunIndex.commit`
flushes the memtable (however small) and returns the manifest: every run it lists is durable and the state is
exactly those runs. The caller writes it into its commit file, then calls :meth:`RunIndex.committed`: run files
that the previous committed manifest listed and a merge replaced are deleted only then (a run never listed in a
manifest handed out is deleted as soon as a merge replaces it). :meth:`RunIndex.open` with a manifest restores
exactly that state and deletes the run files (and temp files) it does not list: what was written after it. Run
files are never written again after their rename, so a snapshot hard-links them (:meth:`RunIndex.link_into`).
Damage is a :class:`~.errors.SegmentError` naming the file (and block); a failed write a
:class:`~.errors.DiskError` naming the directory, the index as it was before the flush or merge that failed.
"""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np

from kvstore_lazy.store.disk.errors import DiskError, SegmentError
from kvstore_lazy.store.disk.files import link_or_copy
from kvstore_lazy.store.disk.runfile import (BLOCK_BYTES, RUN_GLOB, TEMP_SUFFIX, TOMBSTONE, Format, Run, RunWriter,
                                             merged, open_run, rechunk, run_name)
from kvstore_lazy.store.rows import RowTable, as_row_ids

__all__ = ["RunIndex", "EMPTY", "TOMBSTONE", "FORMAT", "run_name"]

FORMAT = "kvstore-lazy-runs/1"
EMPTY = 0xFFFFFFFF                  # lookup's "absent"
BLOOM_BITS = 10.0
MEMTABLE_ENTRIES = 1 << 17
MERGE_RATIO = 4                     # merge the newest runs while they sum to >= 1/4 of the run before them
CHUNK = 1 << 16                     # entries a merge holds of all its inputs together


class RunIndex:
    """Row id -> uint32 location, in a memtable of at most ``memtable_entries`` entries over sorted runs in
    ``directory`` (see the module docstring). Not thread-safe."""

    def __init__(self, directory, memtable_entries: int = MEMTABLE_ENTRIES, bloom_bits: float = BLOOM_BITS,
                 block_bytes: int = BLOCK_BYTES, _manifest: dict | None = None) -> None:
        """A new, empty index in ``directory`` (made if missing; SegmentError if it holds runs already: open them
        with :meth:`open`)."""
        self.directory = Path(directory)
        if memtable_entries < 1 or not 0 < bloom_bits <= 64:
            raise ValueError(f"memtable_entries {memtable_entries} must be >= 1, bloom_bits {bloom_bits} in (0, 64]")
        self.memtable_entries, self.bloom_bits = int(memtable_entries), float(bloom_bits)
        self.fmt = Format(block_bytes)
        self._runs: list[Run] = []                     # oldest first
        self._mem = self._new_memtable()
        self._live = 0
        self._next_number = 1
        self._retired: list[str] = []                   # replaced runs a handed-out manifest lists
        self._committed: set[str] = set()               # runs of the last manifest the caller committed
        self._handed: set[str] = set()                  # runs of the manifest commit() handed out since
        self.counters = {"lookups": 0, "blocks_read": 0, "bloom_negatives": 0, "bloom_false": 0, "flushes": 0,
                         "merges": 0, "entries_written": 0}
        if _manifest is None:
            self.directory.mkdir(parents=True, exist_ok=True)
            if any(self.directory.glob(RUN_GLOB)):
                raise SegmentError(f"{self.directory} already holds index runs (open them with a manifest)")

    @classmethod
    def open(cls, directory, manifest: dict, memtable_entries: int = MEMTABLE_ENTRIES,
             verify: bool = False) -> "RunIndex":
        """The index as ``manifest`` (from :meth:`commit`) names it; run files it does not list (written after it)
        are deleted. With ``verify`` every block of every run is read and checked. SegmentError naming the file
        if a run is missing, damaged or not what the manifest says."""
        directory = Path(directory)
        try:
            if manifest.get("format") != FORMAT:
                raise SegmentError(f"{directory}: not a {FORMAT} index manifest (format {manifest.get('format')!r})")
            index = cls(directory, memtable_entries, float(manifest["bloom_bits"]), int(manifest["block_bytes"]),
                        _manifest=manifest)
            listed = [(str(name), int(entries)) for name, entries in manifest["runs"]]
            live, next_number = int(manifest["live"]), int(manifest["next_number"])
        except (KeyError, TypeError, ValueError) as exc:
            if isinstance(exc, SegmentError):
                raise
            raise SegmentError(f"{directory}: cannot read the index manifest: {exc}") from None
        names = {name for name, _ in listed}
        if len(names) != len(listed):
            raise SegmentError(f"{directory}: the index manifest lists a run twice")
        try:
            for name, entries in listed:
                run = open_run(directory / name, index.fmt)
                index._runs.append(run)
                if run.entries != entries or run.name != run_name(run.number):
                    raise SegmentError(f"index run {run.path}: {run.entries} entries, number {run.number}; the "
                                       f"manifest says {entries}")
        except SegmentError:
            index.close()
            raise
        index._live, index._next_number = live, next_number
        index._committed = set(names)
        for file in list(directory.glob(RUN_GLOB)) + list(directory.glob(RUN_GLOB + TEMP_SUFFIX)):
            if file.name not in names:
                file.unlink()                           # written after the manifest's commit: garbage
        if verify:
            index.verify()
        return index

    # -- the API

    def __len__(self) -> int:
        """Ids stored (exact: tombstones and shadowed entries are not counted)."""
        return self._live

    def lookup(self, row_ids) -> np.ndarray:
        """The location of each id (any order, repeats allowed), :data:`EMPTY` where absent."""
        ids = as_row_ids(row_ids)
        self.counters["lookups"] += len(ids)
        out = np.full(len(ids), EMPTY, np.uint32)
        if not len(ids):
            return out
        order = np.argsort(ids, kind="stable")
        sids = ids[order]
        pending = np.arange(len(ids))                   # positions in sids still unresolved
        if len(self._mem):
            slots = self._mem.lookup(sids)
            hit = slots >= 0
            out[order[hit]] = self._mem.arrays()[0][slots[hit], 0]
            pending = np.flatnonzero(~hit)
        for run in reversed(self._runs):
            if not len(pending):
                break
            found, locs = run.probe(sids[pending], self.counters)
            out[order[pending[found]]] = locs
            pending = pending[~found]
        out[out == TOMBSTONE] = EMPTY
        return out

    def set(self, row_ids, locs, old=None) -> np.ndarray:
        """Point ``row_ids`` (unique: else ValueError) at ``locs`` (uint32 below :data:`TOMBSTONE`); returns their
        previous locations (:data:`EMPTY` for new ids). ``old``: the previous locations as the caller knows them
        (a demotion's rows are not on disk; a compaction moves records it knows live): then no lookup, and the
        live count trusts them. Nothing changes on a ValueError; a DiskError (a flush that failed) leaves the
        pieces before it applied."""
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
        """(ids, locs) of every id stored, ascending by id, at most ``chunk`` at a time (don't change the index
        while iterating)."""
        return rechunk(merged(self._sources(chunk), drop_tombstones=True), chunk)

    def flush(self) -> None:
        """Write the memtable as a run (if it holds anything), then merge as the policy says."""
        if not len(self._mem):
            return
        mem_ids, mem_locs = self._memtable_sorted()
        run = self._write_run(iter([(mem_ids, mem_locs)]))
        self._mem = self._new_memtable()
        if run is not None:
            self._runs.append(run)
        self.counters["flushes"] += 1
        self._merge_policy()

    def manifest(self) -> dict:
        """The runs in use as a JSON-able dict (what :meth:`open` takes); the memtable is not in it (see
        :meth:`commit`)."""
        return {"format": FORMAT, "block_bytes": self.fmt.block_bytes, "bloom_bits": self.bloom_bits,
                "next_number": self._next_number, "live": self._live,
                "runs": [[run.name, run.entries] for run in self._runs]}

    def commit(self) -> dict:
        """Flush the memtable (however small) and return the manifest: every run it lists is durable, and the
        index is exactly those runs. The caller writes it into its commit file, then calls :meth:`committed`."""
        self.flush()
        manifest = self.manifest()
        self._handed |= {run.name for run in self._runs}
        return manifest

    def committed(self, manifest: dict) -> None:
        """The caller's commit point now holds ``manifest`` (from :meth:`commit`): delete the run files merges
        replaced that no manifest still in use lists."""
        self._committed = {str(name) for name, _ in manifest["runs"]}
        self._handed = set()
        keep = []
        for name in self._retired:
            if name in self._committed:
                keep.append(name)
            else:
                (self.directory / name).unlink(missing_ok=True)
        self._retired = keep

    def link_into(self, manifest: dict, target) -> None:
        """Hard-link (or copy across file systems) the runs ``manifest`` lists into ``target`` (a snapshot)."""
        try:
            for name, _ in manifest["runs"]:
                link_or_copy(self.directory / name, Path(target) / name)
        except OSError as exc:
            raise DiskError(exc.errno, f"disk tier {target}: cannot link the index runs: "
                                       f"{exc.strerror or exc}") from exc

    def verify(self) -> None:
        """Read and check every block of every run (SegmentError naming the first damaged one)."""
        for run in self._runs:
            for _ in run.chunks(CHUNK):
                pass

    def close(self) -> None:
        for run in self._runs:
            run.close()

    def __del__(self) -> None:
        try:
            self.close()
        except (OSError, AttributeError):
            pass

    # -- sizes and stats

    def ram_bytes(self) -> int:
        """RAM the index holds, exact in its arrays: every run's fences and bloom filter, and the memtable's
        hash table (ids, locations, buckets). A run's Python objects (a few hundred bytes) aside."""
        return sum(run.ram_bytes() for run in self._runs) + self._mem.nbytes()

    def disk_bytes(self) -> int:
        """Bytes of the run files in use (not counting replaced ones a committed manifest still lists)."""
        return sum(run.file_bytes for run in self._runs)

    def stats(self) -> dict:
        """Sizes, the counters, and ``reads_per_lookup``: blocks read per id looked up (a cold row's index reads)."""
        return {"entries": self._live, "runs": len(self._runs), "run_entries": [r.entries for r in self._runs],
                "memtable": len(self._mem), "ram_bytes": self.ram_bytes(), "disk_bytes": self.disk_bytes(),
                "reads_per_lookup": self.counters["blocks_read"] / max(1, self.counters["lookups"]), **self.counters}

    # -- internals

    def _new_memtable(self) -> RowTable:
        return RowTable(1, np.uint32, initial_capacity=min(self.memtable_entries, 1024), max_load=0.8,
                        lean_rehash=True)

    def _old(self, ids: np.ndarray, old) -> np.ndarray:
        """The previous locations of ``ids`` (unique, else ValueError): ``old`` checked, or looked up."""
        if len(ids) > 1:
            s = np.sort(ids)
            dup = np.flatnonzero(s[1:] == s[:-1])
            if len(dup):
                raise ValueError(f"row id {int(s[dup[0]])} given twice")
        if old is None:
            return self.lookup(ids)
        old = np.asarray(old)
        if old.shape != ids.shape or (len(old) and (old.min() < 0 or old.max() > EMPTY)):
            raise ValueError(f"{len(ids)} ids, previous locations of shape {old.shape}")
        return old.astype(np.uint32)

    def _put(self, ids: np.ndarray, locs: np.ndarray, old: np.ndarray) -> None:
        """Write entries into the memtable in pieces that fit, flushing it first when the next piece would not."""
        cap = self.memtable_entries
        for lo in range(0, len(ids), cap):
            part, part_locs, part_old = ids[lo:lo + cap], locs[lo:lo + cap], old[lo:lo + cap]
            if len(self._mem) + len(part) > cap:
                self.flush()
            slots = self._mem.ensure(part, lambda new: np.zeros((len(new), 1), np.uint32))
            self._mem.arrays()[0][slots, 0] = part_locs
            was = part_old != EMPTY
            now = part_locs != TOMBSTONE
            self._live += int((now & ~was).sum()) - int((~now & was).sum())

    def _in_runs(self, ids: np.ndarray) -> np.ndarray:
        """A mask of the ``ids`` some run may hold (their bloom filters: no read)."""
        out = np.zeros(len(ids), bool)
        for run in self._runs:
            out |= run.may_hold(ids)
        return out

    def _forget(self, ids: np.ndarray) -> None:
        """Drop present ``ids`` no run holds: their memtable entries go (no tombstone: nothing older to hide)."""
        slots = self._mem.lookup(ids)
        self._mem.remove_slots(slots[slots >= 0])
        self._live -= len(ids)

    def _memtable_sorted(self) -> tuple[np.ndarray, np.ndarray]:
        n = len(self._mem)
        ids = self._mem.row_ids_view()[:n]
        order = np.argsort(ids, kind="stable")
        return ids[order], self._mem.arrays()[0][:n, 0][order]

    def _sources(self, chunk: int) -> list[Iterator[tuple[np.ndarray, np.ndarray]]]:
        """Every run's and the memtable's entries, sorted, in pieces that hold about ``chunk`` entries together."""
        share = max(1, chunk // (len(self._runs) + 1))
        sources = [run.chunks(share) for run in self._runs]
        if len(self._mem):
            mem_ids, mem_locs = self._memtable_sorted()
            sources.append(rechunk(iter([(mem_ids, mem_locs)]), share))
        return sources

    def _write_run(self, stream: Iterator[tuple[np.ndarray, np.ndarray]]) -> Run | None:
        """A new run of the entries of ``stream`` (ascending), or None if it has none; DiskError naming the
        directory if writing fails (no file left, nothing changed)."""
        writer = None
        try:
            writer = RunWriter(self.directory, self._next_number, self.fmt, self.bloom_bits)
            for ids, locs in stream:
                writer.add(ids, locs)
            if not writer.entries:
                writer.abort()
                return None
            run = writer.finish()
        except OSError as exc:
            if writer is not None:
                writer.abort()
            raise DiskError(exc.errno, f"disk tier {self.directory}: cannot write an index run: "
                                       f"{exc.strerror or exc}") from exc
        except BaseException:
            if writer is not None:
                writer.abort()
            raise
        self._next_number += 1
        self.counters["entries_written"] += run.entries
        return run

    def _merge_policy(self) -> None:
        """Merge the newest runs into one while they sum to at least 1/MERGE_RATIO of the run before them."""
        j, total = len(self._runs) - 1, self._runs[-1].entries if self._runs else 0
        while j >= 1 and total * MERGE_RATIO >= self._runs[j - 1].entries:
            j -= 1
            total += self._runs[j].entries
        if len(self._runs) - j >= 2:
            self._merge(j)

    def _merge(self, j: int) -> None:
        """Merge the runs from the ``j``-th on into one. Their filters are freed first, so the output's is built in
        their room (RAM never past what the index holds before or after); read back if the merge fails."""
        inputs = self._runs[j:]
        for old in inputs:
            old.drop_filter()
        try:
            share = max(1, CHUNK // len(inputs))       # (the inputs' pieces held together: about CHUNK entries)
            run = self._write_run(rechunk(merged([r.chunks(share) for r in inputs], drop_tombstones=j == 0), CHUNK))
        except BaseException:
            for old in inputs:
                old.load_filter()
            raise
        self._runs[j:] = [] if run is None else [run]
        self.counters["merges"] += 1
        for old in inputs:
            old.close()
            if old.name in self._committed or old.name in self._handed:
                self._retired.append(old.name)          # a manifest in use lists it: until the next commit
            else:
                old.path.unlink(missing_ok=True)
