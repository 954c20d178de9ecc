"""SegmentStore over its on-disk index (store/disk/runs.py RunIndex): crashes, snapshots, damage, compaction by
the live bits, and stores committed with the hash index of earlier versions (issue 29 part B)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kvstore_lazy.store.disk.index import DenseIndex, RunIndex
from kvstore_lazy.store.segments import SegmentError, SegmentStore
from test_segments import PAYLOAD, payload

HERE = Path(__file__).parent


def hashed(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).choice(2**40, n, replace=False).astype(np.uint64)


def contents(store: SegmentStore) -> tuple[bytes, bytes]:
    ids = store.row_ids()
    return ids.tobytes(), store.get(ids).tobytes()


def runs_in(path: Path) -> list[str]:
    return sorted(p.name for p in path.glob("idx-*.run"))


def test_a_store_indexes_rows_in_runs_and_reopens_as_committed(tmp_path):
    store = SegmentStore(tmp_path / "s", PAYLOAD, segment_rows=64, memtable_entries=100)
    assert isinstance(store._index, RunIndex)
    ids = hashed(1000)
    store.put(ids, payload(ids))
    store.delete(ids[::3])
    assert runs_in(tmp_path / "s"), "the memtable was written as runs"
    store.commit()
    want = contents(store)
    with np.load(tmp_path / "s" / "index.npz") as z:
        assert "ids" not in z.files and "live" in z.files     # the manifest and the live bits, not every id
        meta = json.loads(bytes(z["meta"]).decode())
    # every run the manifest lists is on disk (a merge the flush started may still be writing one it does not list:
    # opening deletes what the manifest does not list)
    listed = [r[0] for r in meta["index"]["manifest"]["runs"]]
    assert meta["index"]["kind"] == "runs" and listed and set(listed) <= set(runs_in(tmp_path / "s"))
    store.close()
    again = SegmentStore.open(tmp_path / "s")
    assert runs_in(tmp_path / "s") == sorted(listed)
    assert contents(again) == want and len(again) == len(ids) - len(ids[::3])
    s = again.stats()
    assert s["index_disk_bytes"] > 0 and s["index_runs"] >= 1 and s["index_reads_per_lookup"] > 0


def test_the_live_bits_answer_for_locations_as_a_set_does():
    """LiveBits against a set of the live locations: batches over many segments, unsorted, with repeats, set and
    cleared by the compiled loop (a segment's bytes grown from Python where a set goes past them), tested with
    segments never written to and past those known; each segment's committed bytes (``row``) and a copy loaded
    from them agree; a zeroed segment is dead; a set past the segments known is refused."""
    from kvstore_lazy.store.disk.index import LiveBits
    rng = np.random.default_rng(5)
    bits, live = LiveBits(64, 6), set()
    bits.grow(40)
    for step in range(20):
        locs = rng.integers(0, 30 * 64, 300).astype(np.uint32)                  # (repeats, any order)
        gone = rng.choice(np.fromiter(live, np.uint32, len(live)), min(len(live), 100)) if live else \
            np.zeros(0, np.uint32)
        bits.set(locs)
        bits.clear(np.concatenate([gone, rng.integers(30 * 64, 40 * 64, 20)]).astype(np.uint32))  # (past the bits)
        live = (live | set(locs.tolist())) - set(gone.tolist())
        if step == 10:
            bits.zero(3)
            live = {loc for loc in live if loc >> 6 != 3}
        query = rng.integers(0, 45 * 64, 2000).astype(np.uint32)      # slots 30-39 empty, 40-44 unknown
        np.testing.assert_array_equal(bits.test(query), np.isin(query, list(live)))
    copy = LiveBits(64, 6)
    copy.grow(40)
    for slot in range(40):
        row = bits.row(slot)
        assert set((np.flatnonzero(np.unpackbits(row, bitorder="little")) + 64 * slot).tolist()) == \
            {loc for loc in live if loc >> 6 == slot}
        copy.load(slot, row)
    query = np.arange(45 * 64, dtype=np.uint32)
    np.testing.assert_array_equal(copy.test(query), bits.test(query))
    np.testing.assert_array_equal(copy.counts(), bits.counts())
    for live_bits in (bits, copy):          # (the lengths kept beside the bytes: theirs)
        assert live_bits.nbytes() == sum(mine.nbytes for mine in live_bits.bits) + 16 * 40
    assert not bits.test(np.zeros(0, np.uint32)).size
    with pytest.raises(IndexError, match="segment slot 41 of 40"):
        bits.set(np.array([41 * 64 + 5], np.uint32))


@pytest.mark.parametrize("damage,match", [
    ("moved", r"index\.npz: the index and the live records it lists disagree"),
    ("fill", r"index\.npz: refers to segments it does not list, or past their fill"),
    ("resealed", r"index\.npz: the index and the live records it lists disagree \(an id's location does not hold"),
    ("flipped", r"seg-\d+\.dat is damaged: record \d+ ")])
def test_a_store_whose_live_bits_or_fills_disagree_with_its_runs_is_refused(tmp_path, monkeypatch, damage, match):
    """A committed store of hashed ids over many segments, its index.npz rewritten with a live bit moved from a
    listed record to a dead one (the counts still agree) or a segment's fill cut below a listed record, or a live
    record given another id and sealed again (its check word right: only the index says it is wrong), or a byte of
    it flipped: open with verify refuses it by name, the checks a batch at a time (smaller than the store here, so
    a later batch finds it)."""
    from kvstore_lazy.store.disk import verify as disk_verify
    monkeypatch.setattr(disk_verify, "VERIFY_BATCH", 97)
    store = SegmentStore(tmp_path / "s", PAYLOAD, segment_rows=64, memtable_entries=100)
    ids = hashed(3000, seed=4)
    store.put(ids, payload(ids))
    store.delete(ids[::4])
    store.commit()
    victim = ids[np.argsort(ids)][-5]                       # near the end of the index's order: a late batch
    loc = int(store._index.lookup(np.array([victim], np.uint64))[0])
    slot, offset = loc >> store._shift, loc & (64 - 1)
    store.close()
    SegmentStore.open(tmp_path / "s")                       # as committed: it opens
    index = tmp_path / "s" / "index.npz"
    with np.load(index) as z:
        arrays = {name: z[name].copy() for name in z.files}
    meta = json.loads(bytes(arrays["meta"]).decode())
    row = [s for s, _, _ in meta["segments"]].index(slot)
    if damage in ("resealed", "flipped"):
        from kvstore_lazy.store.disk.layout import RecordLayout
        layout = RecordLayout(PAYLOAD, 64)
        segment = tmp_path / "s" / meta["segments"][row][1]
        with open(segment, "r+b") as f:
            f.seek(offset * layout.record_bytes)
            record = np.frombuffer(f.read(layout.record_bytes), layout.record_dtype).copy()
            assert record["id"][0] == victim
            if damage == "resealed":
                record["id"] = victim ^ np.uint64(1 << 41)          # an id no row has
                layout.seal(record, np.array([loc], np.uint32))
            else:
                record.view(np.uint8)[20] ^= 0x10
            f.seek(offset * layout.record_bytes)
            f.write(record.tobytes())
    elif damage == "moved":
        bits = np.unpackbits(arrays["live"][row], bitorder="little")
        dead = np.flatnonzero(bits[:64] == 0)
        assert len(dead), "the victim's segment holds a dead record (a quarter of the rows were deleted)"
        bits[offset], bits[dead[0]] = 0, 1
        arrays["live"][row] = np.packbits(bits, bitorder="little")
    else:
        meta["segments"][row][2] = offset
        arrays["meta"] = np.frombuffer(json.dumps(meta).encode(), np.uint8)
    if damage in ("moved", "fill"):
        np.savez(index, **arrays)
    with pytest.raises(SegmentError, match=match):
        SegmentStore.open(tmp_path / "s")


CRASH = """
import os, sys
import numpy as np
sys.path.insert(0, sys.argv[2])
from test_segments import PAYLOAD, payload
from kvstore_lazy.store.segments import SegmentStore
store = SegmentStore.open(sys.argv[1], memtable_entries=50)
ids = np.arange(10**6, 10**6 + 700, dtype=np.uint64)
store.put(ids, payload(ids, 1.0))
store.delete(store.row_ids()[:100])
store.compact(0.1)
os._exit(9)                                 # killed: no commit, no close
"""


def test_a_store_killed_after_its_commit_reopens_as_committed_its_later_runs_deleted(tmp_path):
    store = SegmentStore(tmp_path / "s", PAYLOAD, segment_rows=64, memtable_entries=50)
    ids = hashed(600, 1)
    store.put(ids, payload(ids))
    store.delete(ids[:50])
    store.commit()
    committed_runs = runs_in(tmp_path / "s")
    want = contents(store)
    store.close()
    out = subprocess.run([sys.executable, "-c", CRASH, str(tmp_path / "s"), str(HERE)], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 9, out.stderr
    written = runs_in(tmp_path / "s")
    assert set(written) - set(committed_runs), "the killed process wrote runs of its own"
    again = SegmentStore.open(tmp_path / "s")
    assert runs_in(tmp_path / "s") == committed_runs                      # its runs, uncommitted, deleted
    assert not list((tmp_path / "s").glob("*.tmp"))
    assert contents(again) == want
    # and it goes on from there: written, committed, reopened
    more = np.arange(5, 305, dtype=np.uint64)
    again.put(more, payload(more, 2.0))
    again.commit()
    want = contents(again)
    again.close()
    assert contents(SegmentStore.open(tmp_path / "s")) == want


def test_a_snapshot_hard_links_the_runs_and_keeps_them_when_the_store_moves_on(tmp_path):
    store = SegmentStore(tmp_path / "s", PAYLOAD, segment_rows=64, memtable_entries=64)
    ids = hashed(2000, 2)
    store.put(ids, payload(ids))
    store.commit(into=tmp_path / "snap")
    want = contents(store)
    listed = runs_in(tmp_path / "snap")
    assert listed and set(listed) <= set(runs_in(tmp_path / "s"))
    for name in listed:                                    # the same file, linked
        assert os.stat(tmp_path / "snap" / name).st_ino == os.stat(tmp_path / "s" / name).st_ino
    # the store moves on: rows change, runs merge (replaced ones deleted at its commits), segments compacted
    for salt in range(1, 6):
        store.put(ids[::salt], payload(ids[::salt], float(salt)))
        store.delete(ids[salt::7])
        store.compact_store()
        store.commit()
    assert not set(listed) & set(runs_in(tmp_path / "s")), "the store's runs were all replaced"
    snap = SegmentStore.open(tmp_path / "snap")
    assert contents(snap) == want and runs_in(tmp_path / "snap") == listed


def test_a_damaged_run_is_refused_by_name(tmp_path):
    store = SegmentStore(tmp_path / "s", PAYLOAD, segment_rows=64, memtable_entries=100)
    ids = hashed(3000, 3)
    store.put(ids, payload(ids))
    store.commit()
    store.close()
    run = tmp_path / "s" / runs_in(tmp_path / "s")[0]
    data = bytearray(run.read_bytes())
    data[4096 + 100] ^= 0xFF                                # a data block
    run.write_bytes(bytes(data))
    with pytest.raises(SegmentError, match=rf"index run .*{run.name}: block 1 is damaged"):
        SegmentStore.open(tmp_path / "s")
    data[4096 + 100] ^= 0xFF
    data[-100] ^= 0xFF                                      # the footer: refused even without verify
    run.write_bytes(bytes(data))
    with pytest.raises(SegmentError, match=rf"{run.name}"):
        SegmentStore.open(tmp_path / "s", verify=False)
    run.unlink()                                            # a missing run
    with pytest.raises(SegmentError, match=rf"{run.name}"):
        SegmentStore.open(tmp_path / "s", verify=False)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_compaction_by_the_live_bits_equals_compaction_by_lookups(tmp_path, seed):
    """The same operations on a store whose RunIndex has runs (compaction finds live records by the live bits)
    and on one with a dense index (by looking each record up): the same files, byte for byte."""
    rng = np.random.default_rng(seed)
    universe = np.arange(5000, dtype=np.uint64)
    runs = SegmentStore(tmp_path / "r", PAYLOAD, segment_rows=32, memtable_entries=int(rng.integers(20, 200)))
    dense = SegmentStore(tmp_path / "d", PAYLOAD, segment_rows=32, rows=(0, 5000))
    assert isinstance(dense._index, DenseIndex)
    compacted = 0
    for step in range(60):
        put = rng.choice(universe, int(rng.integers(1, 200)), replace=False)
        gone = rng.choice(universe, int(rng.integers(0, 150)), replace=False)
        for store in (runs, dense):
            store.put(put, payload(put, float(step)))
            store.delete(gone)
        if step % 5 == 4:
            assert runs._bits is not None
            for slot in runs._sealed():             # the bits mark exactly the records the index places there
                here = np.arange(32, dtype=np.uint32) | np.uint32(slot << runs._shift)
                ids = runs._reads.segment(slot, 32)["id"]
                np.testing.assert_array_equal(runs._bits.offsets(slot),
                                              np.flatnonzero(runs._index.lookup(ids) == here))
            ratio = float(rng.uniform(0.1, 0.6))
            done = [runs.compact(ratio), dense.compact(ratio)]
            assert done[0] == done[1]
            compacted += done[0]
            done = [runs.compact_store(), dense.compact_store()]
            assert done[0] == done[1]
            compacted += done[0]
        if step % 7 == 6:
            runs.commit()
            dense.commit()
    assert compacted > 5
    assert runs.stats()["garbage_records"] == dense.stats()["garbage_records"]
    files = sorted(p.name for p in (tmp_path / "d").glob("seg-*.dat"))
    assert files == sorted(p.name for p in (tmp_path / "r").glob("seg-*.dat"))
    for name in files:
        assert (tmp_path / "r" / name).read_bytes() == (tmp_path / "d" / name).read_bytes()
    assert contents(runs) == contents(dense)
    runs.commit()
    want = contents(runs)
    runs.close()
    assert contents(SegmentStore.open(tmp_path / "r")) == want


def write_old_index(path: Path, ids: np.ndarray, locs: np.ndarray, meta: dict) -> None:
    """index.npz as the hash-index store of earlier versions committed it (commit.py before issue 29 B)."""
    meta = {k: meta[k] for k in ("next_number", "active", "segments")}
    tmp = path / "index.npz.tmp"
    with open(tmp, "wb") as f:
        np.savez(f, ids=ids, locs=locs, meta=np.frombuffer(json.dumps(meta).encode(), np.uint8))
    os.replace(tmp, path / "index.npz")


def test_a_store_committed_with_the_old_hash_index_opens_converted_into_runs(tmp_path):
    store = SegmentStore(tmp_path / "s", PAYLOAD, segment_rows=64, memtable_entries=10_000)
    ids = hashed(3000, 4)
    store.put(ids, payload(ids))
    store.put(ids[:500], payload(ids[:500], 3.0))         # garbage in the first segments
    store.delete(ids[-300:])
    store.commit()
    want = contents(store)
    live_ids, live_locs = store.row_ids(), store._index.lookup(store.row_ids())
    with np.load(tmp_path / "s" / "index.npz") as z:
        meta = json.loads(bytes(z["meta"]).decode())
    store.close()
    for name in runs_in(tmp_path / "s"):
        (tmp_path / "s" / name).unlink()
    order = np.random.default_rng(0).permutation(len(live_ids))    # a hash index lists its rows by slot
    write_old_index(tmp_path / "s", live_ids[order], live_locs[order], meta)
    (tmp_path / "s" / "idx-000009.run").write_bytes(b"a conversion a killed process began")
    old = SegmentStore.open(tmp_path / "s", memtable_entries=200)
    assert isinstance(old._index, RunIndex) and contents(old) == want
    assert "idx-000009.run" not in runs_in(tmp_path / "s") and runs_in(tmp_path / "s")
    assert old.compact(0.2) > 0 and contents(old) == want          # the live bits made at the conversion
    old.commit()
    with np.load(tmp_path / "s" / "index.npz") as z:
        assert "ids" not in z.files
    old.close()
    assert contents(SegmentStore.open(tmp_path / "s")) == want


def test_an_old_index_that_lists_a_row_twice_is_refused(tmp_path):
    store = SegmentStore(tmp_path / "s", PAYLOAD, segment_rows=64)
    ids = np.arange(100, dtype=np.uint64)
    store.put(ids, payload(ids))
    store.commit()
    locs = store._index.lookup(ids)
    with np.load(tmp_path / "s" / "index.npz") as z:
        meta = json.loads(bytes(z["meta"]).decode())
    store.close()
    write_old_index(tmp_path / "s", np.concatenate([ids, ids[:1]]), np.concatenate([locs, locs[1:2]]), meta)
    with pytest.raises(SegmentError, match="lists a row twice"):
        SegmentStore.open(tmp_path / "s")


def test_runs_a_snapshot_linked_are_deleted_from_the_store_once_merges_replace_them(tmp_path):
    """A server commits its stores only into snapshots (commit(into=...)): the runs a snapshot's manifest lists are
    hard-linked there, so once merges replace them the store's own names go (not kept for its own commit point,
    which never lists them): its directory holds about the runs in use, snapshot after snapshot, and every
    snapshot still opens as it was written."""
    store = SegmentStore(tmp_path / "s", PAYLOAD, segment_rows=64, memtable_entries=64)
    wants = []
    for snap in range(30):
        ids = hashed(300, 100 + snap)
        store.put(ids, payload(ids, float(snap)))
        store.commit(into=tmp_path / f"snap{snap}")
        wants.append(contents(store))
    in_use = {name for name, _ in store._index.manifest()["runs"]}
    assert len(in_use) < 15 and set(runs_in(tmp_path / "s")) == in_use
    for snap in (0, 17, 29):
        assert contents(SegmentStore.open(tmp_path / f"snap{snap}")) == wants[snap]


def dense_store(path: Path, n: int = 3000) -> tuple[SegmentStore, tuple[bytes, bytes]]:
    store = SegmentStore(path, PAYLOAD, segment_rows=64, rows=(1000, 50_000))
    ids = np.random.default_rng(5).choice(50_000, n, replace=False).astype(np.uint64) + np.uint64(1000)
    store.put(ids, payload(ids))
    store.put(ids[:400], payload(ids[:400], 3.0))
    store.delete(ids[-200:])
    store.commit()
    return store, contents(store)


@pytest.mark.parametrize("chunk", [1, 7, 1 << 15])
def test_a_dense_index_read_in_pieces_equals_a_whole_read(tmp_path, monkeypatch, chunk):
    """A dense index's commit is read DENSE_CHUNK entries at a time straight into the index: the index and the live
    counts are those of the store committed (and of the ids and locations read whole)."""
    from kvstore_lazy.store.disk import commit as disk_commit
    store, want = dense_store(tmp_path / "s")
    locs, live = store._index._locs.copy(), store._live.copy()
    store.close()
    with np.load(tmp_path / "s" / "index.npz") as z:
        whole = np.full(50_000, DenseIndex.EMPTY, np.uint32)
        whole[z["ids"].astype(np.int64) - 1000] = z["locs"]
    monkeypatch.setattr(disk_commit, "DENSE_CHUNK", chunk)
    opened = SegmentStore.open(tmp_path / "s")
    assert isinstance(opened._index, DenseIndex)
    assert np.array_equal(opened._index._locs, locs) and np.array_equal(opened._index._locs, whole)
    assert np.array_equal(opened._live, live) and len(opened._index) == len(store._index)
    assert contents(opened) == want
    opened.close()


def member_data(path: Path, name: str) -> tuple[int, int]:
    """(offset, size) of member ``name``'s bytes (npy header and data) in the zip at ``path``."""
    import zipfile
    with zipfile.ZipFile(path) as z:
        info = z.getinfo(name + ".npy")
    with open(path, "rb") as f:
        f.seek(info.header_offset + 26)
        lengths = np.frombuffer(f.read(4), "<u2")
    return info.header_offset + 30 + int(lengths[0]) + int(lengths[1]), info.compress_size


@pytest.mark.parametrize("damage,match", [
    ("ids", r"index\.npz: cannot read the index: .*ids\.npy"),      # a flipped byte: its CRC, named
    ("locs", r"index\.npz: cannot read the index: .*locs\.npy"),
    ("truncated", r"index\.npz: cannot read the index"),            # the file cut short
    ("unsorted", r"index\.npz: the index lists a row twice \(or its ids are not ascending\)"),
    ("unlisted", r"index\.npz: refers to segments it does not list")])
def test_a_damaged_dense_index_is_refused_by_name(tmp_path, monkeypatch, damage, match):
    from kvstore_lazy.store.disk import commit as disk_commit
    monkeypatch.setattr(disk_commit, "DENSE_CHUNK", 100)       # the damage found in a later piece too
    store, _ = dense_store(tmp_path / "s")
    store.close()
    index = tmp_path / "s" / "index.npz"
    if damage in ("ids", "locs"):
        start, size = member_data(index, damage)
        data = bytearray(index.read_bytes())
        data[start + size - 5] ^= 0xFF
        index.write_bytes(bytes(data))
    elif damage == "truncated":
        index.write_bytes(index.read_bytes()[:-100])
    else:
        with np.load(index) as z:
            arrays = {name: z[name] for name in z.files}
        if damage == "unsorted":
            arrays["ids"][[500, 501]] = arrays["ids"][[501, 500]]
        else:
            arrays["locs"][700] = np.uint32(999) << np.uint32(disk_commit_shift(tmp_path / "s"))
        np.savez(index, **arrays)
    with pytest.raises(SegmentError, match=match):
        SegmentStore.open(tmp_path / "s")


def disk_commit_shift(path: Path) -> int:
    store = SegmentStore.open(path)
    shift = store._shift
    store.close()
    return shift
