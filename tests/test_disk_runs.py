"""kvstore_lazy.store.disk.runs: the LSM disk index against a plain dict, its files, its RAM and its reads."""
from __future__ import annotations

import errno
import json
import os

import numpy as np
import pytest

from kvstore_lazy.store.disk import runfile, runs, runwork
from kvstore_lazy.store.disk.errors import DiskError, SegmentError
from kvstore_lazy.store.disk.layout import RecordLayout
from kvstore_lazy.store.disk.runs import EMPTY, TOMBSTONE, RunIndex

SMALL = 256                         # bytes a block in most tests: 20 entries, so a few thousand ids make many blocks


def hashed_ids(rng: np.random.Generator, n: int, space: str) -> np.ndarray:
    """``n`` distinct ids: hashed over 2^40, spread over all of uint64, or packed at both ends of it."""
    if space == "2^40":
        ids = rng.integers(0, 1 << 40, 2 * n, dtype=np.uint64)
    elif space == "edges":
        ids = np.concatenate([np.arange(n, dtype=np.uint64),
                              np.uint64(2**64 - 1) - np.arange(n, dtype=np.uint64)])
    else:
        ids = rng.integers(0, 2**64 - 1, 2 * n, dtype=np.uint64, endpoint=True)
    ids = np.unique(ids)
    rng.shuffle(ids)
    return ids[:n]


def expect(ref: dict, ids: np.ndarray) -> np.ndarray:
    return np.array([ref.get(int(i), EMPTY) for i in ids], np.uint32)


def check_all(index: RunIndex, ref: dict, universe: np.ndarray, chunk: int = 97) -> None:
    assert len(index) == len(ref)
    np.testing.assert_array_equal(index.lookup(universe), expect(ref, universe))
    parts = list(index.items(chunk))
    assert all(0 < len(ids) <= chunk for ids, _ in parts)
    ids = np.concatenate([p[0] for p in parts]) if parts else np.zeros(0, np.uint64)
    locs = np.concatenate([p[1] for p in parts]) if parts else np.zeros(0, np.uint32)
    want = np.array(sorted(ref), np.uint64)
    np.testing.assert_array_equal(ids, want)
    np.testing.assert_array_equal(locs, expect(ref, want))


@pytest.mark.parametrize("space,seed", [("2^40", 1), ("2^64", 2), ("edges", 3), ("2^40", 4)])
def test_random_operations_match_a_dict(tmp_path, space, seed):
    rng = np.random.default_rng(seed)
    universe = hashed_ids(rng, 3000, space)
    index = RunIndex(tmp_path, memtable_entries=int(rng.integers(50, 400)), block_bytes=SMALL)
    ref: dict[int, int] = {}
    committed: tuple[dict, dict] | None = None
    for step in range(150):
        op = rng.choice(["set", "set", "remove", "lookup", "flush", "commit", "reopen", "crash"],
                        p=[0.35, 0.1, 0.25, 0.1, 0.05, 0.07, 0.04, 0.04])
        ids = rng.choice(universe, int(rng.integers(0, 300)), replace=False)
        if op == "set":
            locs = rng.integers(0, TOMBSTONE, len(ids), dtype=np.uint32)
            np.testing.assert_array_equal(index.set(ids, locs), expect(ref, ids))
            ref.update(zip(map(int, ids), map(int, locs)))
        elif op == "remove":
            np.testing.assert_array_equal(index.remove(ids), expect(ref, ids))
            for i in ids:
                ref.pop(int(i), None)
        elif op == "lookup":
            twice = np.concatenate([ids, ids[: len(ids) // 2]])      # repeats are fine for a lookup
            np.testing.assert_array_equal(index.lookup(twice), expect(ref, twice))
        elif op == "flush":
            index.flush()
        elif op == "commit":
            manifest = index.commit()
            manifest = json.loads(json.dumps(manifest))                 # what a commit file holds
            index.committed(manifest)
            committed = (manifest, dict(ref))
        elif op in ("reopen", "crash"):
            if op == "reopen":
                manifest = index.commit()
                index.committed(manifest)
                committed = (manifest, dict(ref))
            if committed is None:
                continue
            index.close()                       # a crash: whatever was written since the manifest is left behind
            index = RunIndex.open(tmp_path, committed[0], memtable_entries=index.memtable_entries, verify=True)
            ref = dict(committed[1])
            listed = {name for name, _ in committed[0]["runs"]}
            assert {p.name for p in tmp_path.iterdir()} == listed
        assert len(index) == len(ref), (step, op)
    check_all(index, ref, universe)
    assert index.counters["merges"] > 0 and index.counters["flushes"] > 0
    assert len(index.stats()["run_entries"]) <= 8


def test_empty_index(tmp_path):
    index = RunIndex(tmp_path / "idx")
    assert len(index) == 0 and list(index.items()) == []
    ids = np.array([0, 5, 2**64 - 1], np.uint64)
    np.testing.assert_array_equal(index.lookup(ids), [EMPTY] * 3)
    np.testing.assert_array_equal(index.remove(ids), [EMPTY] * 3)
    assert len(index.lookup(np.zeros(0, np.uint64))) == 0
    assert len(index.set(np.zeros(0, np.uint64), np.zeros(0, np.uint32))) == 0
    manifest = index.commit()
    assert manifest["runs"] == [] and manifest["live"] == 0
    again = RunIndex.open(tmp_path / "idx", manifest, verify=True)
    assert len(again) == 0 and again.disk_bytes() == 0
    np.testing.assert_array_equal(again.lookup(ids), [EMPTY] * 3)


def test_bad_input_is_refused_and_changes_nothing(tmp_path):
    index = RunIndex(tmp_path, memtable_entries=8, block_bytes=SMALL)
    index.set(np.arange(20, dtype=np.uint64), np.arange(20, dtype=np.uint32))
    before = index.stats()
    with pytest.raises(ValueError, match="twice"):
        index.set(np.array([30, 31, 30], np.uint64), np.zeros(3, np.uint32))
    with pytest.raises(ValueError, match="twice"):
        index.remove(np.array([1, 2, 1], np.uint64))
    with pytest.raises(ValueError, match="locations"):
        index.set(np.array([40, 41], np.uint64), np.array([1, TOMBSTONE], np.uint32))
    with pytest.raises(ValueError, match="locations"):
        index.set(np.array([40], np.uint64), np.array([EMPTY], np.uint32))
    with pytest.raises(ValueError):
        index.set(np.array([40, 41], np.uint64), np.zeros(3, np.uint32))
    assert index.stats() == before
    np.testing.assert_array_equal(index.lookup(np.array([30, 40, 1], np.uint64)), [EMPTY, EMPTY, 1])
    with pytest.raises(SegmentError, match="already holds"):
        RunIndex(tmp_path)
    with pytest.raises(SegmentError, match="not a"):
        RunIndex.open(tmp_path, {"format": "something else"})


def test_known_previous_locations_skip_the_lookup(tmp_path):
    index = RunIndex(tmp_path, memtable_entries=50, block_bytes=SMALL)
    ids = np.arange(200, dtype=np.uint64)
    np.testing.assert_array_equal(index.set(ids, ids.astype(np.uint32), old=np.full(200, EMPTY, np.uint32)), EMPTY)
    assert index.counters["lookups"] == 0 and len(index) == 200
    moved = ids[::3]                                            # a compaction moving records it knows live
    index.set(moved, moved.astype(np.uint32) + 1000, old=moved.astype(np.uint32))
    gone = ids[1::3]
    index.remove(gone, old=index.lookup(gone))                  # a promotion that has just looked them up
    assert index.counters["lookups"] == len(gone) and len(index) == 200 - len(gone)
    ref = {int(i): int(i) + (1000 if i % 3 == 0 else 0) for i in ids if i % 3 != 1}
    check_all(index, ref, np.arange(300, dtype=np.uint64))
    with pytest.raises(ValueError, match="previous"):
        index.set(ids[:2], np.zeros(2, np.uint32), old=np.zeros(3, np.uint32))


def test_the_tombstone_is_no_location_a_segment_store_uses():
    for rows in (2, 1 << 10, 1 << 16):
        layout = RecordLayout(np.dtype([("w", "<f4", (4,))]), rows)
        assert ((layout.max_slots - 1) << layout.shift) | (rows - 1) < TOMBSTONE


def build(tmp_path, n: int, memtable: int = 1000, block_bytes: int = SMALL, seed: int = 0):
    rng = np.random.default_rng(seed)
    ids = hashed_ids(rng, n, "2^64")
    index = RunIndex(tmp_path, memtable_entries=memtable, block_bytes=block_bytes)
    for lo in range(0, n, 500):
        index.set(ids[lo:lo + 500], np.arange(lo, min(lo + 500, n), dtype=np.uint32))
    index.flush()                                   # (and the merges the background thread was asked for)
    return index, ids


def flip(path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x10]))


def test_a_damaged_run_is_refused_by_name(tmp_path):
    index, ids = build(tmp_path, 5000)
    manifest = index.commit()
    index.close()
    name = manifest["runs"][0][0]
    run = tmp_path / name
    flip(run, 3 * SMALL + 100)                      # inside data block 3
    reopened = RunIndex.open(tmp_path, manifest)    # (the footer, fences and filter are fine)
    with pytest.raises(SegmentError, match=rf"{name}: block 3 is damaged"):
        reopened.lookup(ids)
    with pytest.raises(SegmentError, match=rf"{name}: block 3 is damaged"):
        list(reopened.items())
    reopened.close()
    with pytest.raises(SegmentError, match=rf"{name}: block 3 is damaged"):
        RunIndex.open(tmp_path, manifest, verify=True)
    flip(run, 3 * SMALL + 100)                      # back as it was
    size = run.stat().st_size
    blocks = -(-5000 // ((SMALL - 8) // 12))
    fences_end = (blocks + -(-8 * blocks // SMALL)) * SMALL
    for where, what in [(size - SMALL + 20, "footer"), (blocks * SMALL + 3, "fences"),
                        (fences_end + 5, "bloom filter")]:
        flip(run, where)
        with pytest.raises(SegmentError, match=rf"{name}.*({what})"):
            RunIndex.open(tmp_path, manifest)
        flip(run, where)
    os.truncate(run, size - SMALL)
    with pytest.raises(SegmentError, match=name):
        RunIndex.open(tmp_path, manifest)
    os.truncate(run, size)
    twice = dict(manifest, runs=manifest["runs"] * 2)
    with pytest.raises(SegmentError, match="twice"):
        RunIndex.open(tmp_path, twice)
    run.unlink()
    with pytest.raises(SegmentError, match=name):
        RunIndex.open(tmp_path, manifest)


def test_a_block_read_from_another_place_fails_its_check(tmp_path):
    index, ids = build(tmp_path, 3000)
    manifest = index.commit()
    index.close()
    run = tmp_path / manifest["runs"][0][0]
    data = bytearray(run.read_bytes())
    data[SMALL:2 * SMALL], data[2 * SMALL:3 * SMALL] = data[2 * SMALL:3 * SMALL], data[SMALL:2 * SMALL]
    run.write_bytes(bytes(data))
    with pytest.raises(SegmentError, match="block 1 is damaged"):
        RunIndex.open(tmp_path, manifest, verify=True)


def test_a_failed_write_is_a_disk_error_naming_the_directory_and_changes_nothing(tmp_path, monkeypatch):
    index = RunIndex(tmp_path, memtable_entries=100, block_bytes=SMALL)
    index.set(np.arange(90, dtype=np.uint64), np.arange(90, dtype=np.uint32))
    ref = {i: i for i in range(90)}
    before = index.stats()

    def full(fd, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(runfile, "write_all", full)
    with pytest.raises(DiskError, match=str(tmp_path)):
        index.set(np.arange(100, 120, dtype=np.uint64), np.ones(20, np.uint32))  # the index's first run: waited for
    with pytest.raises(DiskError, match=str(tmp_path)):
        index.commit()                                  # (written again: fails again)
    after = index.stats()
    assert after.pop("lookups") == before.pop("lookups") + 20      # (the set looked its ids up)
    assert after.pop("frozen") == 90 and after.pop("memtable") == 0 and after.pop("entries") == 90
    for key in ("frozen", "memtable", "entries", "ram_bytes"):
        before.pop(key), after.pop(key, None)
    assert after == before and list(tmp_path.iterdir()) == []
    index.set(np.arange(100, 120, dtype=np.uint64), np.ones(20, np.uint32))    # (the memtable has room)
    ref.update({i: 1 for i in range(100, 120)})
    check_all(index, ref, np.arange(200, dtype=np.uint64))              # nothing lost: the memtable is kept
    monkeypatch.undo()
    index.flush()
    assert index.stats()["frozen"] == 0 and index.stats()["memtable"] == 0
    index.set(np.arange(120, 145, dtype=np.uint64), np.ones(25, np.uint32))
    ref.update({i: 1 for i in range(120, 145)})
    finish, merge_number = runfile.RunWriter.finish, index._work.next_number() + 1

    def merge_fails(writer):
        if writer.number == merge_number:
            raise OSError(errno.ENOSPC, "No space left on device")
        return finish(writer)

    monkeypatch.setattr(runfile.RunWriter, "finish", merge_fails)
    with pytest.raises(DiskError, match=str(tmp_path)):
        index.flush()                                   # runs of 90, 20 and now 25: a merge of all three fails
    monkeypatch.undo()
    assert index.stats()["run_entries"] == [90, 20, 25] and len(index) == 135 and not index.stats()["merging"]
    assert {p.name for p in tmp_path.iterdir()} == {run.name for run in index._runs}   # (no temp file left)
    check_all(index, ref, np.arange(200, dtype=np.uint64))
    index.remove(np.arange(120, 145, dtype=np.uint64))
    index.set(np.arange(120, 140, dtype=np.uint64), np.ones(20, np.uint32))
    ref.update({i: 1 for i in range(120, 140)})
    for i in range(140, 145):
        ref.pop(i)
    manifest = index.commit()
    check_all(RunIndex.open(tmp_path, manifest), ref, np.arange(200, dtype=np.uint64))


def test_replaced_runs_are_deleted_after_the_next_commit_only(tmp_path):
    index = RunIndex(tmp_path, memtable_entries=100, block_bytes=SMALL)
    index.set(np.arange(400, dtype=np.uint64), np.arange(400, dtype=np.uint32))
    m1 = index.commit()
    index.committed(m1)
    first = {name for name, _ in m1["runs"]}
    ids = np.arange(200, 900, dtype=np.uint64)
    index.set(ids[::2], np.full(350, 7, np.uint32))         # flushes and merges that replace m1's runs
    index.remove(np.arange(0, 100, dtype=np.uint64))
    index.flush()
    assert index.counters["merges"] >= 2
    assert first <= {p.name for p in tmp_path.iterdir()}    # m1 is still the commit point: its runs stay
    m2 = index.commit()
    assert first <= {p.name for p in tmp_path.iterdir()}    # (m2 is not committed yet)
    index.committed(m2)
    assert {p.name for p in tmp_path.iterdir()} == {name for name, _ in m2["runs"]}
    ref = {i: 7 if i >= 200 and i % 2 == 0 else i for i in range(100, 400)}
    ref.update({i: 7 for i in range(400, 900, 2)})
    check_all(RunIndex.open(tmp_path, m2, verify=True), ref, np.arange(1000, dtype=np.uint64))


def test_reopening_an_older_manifest_after_a_crash(tmp_path):
    index = RunIndex(tmp_path, memtable_entries=100, block_bytes=SMALL)
    index.set(np.arange(400, dtype=np.uint64), np.arange(400, dtype=np.uint32))
    m1 = index.commit()
    index.committed(m1)
    index.set(np.arange(400, 1400, dtype=np.uint64), np.arange(1000, dtype=np.uint32))
    index.remove(np.arange(0, 400, 3, dtype=np.uint64))
    index.commit()                                          # handed out, never committed by the caller
    index.set(np.arange(2000, 2300, dtype=np.uint64), np.arange(300, dtype=np.uint32))
    (tmp_path / (runfile.run_name(999) + runfile.TEMP_SUFFIX)).write_bytes(b"torn")
    index.close()
    again = RunIndex.open(tmp_path, m1, verify=True)
    check_all(again, {i: i for i in range(400)}, np.arange(2500, dtype=np.uint64))
    assert {p.name for p in tmp_path.iterdir()} == {name for name, _ in m1["runs"]}


def test_a_snapshot_links_the_runs(tmp_path):
    from kvstore_lazy.store.disk import commit
    live, snap = tmp_path / "live", tmp_path / "snap"
    index = RunIndex(live, memtable_entries=100, block_bytes=SMALL)
    index.set(np.arange(500, dtype=np.uint64), np.arange(500, dtype=np.uint32))
    manifest = index.commit()
    snap.mkdir()
    commit._link_runs(live, manifest, snap)
    for name, _ in manifest["runs"]:
        assert (snap / name).stat().st_ino == (live / name).stat().st_ino
    index.remove(np.arange(0, 500, 2, dtype=np.uint64))         # merges replace the linked runs
    index.committed(index.commit())
    check_all(RunIndex.open(snap, manifest, verify=True), {i: i for i in range(500)},
              np.arange(600, dtype=np.uint64))
    check_all(index, {i: i for i in range(1, 500, 2)}, np.arange(600, dtype=np.uint64))


def test_tombstones_go_when_a_merge_includes_the_oldest_run(tmp_path):
    index = RunIndex(tmp_path, memtable_entries=10_000, block_bytes=SMALL)
    index.set(np.arange(1000, dtype=np.uint64), np.arange(1000, dtype=np.uint32))
    index.flush()
    index.remove(np.arange(1000, dtype=np.uint64))
    index.flush()                                   # 1000 tombstones >= 1/4 of 1000 entries: merged away
    assert len(index) == 0 and index.stats()["runs"] == 0 and list(index.items()) == []
    index.set(np.arange(10, dtype=np.uint64), np.arange(10, dtype=np.uint32))
    manifest = index.commit()
    assert manifest["runs"][0][1] == 10


def test_an_id_set_and_removed_between_flushes_leaves_no_entry_in_the_runs(tmp_path):
    """An id no run holds, set and then removed before the memtable is written: no tombstone, and the memtable's
    entry, emptied in place, is absent to lookups, to items() and to the runs the flush and the commit write (while
    it is the frozen memtable too); set again, the id is back."""
    index = RunIndex(tmp_path, memtable_entries=1000, block_bytes=SMALL)
    index.set(np.arange(0, 2000, 2, dtype=np.uint64), np.arange(1000, dtype=np.uint32))
    index.flush()                                   # runs hold the even ids below 2000
    odd = np.arange(2001, 2400, 2, dtype=np.uint64)  # (above the runs' range: no filter can lie about them)
    index.set(odd, np.arange(200, dtype=np.uint32) + 5000)
    np.testing.assert_array_equal(index.remove(odd[:150]), np.arange(150) + 5000)
    assert len(index) == 1050 and index.stats()["memtable"] == 200      # (their entries keep their places)
    np.testing.assert_array_equal(index.lookup(odd), [EMPTY] * 150 + list(range(5150, 5200)))
    listed = np.concatenate([ids for ids, _ in index.items(10_000)])
    assert [int(i) for i in listed if i % 2] == list(range(2301, 2400, 2))
    index.set(odd[:10], np.arange(10, dtype=np.uint32) + 7000)          # (an emptied entry taken again)
    assert len(index) == 1060
    manifest = index.commit()
    assert sum(entries for _, entries in manifest["runs"]) == 1060      # no tombstone, no emptied entry
    again = RunIndex.open(tmp_path, json.loads(json.dumps(manifest)), memtable_entries=1000, verify=True)
    want = np.full(200, EMPTY, np.uint32)
    want[:10], want[150:] = np.arange(7000, 7010), np.arange(5150, 5200)
    np.testing.assert_array_equal(again.lookup(odd), want)
    assert len(again) == 1060


def test_runs_stay_few_and_each_is_much_larger_than_the_next(tmp_path):
    index, _ = build(tmp_path, 20_000, memtable=200)
    sizes = index.stats()["run_entries"]
    assert len(sizes) <= 1 + int(np.log(20_000 / 200) / np.log(runs.MERGE_RATIO)) + 1
    assert all(newer * runs.MERGE_RATIO < older for older, newer in zip(sizes, sizes[1:]))


def test_ram_per_entry_is_below_two_bytes_at_a_million(tmp_path):
    index, ids = build(tmp_path, 1_000_000, memtable=1 << 16, block_bytes=runfile.BLOCK_BYTES)
    index.committed(index.commit())
    per_block = (runfile.BLOCK_BYTES - 8) // 12
    want = sum(8 * -(-r.entries // per_block) + 32 * int(np.ceil(r.entries * runs.BLOOM_BITS / 256))
               for r in index._runs) + index._mem.nbytes()
    index.lookup(ids[:10])
    cache = index._cache.nbytes()                         # a fixed part: 12 bytes a slot, 1/8 of the memtable's
    assert cache == 12 * (1 << 13)
    assert index.ram_bytes() == want + cache
    assert (index.ram_bytes() - cache) / len(index) < 1.36    # 10 bits of filter + 8 bytes of fence a block of 84
    assert 12 < index.disk_bytes() / len(index) < 14.5      # (12 bytes an entry, a block's check and count)
    # the memtable's own bytes are bounded by its capacity whatever the index's size
    index.set(ids[:1000], np.zeros(1000, np.uint32))
    assert index._mem.nbytes() < 30 * (1 << 16)


def blocks_per_read(monkeypatch) -> list[int]:
    """The number of blocks of each runfile.read_blocks call (every block read) from now on, as they happen."""
    largest: list[int] = []
    read = runfile.read_blocks

    def spy(runs, which, blocks, *more, **options):
        largest.append(len(blocks))
        return read(runs, which, blocks, *more, **options)

    monkeypatch.setattr(runfile, "read_blocks", spy)
    return largest


def test_temporaries_are_bounded_by_a_chunk(tmp_path, monkeypatch):
    monkeypatch.setattr(runwork, "CHUNK", 400)
    index, _ = build(tmp_path, 20_000, memtable=2000)
    largest = blocks_per_read(monkeypatch)
    index.remove(np.zeros(0, np.uint64))
    index.set(np.arange(1, 2001, dtype=np.uint64), np.zeros(2000, np.uint32))
    index.set(np.arange(2001, 4001, dtype=np.uint64), np.zeros(2000, np.uint32))   # a flush and a merge
    assert index.counters["merges"] > 0
    index.flush()
    largest.clear()
    index._start_merge(0)                           # everything merged: 24k entries read 400 at a time
    index.settle()
    assert 0 < max(largest) <= 400 // ((SMALL - 8) // 12)     # (the inputs share a chunk)
    assert all(len(ids) <= 300 for ids, _ in index.items(300))


def test_a_lookup_reads_its_blocks_one_at_a_time(tmp_path, monkeypatch):
    """A lookup holds one block's buffer, not one for all its blocks: each block is read, checked and searched in
    turn by the compiled loop (no batched read of them), on two threads for a large batch."""
    index, ids = build(tmp_path, 5000)
    largest = blocks_per_read(monkeypatch)
    monkeypatch.setattr(runfile, "READ_SPLIT", 8)
    universe = np.concatenate([ids, hashed_ids(np.random.default_rng(9), 500, "2^64")])
    before = index.counters["blocks_read"]
    got = index.lookup(universe)
    np.testing.assert_array_equal(got[:5000], np.arange(5000, dtype=np.uint32))
    assert (got[5000:][~np.isin(universe[5000:], ids)] == EMPTY).all()
    assert largest == [] and index.counters["blocks_read"] - before >= 250


def test_reads_per_lookup(tmp_path):
    n = 200_000
    index, ids = build(tmp_path, n + 6000, memtable=5000, block_bytes=runfile.BLOCK_BYTES, seed=5)
    index.remove(ids[n:])
    index.set(ids[n:n + 3000], np.arange(3000, dtype=np.uint32))
    index.flush()
    index.committed(index.commit())
    ids = ids[:n + 3000]
    nruns = index.stats()["groups"]                 # (each group here is one run file)
    assert nruns == index.stats()["runs"]
    assert nruns >= 2
    rng = np.random.default_rng(6)
    before = dict(index.counters)
    present = rng.choice(ids, 4000, replace=False)
    for part in np.split(present, 100):             # 40 ids a batch: their blocks are rarely shared
        np.testing.assert_array_equal(index.lookup(part) != EMPTY, True)
    reads = index.counters["blocks_read"] - before["blocks_read"]
    assert 0.9 * len(present) < reads <= 1.1 * len(present)
    before = dict(index.counters)
    absent = rng.integers(0, 2**64 - 1, 4000, dtype=np.uint64, endpoint=True)
    absent = absent[~np.isin(absent, ids)]
    np.testing.assert_array_equal(index.lookup(absent), EMPTY)
    reads = index.counters["blocks_read"] - before["blocks_read"]
    assert reads <= 0.03 * nruns * len(absent)
    assert index.counters["bloom_negatives"] - before["bloom_negatives"] >= 0.95 * nruns * len(absent)
    stats = index.stats()
    assert stats["reads_per_lookup"] == stats["blocks_read"] / stats["lookups"]
