"""kvstore_lazy.store.disk.runs off the request thread: the compiled kernels against their numpy reference, a merge
handing its run files over as it goes, and the index as a kill or a power cut leaves it while its background thread
writes."""
from __future__ import annotations

import json
import shutil
import threading
import time

import numpy as np
import pytest

import crashtrace
from kvstore_lazy.store import kernels
from kvstore_lazy.store.disk import runcalls, runfile
from kvstore_lazy.store.disk.errors import DiskError
from kvstore_lazy.store.disk.runs import EMPTY, TOMBSTONE, RunIndex
from test_disk_runs import SMALL, check_all, expect, hashed_ids


def test_the_compiled_filter_sets_the_bits_of_the_numpy_reference():
    rng = np.random.default_rng(0)
    for nblocks, n in [(1, 10), (7, 300), (4096, 50_000)]:
        ids = rng.integers(0, 2**64 - 1, n, dtype=np.uint64, endpoint=True)
        ours, reference = np.zeros((nblocks, 8), np.uint32), np.zeros((nblocks, 8), np.uint32)
        runcalls.runs_bloom_add(ours, ids, runfile._SEED)
        runfile._bloom_add(reference, ids, runfile._SEED)
        np.testing.assert_array_equal(ours, reference)          # (files written by either read by both)
        probes = np.concatenate([ids, rng.integers(0, 2**64 - 1, 4 * n, dtype=np.uint64, endpoint=True)])
        np.testing.assert_array_equal(runcalls.runs_bloom_test(ours, probes, runfile._SEED),
                                      runfile._bloom_test(reference, probes, runfile._SEED))
        assert runcalls.runs_bloom_test(ours, ids, runfile._SEED).all()


@pytest.mark.parametrize("block_bytes", [SMALL, runfile.BLOCK_BYTES])
def test_the_compiled_block_check_is_the_record_check(block_bytes):
    """runcalls.runs_verify (32-bit weights) accepts exactly the blocks Format.bad (kernels.record_checks) does, and
    refuses a wrong count."""
    fmt = runfile.Format(block_bytes)
    rng = np.random.default_rng(7)
    n = 300
    buf = rng.integers(0, 256, (n, block_bytes), dtype=np.uint8)
    numbers = rng.integers(1, 2**32, n, dtype=np.uint64)
    blocks = rng.integers(0, 2**40, n)
    entries = (blocks + 1) * fmt.per_block - rng.integers(0, 2, n) * 5       # some blocks the last of their run
    buf.view(np.uint32)[:, 1] = np.minimum(fmt.per_block, entries - blocks * fmt.per_block)
    kernels.record_seal(buf.view(np.uint32), fmt.mult, fmt.salts(numbers, blocks), 0)
    assert len(fmt.bad(buf, numbers, blocks)) == 0
    assert runcalls.runs_verify(buf, fmt.per_block, fmt.mult32, numbers, blocks, entries) == -1
    for row, byte in [(299, block_bytes - 1), (120, 9), (3, 0)]:
        damaged = buf.copy()
        damaged[row, byte] ^= 0x40
        assert fmt.bad(damaged, numbers, blocks).tolist() == [row]
        assert runcalls.runs_verify(damaged, fmt.per_block, fmt.mult32, numbers, blocks, entries) == row
    other = numbers.copy()
    other[50] += 1                                          # a block of another run: its salt differs
    assert runcalls.runs_verify(buf, fmt.per_block, fmt.mult32, other, blocks, entries) == 50
    fewer = entries.copy()
    fewer[77] -= fmt.per_block                              # its count is wrong for the run's size
    assert runcalls.runs_verify(buf, fmt.per_block, fmt.mult32, numbers, blocks, fewer) == 77


def test_the_compiled_merge_keeps_the_newest_entry_of_each_id():
    rng = np.random.default_rng(1)
    chunks, newest = [], {}
    for _ in range(5):                                      # oldest first
        ids = np.unique(rng.integers(0, 400, 150).astype(np.uint64))
        locs = rng.integers(0, 6, len(ids)).astype(np.uint32)
        locs[locs == 5] = TOMBSTONE
        chunks.append((ids, locs))
        newest.update(zip(ids.tolist(), locs.tolist()))
    for drop in (False, True):
        ids, locs = runcalls.runs_merge(chunks, drop)
        want = sorted((i, v) for i, v in newest.items() if not (drop and v == TOMBSTONE))
        assert ids.tolist() == [i for i, _ in want] and locs.tolist() == [v for _, v in want]
    assert [len(a) for a in runcalls.runs_merge([], False)] == [0, 0]


def test_the_compiled_probe_finds_the_run_and_block_of_each_id(tmp_path):
    """A group of three run files of disjoint ranges: every present id is a candidate in its run's block, an id
    outside every range or at or below ``after`` is not looked at, and the search finds exactly the present ones."""
    fmt = runfile.Format(SMALL)
    rng = np.random.default_rng(2)
    ids = np.sort(hashed_ids(rng, 3000, "2^64"))
    made = []
    for number, part in enumerate(np.array_split(ids, 3), start=1):
        writer = runfile.RunWriter(tmp_path, number, fmt, 10.0)
        writer.add(part, (part & np.uint64(0xFFFF)).astype(np.uint32))
        made.append(writer.finish())
    probe = runfile.Probe(made)
    queries = np.sort(np.concatenate([ids[::3], rng.integers(0, 2**64 - 1, 2000, dtype=np.uint64)]))
    present = np.isin(queries, ids)
    for after in (None, int(ids[1500])):
        counters = {"bloom_negatives": 0, "blocks_read": 0, "bloom_false": 0}
        cand, row, table, block, _ = runcalls.runs_probe(probe.plan, after, queries)
        looked = present & (True if after is None else queries > np.uint64(after))
        assert set(np.flatnonzero(looked)) <= set(cand.tolist())         # never a false negative
        for c, r in zip(cand, row):                                         # each one's block by the fences
            run = made[table[r]]
            assert run.fences[block[r]] <= queries[c] and (block[r] + 1 == run.blocks or
                                                          queries[c] < run.fences[block[r] + 1])
        at, locs = probe(queries, after, counters)
        np.testing.assert_array_equal(at, np.flatnonzero(looked))
        np.testing.assert_array_equal(locs, (queries[at] & np.uint64(0xFFFF)).astype(np.uint32))
        assert counters["blocks_read"] == len(table) and counters["bloom_false"] <= 0.05 * len(queries)


def test_a_merge_hands_over_its_run_files_as_it_goes(tmp_path, monkeypatch):
    """Run on this thread one step at a time: after each run file of the merge's output is taken in, lookups and
    the items are those of the index before it, the runs it covers are gone (their filters freed), and the manifest
    of that instant opens to the same index."""
    monkeypatch.setattr(RunIndex, "_plan_merge", lambda self: None)       # groups of flushes only, for now
    index = RunIndex(tmp_path, memtable_entries=400, block_bytes=SMALL, table_entries=300)
    rng = np.random.default_rng(3)
    universe = hashed_ids(rng, 6000, "2^40")
    ref: dict[int, int] = {}
    for step in range(30):
        ids = rng.choice(universe, 250, replace=False)
        if step % 3 == 2:
            index.remove(ids)
            for i in ids:
                ref.pop(int(i), None)
        else:
            locs = rng.integers(0, TOMBSTONE, len(ids), dtype=np.uint32)
            index.set(ids, locs)
            ref.update(zip(map(int, ids), map(int, locs)))
    index.flush()
    assert index.stats()["groups"] >= 10 and max(index.stats()["run_entries"]) <= 300
    monkeypatch.undo()
    with index._work.cond:          # (held from the submit on: the background thread never takes a step of it)
        index._start_merge(0)                               # everything, tombstones dropped
        job = index._merge
        index._work._todo.remove(job)                       # (not for the background thread: stepped here)
    inputs = [run for group in job.inputs for run in group.runs]
    handed = 0
    for event in index._work._merge_steps(job):
        index._work._events.append(event)
        index._harvest()
        if event[0] == "table":
            handed += 1
            gone = [run for run in inputs if run.last <= event[2].last]
            assert all(run not in index._runs and run.bloom.nbytes == 0 for run in gone)
            assert all(group.after == event[2].last for group in job.inputs)
        check_all(index, ref, universe[:3000])
        manifest = json.loads(json.dumps(index.manifest()))
        copy = tmp_path.parent / f"copy-{handed}-{event[0]}"
        shutil.copytree(tmp_path, copy)
        again = RunIndex.open(copy, manifest, verify=True)
        check_all(again, ref, universe[:3000])
        again.close()
    assert handed >= 5 and index.stats()["groups"] == 1 and index._merge is None
    assert len(index) == len(ref) and sum(index.stats()["run_entries"]) == len(ref)   # no tombstone, no duplicate


def test_tables_of_many_run_files_match_a_dict(tmp_path):
    """Random operations against a dict with run files of a few hundred entries: every flush and merge writes a
    group of several, handed over while the caller goes on."""
    rng = np.random.default_rng(4)
    universe = hashed_ids(rng, 4000, "2^64")
    index = RunIndex(tmp_path, memtable_entries=300, block_bytes=SMALL, table_entries=200)
    ref: dict[int, int] = {}
    for step in range(120):
        ids = rng.choice(universe, int(rng.integers(1, 300)), replace=False)
        if rng.random() < 0.6:
            locs = rng.integers(0, TOMBSTONE, len(ids), dtype=np.uint32)
            np.testing.assert_array_equal(index.set(ids, locs), expect(ref, ids))
            ref.update(zip(map(int, ids), map(int, locs)))
        else:
            np.testing.assert_array_equal(index.remove(ids), expect(ref, ids))
            for i in ids:
                ref.pop(int(i), None)
        if step % 10 == 9:
            np.testing.assert_array_equal(index.lookup(universe), expect(ref, universe))
    check_all(index, ref, universe)
    manifest = index.commit()
    assert any(count > 1 for count, _ in manifest["groups"])
    names = [name for name, _ in manifest["runs"]]
    assert names == sorted(names)           # oldest first is lowest numbered first (a merge takes its numbers early)
    index.close()
    check_all(RunIndex.open(tmp_path, manifest, verify=True), ref, universe)


def copy_now(source, target, durable) -> None:
    """``source`` copied file by file as it stands (crashtrace.copy_state; without ``durable``, a file the
    background thread deletes while it is copied is skipped: it was gone a moment later)."""
    if durable is not None:
        crashtrace.copy_state({"idx": source}, target, durable)
        return
    (target / "idx").mkdir(parents=True)
    for file in source.iterdir():
        try:
            shutil.copyfile(file, target / "idx" / file.name)
        except FileNotFoundError:
            (target / "idx" / file.name).unlink(missing_ok=True)


def busy_index(tmp_path, rng, universe):
    """An index committed once, then driven by a thread (sets and removes: background flushes and merges of
    groups of many run files) until the returned event is set; (the committed manifest, its contents)."""
    index = RunIndex(tmp_path, memtable_entries=200, block_bytes=SMALL, table_entries=150)
    ref = {}
    for lo in range(0, 3000, 250):
        ids = universe[lo:lo + 250]
        index.set(ids, np.arange(lo, lo + len(ids), dtype=np.uint32))
        ref.update(zip(map(int, ids), range(lo, lo + len(ids))))
    manifest = json.loads(json.dumps(index.commit()))
    index.committed(manifest)
    stop = threading.Event()

    def drive():
        while not stop.is_set():
            ids = rng.choice(universe, 200, replace=False)
            if rng.random() < 0.7:
                index.set(ids, rng.integers(0, TOMBSTONE, len(ids), dtype=np.uint32))
            else:
                index.remove(ids)

    driver = threading.Thread(target=drive)
    driver.start()
    return index, manifest, ref, stop, driver


@pytest.mark.parametrize("power_cut", [False, True], ids=["kill", "power-cut"])
def test_the_committed_index_survives_a_crash_at_any_instant_of_the_background_thread(tmp_path, power_cut):
    """The directory copied at instants while flushes and merges are written (a SIGKILL then; with power_cut, every
    file as of its last fsync, by any thread: crashtrace.Durable) opens with the committed manifest to exactly its
    contents, and nothing it does not list is left."""
    rng = np.random.default_rng(5)
    universe = hashed_ids(rng, 6000, "2^40")
    durable = crashtrace.Durable() if power_cut else None
    tracer = crashtrace.Tracer(lambda point, when: None, durable)
    live = tmp_path / "live"
    with tracer:
        index, manifest, ref, stop, driver = busy_index(live, rng, universe)
        states = []
        try:
            for i in range(25):
                time.sleep(0.02)
                state = tmp_path / f"state-{i}"
                copy_now(live, state, durable)
                states.append(state / "idx")
        finally:
            stop.set()
            driver.join()
        merges = index.counters["merges"]
        index.close()
    assert merges > 0
    for state in states:
        again = RunIndex.open(state, manifest, verify=True)
        check_all(again, ref, universe[:3500])
        assert {p.name for p in state.iterdir()} == {name for name, _ in manifest["runs"]}
        again.close()


def test_a_write_that_fails_in_the_background_is_raised_at_the_next_call_and_loses_nothing(tmp_path, monkeypatch):
    index = RunIndex(tmp_path, memtable_entries=100, block_bytes=SMALL, table_entries=60)
    calls = {"n": 0}
    finish = runfile.RunWriter.finish

    def second_fails(writer):               # a flush's second run file (of 60 entries each)
        calls["n"] += 1
        if calls["n"] == 2:
            raise OSError(28, "No space left on device")
        return finish(writer)

    index.set(np.array([10**6], np.uint64), np.array([5], np.uint32))
    index.flush()                                   # (the index's first run, written and waited for; not later ones)
    monkeypatch.setattr(runfile.RunWriter, "finish", second_fails)
    ids = np.arange(1, 161, dtype=np.uint64)
    index.set(ids[:100], np.arange(100, dtype=np.uint32))
    index.set(ids[100:], np.arange(100, 160, dtype=np.uint32))     # the first 100 go to be written
    with pytest.raises(DiskError, match=str(tmp_path)):
        index.settle()
    assert index.stats()["frozen"] == 100 and index.stats()["runs"] == 1
    assert [p.name for p in tmp_path.iterdir()] == [index._runs[0].name]     # (its first file, written, removed)
    np.testing.assert_array_equal(index.lookup(ids), np.arange(160))
    index.flush()                                                   # written again, the rest too, merged
    assert index.stats()["frozen"] == 0 and index.stats()["run_entries"] == [60, 60, 41]
    np.testing.assert_array_equal(index.lookup(np.append(ids, 999)), np.append(np.arange(160), EMPTY))
    assert {p.name for p in tmp_path.iterdir()} == {run.name for run in index._runs}


def test_a_run_of_whole_write_batches_is_written_and_read_back(tmp_path):
    """A run whose entries fill its last write batch exactly (nothing left for the final write) is whole."""
    fmt = runfile.Format(SMALL)
    n = runfile.RunWriter.WRITE_BLOCKS * fmt.per_block * 2
    ids = np.arange(n, dtype=np.uint64) * np.uint64(3)
    writer = runfile.RunWriter(tmp_path, 1, fmt, 10.0)
    for part in np.array_split(ids, 7):
        writer.add(part, (part % np.uint64(1000)).astype(np.uint32))
    run = writer.finish()
    again = runfile.open_run(run.path, fmt)
    got = [np.concatenate(parts) for parts in zip(*again.chunks(1000))]
    np.testing.assert_array_equal(got[0], ids)
    np.testing.assert_array_equal(got[1], (ids % np.uint64(1000)).astype(np.uint32))
    again.close()


def test_the_cache_of_lookups_answers_repeats_and_never_a_stale_location(tmp_path):
    index = RunIndex(tmp_path, memtable_entries=100, block_bytes=SMALL, cache_entries=1 << 10)
    ids = np.arange(1, 301, dtype=np.uint64) * np.uint64(7919)
    index.set(ids, np.arange(300, dtype=np.uint32))
    index.flush()
    np.testing.assert_array_equal(index.lookup(ids[:50]), np.arange(50))
    reads, hits = index.counters["blocks_read"], index.counters["cache_hits"]
    np.testing.assert_array_equal(index.lookup(ids[:50]), np.arange(50))     # again: from the cache
    assert index.counters["blocks_read"] == reads and index.counters["cache_hits"] == hits + 50
    index.set(ids[:20], np.full(20, 999, np.uint32))             # newer: in the memtable, looked at first
    np.testing.assert_array_equal(index.lookup(ids[:50]), np.r_[np.full(20, 999), np.arange(20, 50)])
    index.remove(ids[20:30])
    index.flush()                                                   # moved into the runs: the cache is emptied
    want = np.r_[np.full(20, 999), np.full(10, EMPTY), np.arange(30, 50)]
    np.testing.assert_array_equal(index.lookup(ids[:50]), want)
    np.testing.assert_array_equal(index.lookup(ids[:50]), want)
    ram = index.ram_bytes()
    assert index._cache.nbytes() == 12 << 10 and ram >= 12 << 10


def test_a_removed_id_stays_removed_after_a_merge_fails_and_the_next_one_starts(tmp_path, monkeypatch):
    """A merge of every group (its output drops tombstones) fails after handing over its first run file: its inputs
    answer only above that file's last id. The next merge's first file may end below it: the inputs' cut-off is
    never lowered, else an input's run straddling it answers again for an id whose tombstone the failed merge's
    retired runs held (its stale location served as live). Events stepped on this thread, as above."""
    monkeypatch.setattr(RunIndex, "_plan_merge", lambda self: None)        # merges started by hand below
    idx = RunIndex(tmp_path, memtable_entries=1000, block_bytes=256, table_entries=50)
    first = np.arange(0, 2000, 10, dtype=np.uint64)
    idx.set(first, np.arange(len(first), dtype=np.uint32))
    idx.flush()
    idx.remove(np.array([300], np.uint64))
    idx.set(np.arange(301, 310, dtype=np.uint64), np.zeros(9, np.uint32))
    idx.flush()
    assert idx.lookup([300]).tolist() == [EMPTY]

    def merge_steps():
        with idx._work.cond:        # (held from the submit on: the background thread never takes a step of it)
            idx._start_merge(0)
            job = idx._merge
            idx._work._todo.remove(job)
        return job, idx._work._merge_steps(job)

    job, steps = merge_steps()
    for event in steps:                                     # the first run file handed over, then a full disk
        idx._work._events.append(event)
        idx._harvest()
        if event[0] == "table":
            break
    idx._work._events.append(("failed", job, DiskError(28, "disk full")))
    with pytest.raises(DiskError):
        idx._harvest()
    assert idx.lookup([300]).tolist() == [EMPTY]
    low = np.array([i for i in range(1, 100) if i % 10], np.uint64)   # a group below the cut-off
    idx.set(low, np.zeros(len(low), np.uint32))
    idx._freeze()
    idx._harvest(wait_for=idx._flush)
    _, steps = merge_steps()
    idx._work._events.append(next(steps))                   # the next merge's first file ends below 300
    idx._harvest()
    idx._cache.clear()
    assert idx.lookup([300]).tolist() == [EMPTY]
    assert idx.lookup(np.arange(301, 310, dtype=np.uint64)).tolist() == [0] * 9


def test_merges_on_the_background_thread_leave_no_io_uring_open(tmp_path):
    """The background thread ends when idle and a thread's io_uring outlives it: a merge reads its inputs' blocks
    (consecutive, one read a file) without one, so merge after merge opens no descriptor that stays."""
    import os

    def rings() -> int:
        found = 0
        for fd in os.listdir("/proc/self/fd"):
            try:
                found += "io_uring" in os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                pass
        return found
    idx = RunIndex(tmp_path, memtable_entries=2000, block_bytes=512, table_entries=4000)
    rng = np.random.default_rng(0)
    before = rings()
    for _ in range(60):
        ids = np.unique(rng.integers(0, 10 ** 9, 2000).astype(np.uint64))
        idx.set(ids, np.arange(len(ids), dtype=np.uint32), old=np.full(len(ids), EMPTY, np.uint32))
        idx.settle()
    assert idx.counters["merges"] >= 20
    assert rings() == before
