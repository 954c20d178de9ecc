"""The disk index's work off the request thread, and the pieces of its state it shares with it.

Owns: :class:`Worker` (the background thread of one :class:`~.runs.RunIndex`: the jobs it is given, a flush (a
frozen memtable sorted and written) before any step of a merge (groups merged into one, handed over a run file at a
time), the events it hands back, the run numbers it takes), :class:`Group` (run files of disjoint id ranges written
by one flush or merge, and the id a group answers above while a merge takes it in), and :class:`Recent` (the cache
of recent lookups). Does not own: a run file's bytes or the merge of sorted streams (:mod:`.runfile`), or what the
index does with an event, when it asks for a job, or the manifest (:mod:`.runs`).

The thread is started when a job is given and ends when it has none (an index at rest holds no thread). Its loops
are compiled calls that release the GIL (the merge, the checks, the filter, the reads and writes), so a merge runs on
another core while the request thread serves. Nothing it does changes the caller's state: it writes new run files
(temp file, fsync, rename, fsync of the directory: durable before they are handed over) and appends events
(``("flushed", job, runs)``, ``("table", job, run)`` for each run file of a merge, ``("merged", job)``,
``("failed", job, exception)``) that the caller takes in, in order, at its next call (:meth:`Worker.next_event`).
:meth:`Worker.stop` drops what it was writing (its temp file removed).
"""
from __future__ import annotations

import threading
from collections import deque
from collections.abc import Generator, Iterator
from pathlib import Path

import numpy as np

from kvstore_lazy.store.arena import release_free_memory
from kvstore_lazy.store.disk import runcalls
from kvstore_lazy.store.disk.errors import DiskError
from kvstore_lazy.store.disk.runfile import EMPTY, Format, Probe, Run, RunWriter, merged, rechunk

CHUNK = 1 << 16                     # entries a merge holds of all its inputs together


class Group:
    """Runs of disjoint id ranges, ascending, written by one flush or merge; while a merge takes it in, it answers
    only the ids above ``after`` (the merge's output holds the others)."""

    def __init__(self, runs: list[Run], after=None) -> None:
        self.runs, self.after = list(runs), after
        self._probe: Probe | None = None

    @property
    def entries(self) -> int:
        return sum(run.entries for run in self.runs)

    def probe(self) -> Probe:
        if self._probe is None:
            self._probe = Probe(self.runs)
        return self._probe

    def changed(self) -> None:
        self._probe = None

    def stream(self, chunk: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """Its entries (above ``after``) as they are now, ascending, about ``chunk`` at a time (a run let go of
        once read: a merge keeps no run it has read open)."""
        runs, after = deque(self.runs), self.after
        while runs:
            yield from runs.popleft().chunks(chunk, after)

    def may_hold(self, ids: np.ndarray) -> np.ndarray:
        """A mask of the ``ids`` (ascending) one of its runs may hold (id range and filter: no read)."""
        out = np.zeros(len(ids), bool)
        if self.runs and len(ids):
            out[runcalls.runs_probe(self.probe().plan, None, ids)[0]] = True
        return out


class Job:
    """A flush (the frozen memtable's ids and locations) or a merge (input groups, the output group; tombstones
    dropped with ``drop``) for the background thread; ``steps`` (made there) yields its events."""

    def __init__(self, kind: str, ids=None, locs=None, inputs: list[Group] | None = None,
                 output: Group | None = None, drop: bool = False) -> None:
        self.kind, self.ids, self.locs = kind, ids, locs
        self.inputs, self.output, self.drop = inputs or [], output, drop
        self.steps: Generator | None = None
        self.numbers: Iterator[int] | None = None       # a merge's: taken when it starts (see RunIndex._start_merge)
        self.ended = False          # (set by the caller's thread when it takes in the job's last event)


class Stopped(Exception):
    """The index is closing: the background thread drops what it was writing."""


class Recent:
    """Locations the runs gave for ids looked up lately: a direct-mapped table of ``entries`` (a power of two)
    slots, an id's slot the top bits of its Fibonacci hash, the newest id there wins; EMPTY marks an empty slot.
    Valid while the runs' content is (runs.py: every later change of an id is in a memtable, looked at first; a
    flush empties it). Its arrays are made at the first put (an index without runs needs none)."""

    def __init__(self, entries: int) -> None:
        self.entries = entries
        self.ids = np.zeros(0, np.uint64)
        self.locs = np.zeros(0, np.uint32)
        self.shift = 64 - max(1, entries.bit_length() - 1)

    def get(self, ids: np.ndarray) -> np.ndarray:
        """The location held for each of ``ids``, EMPTY where none is."""
        if not len(self.ids):
            return np.full(len(ids), EMPTY, np.uint32)
        return runcalls.runs_cache_get(self.ids, self.locs, self.shift, ids)

    def put(self, ids: np.ndarray, locs: np.ndarray) -> None:
        if self.entries and not len(self.ids):
            self.ids, self.locs = np.zeros(self.entries, np.uint64), np.full(self.entries, EMPTY, np.uint32)
        if len(self.ids):
            runcalls.runs_cache_put(self.ids, self.locs, self.shift, ids, locs)

    def clear(self) -> None:
        self.locs.fill(EMPTY)

    def nbytes(self) -> int:
        return self.ids.nbytes + self.locs.nbytes


def memtable_order(ids: np.ndarray, locs: np.ndarray) -> np.ndarray:
    """The positions of a memtable's entries (``ids`` unique, their ``locs``) by id, its emptied ones (:data:`EMPTY`:
    ids no run holds, removed) left out."""
    order = np.argsort(ids)                     # (unique ids: no need of a stable sort)
    return order[locs[order] != EMPTY]


class Worker:
    """The background thread of the index of ``directory``: run files of at most ``table_entries`` entries in
    ``fmt`` with ``bloom_bits`` bits of filter an entry, numbered from ``next_number`` on."""

    def __init__(self, directory: Path, fmt: Format, bloom_bits: float, table_entries: int,
                 next_number: int = 1) -> None:
        self.directory, self.fmt, self.bloom_bits, self.table_entries = directory, fmt, bloom_bits, table_entries
        self.cond = threading.Condition()
        self._next_number = next_number
        self._todo: list[Job] = []
        self._events: deque = deque()
        self._thread: threading.Thread | None = None
        self.stopping = False

    # -- the caller's side

    def next_number(self) -> int:
        """The number the next run file written will have."""
        with self.cond:
            return self._next_number

    def take_number(self, count: int = 1) -> int:
        """The first of ``count`` numbers for run files, taken."""
        with self.cond:
            number = self._next_number
            self._next_number += count
            return number

    def submit(self, job: Job) -> None:
        with self.cond:
            self._todo.append(job)
            if self._thread is None:
                self._thread = threading.Thread(target=self._work, name=f"runs {self.directory.name}", daemon=True)
                self._thread.start()
            self.cond.notify_all()

    def next_event(self, wait_for: Job | None = None) -> tuple | None:
        """The oldest event not taken in yet; with ``wait_for``, waits for one while that job is under way. None if
        there is none (to wait for)."""
        with self.cond:
            while not self._events and wait_for is not None and wait_for in self._todo:
                self.cond.wait()
            return self._events.popleft() if self._events else None

    def stop(self) -> list[tuple]:
        """Stop the thread (what it was writing dropped) and return the events never taken in."""
        with self.cond:
            self.stopping = True
            thread = self._thread
            self.cond.notify_all()
        if thread is not None and thread is not threading.current_thread():
            thread.join()
        events, self._events = list(self._events), deque()
        return events

    # -- the thread

    def _work(self) -> None:
        """Runs jobs step by step, a flush before any step of a merge; ends when there is nothing to do."""
        while True:
            with self.cond:
                job = next((j for j in self._todo if j.kind == "flush"), self._todo[0] if self._todo else None)
                if job is None or self.stopping:
                    for j in self._todo:
                        if j.steps is not None:
                            j.steps.close()     # (its writer's temp file removed)
                    self._thread = None
                    self.cond.notify_all()
                    return
            if job.steps is None:
                job.steps = self._flush_steps(job) if job.kind == "flush" else self._merge_steps(job)
            try:
                event = next(job.steps)
                final = event[0] != "table"
            except Stopped:
                continue
            except BaseException as exc:            # handed to the caller's thread
                event, final = ("failed", job, exc), True
            if final:
                job.steps.close()                   # (its readers let go of the runs they read)
                release_free_memory()    # (a job's temporaries: this thread's arena's free heap, among all)
            with self.cond:
                if final:
                    self._todo.remove(job)
                self._events.append(event)
                self.cond.notify_all()

    def _flush_steps(self, job: Job) -> Generator[tuple, None, None]:
        order = memtable_order(job.ids, job.locs)
        parts = np.array_split(order, max(1, -(-len(order) // CHUNK)))
        sorted_parts = ((job.ids[part], job.locs[part]) for part in parts)
        runs: list[Run] = []                        # (gathered a chunk at a time: no sorted copy of the memtable)
        try:
            runs.extend(self._tables(sorted_parts))
        except BaseException:
            for run in runs:                    # a part of the memtable, written: it goes (written again whole)
                run.close()
                run.path.unlink(missing_ok=True)
            raise
        yield ("flushed", job, runs)

    def _merge_steps(self, job: Job) -> Generator[tuple, None, None]:
        share = max(1, CHUNK // len(job.inputs))        # (the inputs' pieces held together: about CHUNK entries)
        sources = [group.stream(share) for group in job.inputs]
        for run in self._tables(rechunk(merged(sources, drop_tombstones=job.drop), CHUNK), job.numbers):
            yield ("table", job, run)
        yield ("merged", job)

    def _tables(self, stream: Iterator[tuple[np.ndarray, np.ndarray]], numbers: Iterator[int] | None = None
                ) -> Iterator[Run]:
        """The entries of ``stream`` (ascending) written as run files of at most ``table_entries`` (numbered from
        ``numbers``, else as they are taken), each yielded once durable; DiskError naming the directory if a write
        fails (its temp file removed)."""
        writer = None
        try:
            for ids, locs in stream:
                if self.stopping:
                    raise Stopped
                while len(ids):
                    if writer is None:
                        number = self.take_number() if numbers is None else next(numbers)
                        writer = RunWriter(self.directory, number, self.fmt, self.bloom_bits)
                    room = self.table_entries - writer.entries
                    writer.add(ids[:room], locs[:room])
                    ids, locs = ids[room:], locs[room:]
                    if writer.entries >= self.table_entries:
                        run, writer = writer.finish(), None
                        yield run
            if writer is not None and writer.entries:
                run, writer = writer.finish(), None
                yield run
        except OSError as exc:
            raise DiskError(exc.errno, f"disk tier {self.directory}: cannot write an index run: "
                                       f"{exc.strerror or exc}") from exc
        finally:
            if writer is not None:
                writer.abort()
