"""SegmentStore (kvstore_lazy/store/segments.py) against a dict reference model, plus damage and full disks."""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvstore_lazy.store.segments import SegmentError, SegmentStore

PAYLOAD = np.dtype([("w", "<f4", (3,)), ("s0", "<f4", (3,)), ("last", "<i4")])
ODD = np.dtype([("w", "<f2", (3,))])        # 6 bytes: records are padded to whole 32-bit words


def payload(ids, salt: float = 0.0, dtype=PAYLOAD) -> np.ndarray:
    ids = np.asarray(ids, np.uint64)
    out = np.zeros(len(ids), dtype)
    base = (ids % np.uint64(100_000)).astype(np.float64) + salt
    for name in dtype.names:
        shape = dtype.fields[name][0].shape
        out[name] = (base.reshape((-1,) + (1,) * len(shape)) + np.arange(int(np.prod(shape)) or 1).reshape(
            shape or ())).astype(dtype.fields[name][0].base)
    return out


row_id = st.one_of(st.integers(0, 300), st.integers(2**64 - 50, 2**64 - 1))
batch = st.lists(row_id, unique=True, max_size=40)


class StoreMachine(RuleBasedStateMachine):
    """Every operation on the store and on a dict; they must always agree, also after a reopen from disk."""

    ROWS: tuple[int, int] | None = None          # the store's row range (a dense index), or None (a hash index)

    def __init__(self) -> None:
        super().__init__()
        self.dir = Path(tempfile.mkdtemp(prefix="segments-"))
        self.store = SegmentStore(self.dir / "s", PAYLOAD, segment_rows=16, compact_ratio=0.4, rows=self.ROWS)
        self.model: dict[int, bytes] = {}
        self.committed: dict[int, bytes] = {}
        self.salt = 0.0

    @rule(ids=batch)
    def put(self, ids):
        ids = self.ids(ids)
        self.salt += 1
        values = payload(ids, self.salt)
        self.store.put(np.array(ids, np.uint64), values)
        self.model.update({i: v.tobytes() for i, v in zip(ids, values)})

    @rule(ids=batch)
    def delete(self, ids):
        ids = self.ids(ids)
        want = sum(i in self.model for i in ids)
        assert self.store.delete(np.array(ids, np.uint64)) == want
        for i in ids:
            self.model.pop(i, None)

    @rule(ids=batch)
    def take(self, ids):
        ids = self.ids(ids)
        ids = [i for i in ids if i in self.model]
        got = self.store.take(np.array(ids, np.uint64))
        assert [g.tobytes() for g in got] == [self.model.pop(i) for i in ids]

    def ids(self, ids: list[int]) -> list[int]:
        if self.ROWS is None:
            return ids
        first, count = self.ROWS
        return list(dict.fromkeys(first + i % count for i in ids))

    @rule()
    def compact(self):
        self.store.compact()

    @rule(ratio=st.sampled_from([0.05, 0.25, 0.9]), limit=st.integers(1, 3))
    def compact_store(self, ratio, limit):
        self.store.compact_store(ratio, limit)

    @rule(ids=batch)
    def take_present(self, ids):
        ids = self.ids(ids)
        present, got, drop = self.store.take_present(np.array(ids, np.uint64))
        assert present.tolist() == [i in self.model for i in ids]
        drop()
        assert [g.tobytes() for g in got] == [self.model.pop(i) for i in ids if i in self.model]

    @rule()
    def commit(self):
        self.store.commit()
        self.committed = dict(self.model)

    @rule()
    def reopen_without_commit(self):
        """What a crash leaves: the last commit."""
        self.store.close()
        self.store = SegmentStore.open(self.dir / "s", compact_ratio=0.4)
        self.model = dict(self.committed)

    @invariant()
    def agrees(self):
        ids = sorted(self.model)
        assert self.store.row_ids().tolist() == ids
        got = self.store.get(np.array(ids, np.uint64))
        assert [g.tobytes() for g in got] == [self.model[i] for i in ids]
        absent = [i for i in range(0, 300, 7) if i not in self.model]
        assert not self.store.contains(np.array(absent, np.uint64)).any()
        assert len(self.store) == len(ids)

    def teardown(self):
        self.store.close()
        shutil.rmtree(self.dir, ignore_errors=True)


TestStoreMachine = StoreMachine.TestCase
TestStoreMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)


class DenseStoreMachine(StoreMachine):
    """The same with a dense index over rows [250, 450): ids map into it (the invariant's absent ids below 250 are
    out of its range, and must read as absent)."""

    ROWS = (250, 200)


TestDenseStoreMachine = DenseStoreMachine.TestCase
TestDenseStoreMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)


def test_a_dense_index_refuses_rows_outside_its_range_and_costs_4_bytes_a_possible_row(tmp_path):
    store = SegmentStore(tmp_path / "s", PAYLOAD, segment_rows=16, rows=(1000, 500))
    ids = np.arange(1000, 1100, dtype=np.uint64)
    store.put(ids, payload(ids))
    assert store.index_nbytes() == 4 * 500 and store.index_row_nbytes() == 0 and len(store) == 100
    before = store.stats()
    with pytest.raises(ValueError, match=r"row 1500 is outside this store's rows \[1000, 1500\)"):
        store.put(np.array([1001, 1500], np.uint64), payload([1001, 1500]))
    assert store.stats() == before and store.get(ids[:2]).tobytes() == payload(ids[:2]).tobytes()
    assert not store.contains(np.array([0, 999, 1500, 2**64 - 1], np.uint64)).any()
    store.delete(ids[::2])
    store.commit()
    again = SegmentStore.open(tmp_path / "s")
    assert again.rows == (1000, 500) and again.row_ids().tolist() == ids[1::2].tolist()
    assert again.get(ids[1::2]).tobytes() == payload(ids[1::2]).tobytes()


def test_compaction_reclaims_garbage_and_keeps_rows(tmp_path):
    store = SegmentStore(tmp_path / "s", PAYLOAD, segment_rows=64)
    ids = np.arange(1000, dtype=np.uint64)
    store.put(ids, payload(ids))
    before = store.disk_bytes()
    store.delete(ids[ids % 4 != 0])             # 75% garbage in every sealed segment
    assert store.compact() > 0
    store.commit()
    assert store.disk_bytes() < before / 2
    assert store.row_ids().tolist() == ids[ids % 4 == 0].tolist()
    assert store.get(ids[ids % 4 == 0]).tobytes() == payload(ids[ids % 4 == 0]).tobytes()
    assert len(list((tmp_path / "s").glob("seg-*.dat"))) == len(store._names)   # retired files are gone
    again = SegmentStore.open(tmp_path / "s")
    assert again.get(ids[ids % 4 == 0]).tobytes() == payload(ids[ids % 4 == 0]).tobytes()


def test_padded_records_and_items_in_chunks(tmp_path):
    store = SegmentStore(tmp_path / "s", ODD, segment_rows=8)
    assert store.record_bytes % 4 == 0
    ids = np.array([5, 2**64 - 1, 0, 77, 3], np.uint64)
    store.put(ids, payload(ids, dtype=ODD))
    chunks = list(store.items(chunk=2))
    assert [len(c[0]) for c in chunks] == [2, 2, 1]
    got = np.concatenate([c[0] for c in chunks])
    assert got.tolist() == sorted(ids.tolist())
    assert np.concatenate([c[1] for c in chunks]).tobytes() == payload(got, dtype=ODD).tobytes()


def test_commit_into_another_directory_hard_links_a_consistent_copy(tmp_path):
    store = SegmentStore(tmp_path / "s", PAYLOAD, segment_rows=16)
    ids = np.arange(40, dtype=np.uint64)
    store.put(ids, payload(ids))
    store.commit(into=tmp_path / "snap")
    store.put(ids[:10], payload(ids[:10], 9.0))      # after the snapshot: appended, never written in place
    store.delete(ids[30:])
    store.commit()
    snap = SegmentStore.open(tmp_path / "snap")
    assert snap.get(ids).tobytes() == payload(ids).tobytes()
    assert os.stat(tmp_path / "snap" / "seg-000001.dat").st_ino == os.stat(tmp_path / "s" / "seg-000001.dat").st_ino


def test_a_damaged_segment_is_refused_naming_it(tmp_path):
    store = SegmentStore(tmp_path / "s", PAYLOAD, segment_rows=16)
    ids = np.arange(40, dtype=np.uint64)
    store.put(ids, payload(ids))
    store.commit()
    store.close()
    seg = tmp_path / "s" / "seg-000002.dat"
    with open(seg, "r+b") as f:
        f.seek(3 * store.record_bytes + 20)
        byte = f.read(1)
        f.seek(3 * store.record_bytes + 20)
        f.write(bytes([byte[0] ^ 0x10]))
    with pytest.raises(SegmentError, match=r"seg-000002\.dat is damaged: record 3 "):
        SegmentStore.open(tmp_path / "s")
    lazy = SegmentStore.open(tmp_path / "s", verify=False)       # unverified: the read itself refuses
    assert lazy.get(ids[:16]).tobytes() == payload(ids[:16]).tobytes()
    with pytest.raises(SegmentError, match="seg-000002.dat is damaged"):
        lazy.get(ids[16:20])
    os.truncate(seg, 100)
    with pytest.raises(SegmentError, match=r"seg-000002\.dat has 100 bytes"):
        SegmentStore.open(tmp_path / "s")
    seg.unlink()
    with pytest.raises(SegmentError, match=r"seg-000002\.dat is missing"):
        SegmentStore.open(tmp_path / "s")


def test_a_damaged_record_in_a_batch_read_on_the_pools_threads_is_refused_naming_it(tmp_path):
    """A read large enough for the pool's threads checks each part where it was read: damaged records (a check
    or an id that does not match) are refused naming the lowest damaged segment and its first damaged record."""
    store = SegmentStore(tmp_path / "s", PAYLOAD, segment_rows=1024)
    ids = np.arange(5000, dtype=np.uint64)
    store.put(ids, payload(ids))
    store.commit()
    store.close()
    for name, record in (("seg-000004.dat", 700), ("seg-000002.dat", 900), ("seg-000002.dat", 5)):
        with open(tmp_path / "s" / name, "r+b") as f:
            f.seek(record * store.record_bytes + 20)
            byte = f.read(1)
            f.seek(record * store.record_bytes + 20)
            f.write(bytes([byte[0] ^ 0x10]))
    lazy = SegmentStore.open(tmp_path / "s", verify=False)
    assert lazy.get(ids[:1024]).tobytes() == payload(ids[:1024]).tobytes()     # seg-000001.dat: whole
    for wanted in (ids, ids[::-1].copy(), ids[1024:]):
        with pytest.raises(SegmentError, match=r"seg-000002\.dat is damaged: record 5 \(and 1 more"):
            lazy.get(wanted)
    with pytest.raises(SegmentError, match=r"seg-000004\.dat is damaged: record 700 \(and 0 more"):
        lazy.get(ids[2048:])


def test_bad_input_is_refused_and_changes_nothing(tmp_path):
    store = SegmentStore(tmp_path / "s", PAYLOAD, segment_rows=16)
    with pytest.raises(ValueError, match="payload of dtype"):
        store.put(np.arange(3, dtype=np.uint64), payload(np.arange(2)))
    with pytest.raises(KeyError, match="1 of 1 rows are not in the store"):
        store.get(np.array([5], np.uint64))
    assert len(store) == 0 and store.disk_bytes() == 0
    with pytest.raises(SegmentError, match="already holds a segment store"):
        SegmentStore(tmp_path / "s", PAYLOAD)
    with pytest.raises(ValueError, match="power of two"):
        SegmentStore(tmp_path / "t", PAYLOAD, segment_rows=12)
    (tmp_path / "u").mkdir()
    with pytest.raises(SegmentError, match="cannot read the store's layout"):
        SegmentStore.open(tmp_path / "u")


def test_a_full_disk_is_a_disk_error_naming_the_directory_and_indexes_nothing(tmp_path):
    """posix_fallocate of a new segment fails with ENOSPC: simulated with RLIMIT_FSIZE in a child process (the
    tier's end-to-end test uses a real small tmpfs)."""
    code = (
        "import resource, signal, sys, numpy as np\n"
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
        "from kvstore_lazy.store.segments import SegmentStore, DiskError\n"
        "sys.path.insert(0, sys.argv[2]); from test_segments import payload, PAYLOAD\n"
        "s = SegmentStore(sys.argv[1], PAYLOAD, segment_rows=1024)\n"
        "ids = np.arange(1024, dtype=np.uint64); s.put(ids, payload(ids))\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (s.record_bytes * 1024 - 1,) * 2)\n"
        "try:\n"
        "    s.put(ids + np.uint64(5000), payload(ids + np.uint64(5000)))\n"
        "except DiskError as e:\n"
        "    print('ERR', e); assert len(s) == 1024 and not s.contains(ids + np.uint64(5000)).any()\n"
        "    assert s.get(ids).tobytes() == payload(ids).tobytes(); print('OK')\n"
        "else:\n"
        "    sys.exit('no error')\n")
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "s"), str(Path(__file__).parent)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert f"disk tier {tmp_path / 's'}: cannot create a segment" in out.stdout and "OK" in out.stdout


def test_index_bytes_per_row_are_small_and_stated(tmp_path):
    """Issue 29 B: a store of 1M rows of hashed ids over 2^40 (a RunIndex) holds under 2 bytes of RAM a row on disk
    once committed (its runs' bloom filters and fences, the segments' live bits: exact in index_nbytes);
    index_row_nbytes states what a row demoted adds now (its memtable entry); a cold row costs about one index
    block read."""
    store = SegmentStore(tmp_path / "s", PAYLOAD, segment_rows=1 << 12)
    rng = np.random.default_rng(0)
    ids = rng.choice(2**40, 1_000_000, replace=False).astype(np.uint64)
    for lo in range(0, len(ids), 1 << 17):
        store.put(ids[lo:lo + (1 << 17)], payload(ids[lo:lo + (1 << 17)]))
    store.commit()
    assert store.index_nbytes() == store._index.ram_bytes() + store._bits.nbytes()
    assert store.index_nbytes() / len(store) < 2, store.index_nbytes() / len(store)
    assert store.index_row_nbytes() == 12
    store.delete(ids[:100_000])
    store.commit()
    assert len(store) == 900_000 and store.index_nbytes() / len(store) < 2
    before = store.stats()
    cold = rng.choice(ids[100_000:], 20_000, replace=False)
    assert store.get(cold).tobytes() == payload(cold).tobytes()
    after = store.stats()
    reads = (after["index_blocks_read"] - before["index_blocks_read"]) / \
        (after["index_lookups"] - before["index_lookups"])
    assert reads <= 1.1 and 0 < after["index_reads_per_lookup"] and after["index_disk_bytes"] > 0


def test_compiled_checks_are_the_documented_function(tmp_path):
    store = SegmentStore(tmp_path / "s", ODD, segment_rows=8)
    rng = np.random.default_rng(3)
    records = np.frombuffer(rng.integers(0, 256, 50 * store.record_bytes, dtype=np.uint8).tobytes(),
                            store.record_dtype)
    locs = rng.integers(0, 2**32, 50, dtype=np.uint64).astype(np.uint32)
    assert np.array_equal(store._checks(records, locs), store._checks_numpy(records, locs))
    assert len(np.unique(store._checks(records, locs))) == 50


def test_a_lean_rehash_index_finds_what_a_default_one_finds():
    from kvstore_lazy.store.rows import RowIndex
    rng = np.random.default_rng(5)
    ids = np.unique(rng.integers(0, 2**64, 50_000, dtype=np.uint64))
    lean, plain = RowIndex(16, max_load=0.8, lean_rehash=True), RowIndex(16)
    for lo in range(0, len(ids), 997):
        assert lean.insert(ids[lo:lo + 997]).tolist() == plain.insert(ids[lo:lo + 997]).tolist()
    probe = np.concatenate([ids[::7], rng.integers(0, 2**64, 1000, dtype=np.uint64)])
    assert lean.lookup(probe).tolist() == plain.lookup(probe).tolist()
    assert lean.buckets == 65536 and plain.buckets == 131072          # 50k rows at loads <= 0.8 and <= 0.5


def test_compact_store_rewrites_the_emptiest_segments_first_under_a_store_wide_ratio(tmp_path):
    store = SegmentStore(tmp_path / "s", PAYLOAD, segment_rows=16)
    ids = np.arange(161, dtype=np.uint64)       # 10 sealed segments (segment k keeps 16 - k records), 1 active
    store.put(ids, payload(ids))
    gone = ids[(ids % 16 < ids // 16) & (ids < 160)]
    store.delete(gone)
    kept = np.setdiff1d(ids, gone)
    assert sorted(int(store._live[s]) for s in store._sealed()) == list(range(7, 17))
    # 45 of 161 records are garbage (28%): over a ratio of 0.25 the emptiest goes first, at most `limit` a call
    assert store.compact_store(0.25, limit=1) == 1
    assert sorted(int(store._live[s]) for s in store._sealed()) == list(range(8, 17))
    written = sum(store._fill.values())
    assert (written - len(store)) / written <= 0.25      # 36 of 152: below the ratio, but the emptiest segment
    assert store.compact_store(0.25) == 1                # (8 live of 16) is half garbage: compacted anyway
    assert sorted(int(store._live[s]) for s in store._sealed()) == list(range(9, 17))
    assert store.compact_store(0.25) == 0                # 28 of 144 and no segment half garbage: nothing
    assert store.compact_store(0.001) == 7               # a lower ratio goes on until no sealed garbage is left
    assert store.stats()["garbage_records"] == 0
    assert store.get(kept).tobytes() == payload(kept).tobytes()
    store.commit()
    assert SegmentStore.open(tmp_path / "s").get(kept).tobytes() == payload(kept).tobytes()
    # a segment wholly garbage is retired unread
    other = SegmentStore(tmp_path / "t", PAYLOAD, segment_rows=16)
    ids = np.arange(49, dtype=np.uint64)
    other.put(ids, payload(ids))
    other.delete(ids[:16])
    assert other.compact_store(0.99) == 1 and other.counters["records_read"] == 0
    assert other.get(ids[16:]).tobytes() == payload(ids[16:]).tobytes()


def test_compaction_refuses_a_live_record_whose_id_is_damaged(tmp_path):
    store = SegmentStore(tmp_path / "s", PAYLOAD, segment_rows=16)
    ids = np.arange(40, dtype=np.uint64)
    store.put(ids, payload(ids))
    store.delete(ids[:10])                        # the first segment: 10 of 16 garbage
    with open(tmp_path / "s" / "seg-000001.dat", "r+b") as f:
        f.seek(12 * store.record_bytes)           # the id of record 12 (row 12: live)
        f.write(b"\xff")
    with pytest.raises(SegmentError, match=r"seg-000001\.dat is damaged: 5 of its 6 live records"):
        store.compact_store(0.25)
    assert store.get(ids[20:]).tobytes() == payload(ids[20:]).tobytes()


@pytest.mark.parametrize("ring", [True, False])
def test_adjacent_records_are_read_in_one_call_and_a_short_file_names_the_row(tmp_path, ring):
    """Both ways of reading (an io_uring where the kernel has one, else the pread loop; and the pread loop)."""
    from kvstore_lazy.store import kernels
    size = 12
    data = np.arange(10 * size, dtype=np.uint8)
    (tmp_path / "f").write_bytes(data.tobytes())
    fd = os.open(tmp_path / "f", os.O_RDONLY)
    try:
        rows = np.array([0, 1, 2, 5, 7, 8, 9], np.int64)
        out = np.zeros((len(rows), size), np.uint8)
        assert kernels.pread_records(np.full(len(rows), fd, np.int32), rows * size, size, out, ring) == (0, -1)
        assert np.array_equal(out, data.reshape(10, size)[rows])
        rows = np.array([3, 8, 9, 10, 11], np.int64)       # a run that goes past the end: fails at row 3 (10)
        out = np.zeros((len(rows), size), np.uint8)
        assert kernels.pread_records(np.full(len(rows), fd, np.int32), rows * size, size, out, ring) == (-1, 3)
        assert np.array_equal(out[:3], data.reshape(10, size)[[3, 8, 9]])
        many = np.random.default_rng(1).integers(0, 10, 5000)       # more reads than a ring holds
        out = np.zeros((len(many), size), np.uint8)
        assert kernels.pread_records(np.full(len(many), fd, np.int32), many * size, size, out, ring) == (0, -1)
        assert np.array_equal(out, data.reshape(10, size)[many])
        bad = np.full(len(many), fd, np.int32)
        bad[4000] = 10_000                                            # not an open file: EBADF at row 4000
        assert kernels.pread_records(bad, many * size, size, out, ring) == (9, 4000)
    finally:
        os.close(fd)


def test_records_filled_in_place_are_put_as_put_puts_them(tmp_path):
    store = SegmentStore(tmp_path / "s", PAYLOAD, segment_rows=16)
    ids = np.arange(20, dtype=np.uint64)
    records = store.new_records(ids)
    records["payload"] = payload(ids, 2.0)
    store.put_records(records)
    assert store.get(ids).tobytes() == payload(ids, 2.0).tobytes()
    with pytest.raises(ValueError, match="records of dtype"):
        store.put_records(payload(ids))
    assert len(store) == 20 and store.counters["records_written"] == 20


def test_rewrite_writes_each_record_at_its_own_location_and_copies_on_write_after_a_snapshot(tmp_path):
    """SegmentStore.rewrite: records whose payload changed go back where they are (same segment, same offset, the
    check sealed again: a reopened store verifies them), nothing else in the files changes, no index change, no
    garbage; once a snapshot links the segments (commit into another directory), rewrites are appended instead
    and the snapshot keeps what it committed."""
    store = SegmentStore(tmp_path / "s", PAYLOAD, segment_rows=16)
    ids = np.arange(40, dtype=np.uint64) * np.uint64(7)
    store.put(ids, payload(ids))
    files = {f.name: f.read_bytes() for f in sorted((tmp_path / "s").glob("seg-*.dat"))}
    some = ids[[3, 4, 17, 31, 39]]                     # in three segments, two of them adjacent
    where = store._index.lookup(some).copy()
    order, records = store.get_records(some)
    records["payload"] = payload(some[order], 5.0)
    written = dict(store.counters)
    assert store.rewrite(records) == len(some)
    assert np.array_equal(store._index.lookup(some), where), "no index change"
    assert store.counters["records_written"] == written["records_written"], "nothing appended: no garbage"
    assert store.stats()["garbage_records"] == 0
    assert store.get(some).tobytes() == payload(some, 5.0).tobytes()
    rest = np.setdiff1d(ids, some)
    assert store.get(rest).tobytes() == payload(rest).tobytes()
    # byte for byte: each record at its own location, every other byte of every file as it was
    size = store.record_bytes
    expect = {name: bytearray(data) for name, data in files.items()}
    for rid, loc in zip(some, where):
        slot, offset = int(loc) >> store._shift, int(loc) & (store.segment_rows - 1)
        _, (record,) = store.get_records(np.array([rid], np.uint64))
        expect[store._names[slot]][offset * size:(offset + 1) * size] = record.tobytes()
    assert {f.name: f.read_bytes() for f in sorted((tmp_path / "s").glob("seg-*.dat"))} == expect
    store.commit()
    again = SegmentStore.open(tmp_path / "s")          # verify=True: every check (resealed in place) holds
    assert again.get(some).tobytes() == payload(some, 5.0).tobytes()
    again.close()
    # a snapshot links the segments: the next rewrite must not touch them
    store.commit(into=tmp_path / "snap")
    order, records = store.get_records(some)
    records["payload"] = payload(some[order], 9.0)
    assert store.rewrite(records) == 0
    assert store.counters["records_written"] == written["records_written"] + len(some)     # appended anew
    assert store.get(some).tobytes() == payload(some, 9.0).tobytes()
    snap = SegmentStore.open(tmp_path / "snap")
    assert snap.get(some).tobytes() == payload(some, 5.0).tobytes()
    assert snap.get(rest).tobytes() == payload(rest).tobytes()
    with pytest.raises(KeyError, match="not in the store"):
        store.rewrite(store.new_records(np.array([1], np.uint64)))
    with pytest.raises(ValueError, match="records of dtype"):
        store.rewrite(np.zeros(2, np.uint64))


def test_handed_over_records_are_read_after_their_write_and_a_failed_write_is_a_disk_error(tmp_path, monkeypatch):
    """put_records(handoff=True): the writer thread writes while the caller goes on; a read of those records waits
    for their write (held back here until after the read started), and a write that fails is a DiskError naming
    the directory at the next call that waits for it, never records read as garbage."""
    import errno
    import threading

    from kvstore_lazy.store.disk import writer as segments      # (the writer thread: _pwrite_file, DiskError)
    store = SegmentStore(tmp_path / "s", PAYLOAD, segment_rows=64)
    ids = np.arange(100, 150, dtype=np.uint64)
    release = threading.Event()
    real = segments._pwrite_file

    def held(file, records, offset):
        assert release.wait(30), "the test never released the write"
        real(file, records, offset)

    monkeypatch.setattr(segments, "_pwrite_file", held)
    records = store.new_records(ids)
    records["payload"] = payload(ids)
    store.put_records(records, handoff=True)
    del records
    assert len(store) == 50 and store._writes, "indexed at once, written later"
    timer = threading.Timer(0.3, release.set)
    timer.start()
    try:
        assert store.get(ids).tobytes() == payload(ids).tobytes()      # waited for the write
    finally:
        timer.cancel()
        release.set()
    assert not store._writes
    store.commit()

    def failing(file, records, offset):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(segments, "_pwrite_file", failing)
    more = ids + np.uint64(1000)
    records = store.new_records(more)
    records["payload"] = payload(more)
    store.put_records(records, handoff=True)
    with pytest.raises(segments.DiskError, match=rf"disk tier {tmp_path / 's'}: write failed: Input/output error"):
        store.get(more)
    with pytest.raises(segments.DiskError, match="write failed"):      # and at every later call that waits
        store.commit()
    store.close()
    assert SegmentStore.open(tmp_path / "s").get(ids).tobytes() == payload(ids).tobytes()   # the last commit's


def test_a_dense_index_is_committed_a_piece_at_a_time(tmp_path):
    """The commit writes a dense index's ids and locations piece by piece (store.npz): the file holds every stored
    row, and the commit never holds a copy of them all (12 bytes a row: 12 MB here)."""
    import tracemalloc
    rows = 1_000_000
    store = SegmentStore(tmp_path / "s", PAYLOAD, segment_rows=1 << 14, rows=(0, 2 * rows))
    ids = np.arange(0, 2 * rows, 2, dtype=np.uint64)
    for lo in range(0, rows, 1 << 16):
        store.put(ids[lo:lo + (1 << 16)], payload(ids[lo:lo + (1 << 16)]))
    tracemalloc.start()
    try:
        store.commit()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 3 << 20, f"a commit of {rows} rows held {peak} bytes"
    with np.load(tmp_path / "s" / "index.npz", allow_pickle=False) as z:
        assert np.array_equal(z["ids"], ids) and len(z["locs"]) == rows
    again = SegmentStore.open(tmp_path / "s")
    some = ids[::997]
    assert len(again) == rows and again.get(some).tobytes() == payload(some).tobytes()
