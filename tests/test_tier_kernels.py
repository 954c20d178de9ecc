"""The compiled paths of the disk tier (kernels.c: gather_fields, scatter_fields, record_seal, move_rows) against
the numpy they replace, byte for byte; and the cache of records a pull read in place."""
from __future__ import annotations

import numpy as np
import pytest

from kvstore_lazy.store import kernels
from kvstore_lazy.store.rows import RowTable
from kvstore_lazy.store import tier as tier_module
from kvstore_lazy.store.segments import DiskError, SegmentStore
from kvstore_lazy.store.tier import DiskTier, DiskTierFailure

# odd sizes on purpose: float16 weights of 5 (10 bytes), a uint8 and a float64 column: padded, unaligned fields
LAYOUTS = [(32, np.float32, 1, {"last": np.uint32, "count": np.uint32}),
           (5, np.float16, 2, {"flag": np.uint8, "seen": np.float64}),
           (3, np.float64, 0, {})]


def filled_table(row_size, dtype, num_states, columns, n=300, seed=0) -> RowTable:
    rng = np.random.default_rng(seed)
    table = RowTable(row_size, dtype, num_states, columns=columns, track_changes=True)
    ids = rng.permutation(10_000)[:n].astype(np.uint64) * np.uint64(2**40 + 7)      # large ids: all 64 bits used
    slots = table.ensure(ids, lambda new: rng.standard_normal((len(new), row_size)).astype(dtype))
    table.set_states(slots, [rng.standard_normal((n, row_size)).astype(dtype) for _ in range(num_states)])
    for name, col in columns.items():
        table.column(name)[:n] = (rng.random(n) * 200).astype(col)
    return table


def numpy_records(tier: DiskTier, table: RowTable, slots: np.ndarray) -> np.ndarray:
    """What the tier wrote before the compiled path: export (sorted by id), new_records, field assignments."""
    rows = table.export(slots)
    records = tier.store.new_records(rows["row_ids"])
    tier._pack(rows, records["payload"])
    return records


@pytest.mark.parametrize("layout", LAYOUTS)
def test_compiled_pack_is_the_numpy_pack_byte_for_byte(tmp_path, layout):
    table = filled_table(*layout)
    tier = DiskTier(tmp_path / "t", table)
    slots = np.random.default_rng(1).permutation(len(table))[:120]
    ids = table.ids_at(slots)
    order = np.argsort(ids, kind="stable")
    got = np.empty(len(slots), tier.store.record_dtype)
    got.view(np.uint8)[:] = 0xAB                       # whatever was there: every byte must be written
    kernels.gather_fields(got, slots[order], tier._fields(table, ids=True))
    want = numpy_records(tier, table, slots)
    assert got.tobytes() == want.tobytes()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_compiled_unpack_puts_every_field_back_where_it_was(tmp_path, layout):
    table = filled_table(*layout)
    tier = DiskTier(tmp_path / "t", table)
    slots = np.arange(len(table))
    before = table.export()
    records = numpy_records(tier, table, slots)           # rows sorted by id, packed by numpy
    fresh = RowTable(table.row_size, table.dtype, table.num_states, columns=table.column_dtypes)
    zeros = np.zeros((len(records), table.row_size), table.dtype)
    new = fresh.ensure(records["id"], lambda ids: zeros)
    perm = np.random.default_rng(2).permutation(len(records))    # records in any order, each to its own slot
    kernels.scatter_fields(records[perm], new[perm], tier._fields(fresh))
    after = fresh.export()
    assert after["row_ids"].tobytes() == before["row_ids"].tobytes()
    assert after["weights"].tobytes() == before["weights"].tobytes()
    assert [s.tobytes() for s in after["states"]] == [s.tobytes() for s in before["states"]]
    assert {k: v.tobytes() for k, v in after["columns"].items()} == \
        {k: v.tobytes() for k, v in before["columns"].items()}


def test_a_wrong_offset_is_caught_by_the_comparison(tmp_path):
    """The pack test fails when a field lands one byte off (what the comparison above guards against)."""
    table = filled_table(*LAYOUTS[1])
    tier = DiskTier(tmp_path / "t", table)
    slots = np.arange(len(table))
    fields = tier._fields(table, ids=True)
    fields[1] = (fields[1][0], fields[1][1] + 1)
    got = np.empty(len(slots), tier.store.record_dtype)
    order = np.argsort(table.ids_at(slots), kind="stable")
    kernels.gather_fields(got, slots[order], fields)
    assert got.tobytes() != numpy_records(tier, table, slots).tobytes()


def test_a_table_of_another_layout_is_refused(tmp_path):
    table = filled_table(*LAYOUTS[0])
    tier = DiskTier(tmp_path / "t", table)
    other = filled_table(32, np.float16, 1, LAYOUTS[0][3])
    with pytest.raises(ValueError, match="not this tier's records"):
        tier._fields(other)


def test_field_kernels_refuse_what_would_touch_memory_outside_the_arrays():
    records = np.zeros(4, np.dtype([("a", "<u8"), ("b", "<f4", (2,))]))
    rows = np.zeros((10, 2), np.float32)
    with pytest.raises(IndexError, match="slot out of range"):
        kernels.gather_fields(records, np.array([0, 1, 2, 10]), [(rows, 8)])
    with pytest.raises(IndexError, match="slot out of range"):
        kernels.scatter_fields(records, np.array([-1, 1, 2, 3]), [(rows, 8)])
    with pytest.raises(ValueError, match="do not fit a record of 16"):
        kernels.gather_fields(records, np.arange(4), [(rows, 9)])
    with pytest.raises(ValueError, match="for 3 slots"):
        kernels.gather_fields(records, np.arange(3), [(rows, 8)])
    with pytest.raises(ValueError, match="C-contiguous"):
        kernels.scatter_fields(records, np.arange(4), [(rows[:, :1], 8)])
    with pytest.raises(ValueError, match="writable"):
        kernels.scatter_fields(records, np.arange(4), [(np.broadcast_to(rows, (10, 2)), 8)])
    assert not records.view(np.uint8).any() and not rows.any()      # nothing was written
    with pytest.raises(IndexError, match="slot out of range"):
        kernels.move_rows(rows, np.array([0]), np.array([10]))
    with pytest.raises(ValueError, match="check word"):
        kernels.record_seal(np.zeros((2, 4), np.uint32), np.ones(4, np.uint64), np.zeros(2, np.uint32), 2)


def test_seal_writes_the_documented_check_and_move_rows_moves_whole_rows(tmp_path):
    store = SegmentStore(tmp_path / "s", np.dtype([("w", "<f4", (5,))]))
    rng = np.random.default_rng(3)
    records = store.new_records(np.arange(50, dtype=np.uint64))
    records["payload"]["w"] = rng.standard_normal((50, 5))
    locs = rng.integers(0, 2**32, 50, dtype=np.uint64).astype(np.uint32)
    kernels.record_seal(records.view(np.uint32).reshape(50, store._words), store._mult, locs, 2)
    assert (records["check"] == store._checks_numpy(records, locs)).all() and records["check"].any()
    rows = rng.standard_normal((20, 3, 2))
    want = rows.copy()
    want[[1, 4, 7]] = rows[[19, 15, 10]]
    kernels.move_rows(rows, np.array([1, 4, 7]), np.array([19, 15, 10]))
    assert rows.tobytes() == want.tobytes()


def test_a_demotion_the_store_refuses_leaves_every_row_in_the_table(tmp_path, monkeypatch):
    """The table lets the rows go while their records are indexed: if the store refuses a chunk (a full disk), the
    chunks it took go again and every row is back in the table, values and columns as they were (a row is in one
    tier), and the tier stops the server (DiskTierFailure)."""
    table = filled_table(*LAYOUTS[0], n=500)
    tier = DiskTier(tmp_path / "t", table)
    tier.demote(table, np.arange(0, 500, 5))            # some rows on disk already
    before, on_disk = table.export(), len(tier)
    monkeypatch.setattr(tier_module, "DEMOTE_CHUNK", 64)
    put, calls = tier.store.put_records, []

    def refuse_the_third(records, handoff=False, **known):
        calls.append(len(records))
        if len(calls) == 3:
            raise DiskError(28, "disk tier: no space left (the test's)")
        put(records, handoff=handoff, **known)

    monkeypatch.setattr(tier.store, "put_records", refuse_the_third)
    with pytest.raises(DiskTierFailure, match="no space left"):
        tier.demote(table, np.arange(0, 300, 1))
    assert calls == [64, 64, 64] and len(tier) == on_disk
    after = table.export()
    for name in ("row_ids", "weights"):
        assert after[name].tobytes() == before[name].tobytes()
    assert after["states"][0].tobytes() == before["states"][0].tobytes()
    assert {k: v.tobytes() for k, v in after["columns"].items()} == \
        {k: v.tobytes() for k, v in before["columns"].items()}


def test_records_a_pull_read_in_place_are_promoted_without_a_second_read_until_the_store_changes(tmp_path):
    table = filled_table(*LAYOUTS[0], n=400)
    tier = DiskTier(tmp_path / "t", table)
    everything = table.export()
    tier.demote(table, np.arange(len(table)))
    ids = everything["row_ids"]
    first, second, third = ids[:100], ids[150:250], ids[250:350]
    read = tier.store.counters["records_read"]
    got = tier.read(first)                            # a pull without room: read where they are
    assert got["weights"].tobytes() == everything["weights"][:100].tobytes()
    assert tier.promote(table, ids[:150]) == 150      # 100 of them from what the pull read: 50 read now
    assert tier.store.counters["records_read"] == read + 150
    assert len(table) == 150 and len(tier) == 250
    tier.read(second)
    tier.drop(second[:10])                            # the store changed: what was read is not used again
    assert tier.promote(table, second) == 90          # read again (the 10 dropped are gone)
    assert tier.store.counters["records_read"] == read + 150 + 100 + 90
    tier.read(third)
    tier.demote(table, np.array([0]))                 # a demotion changes the store too
    read = tier.store.counters["records_read"]
    assert tier.promote(table, third) == 100 and tier.store.counters["records_read"] == read + 100
    rows = table.export()
    keep = np.isin(everything["row_ids"], rows["row_ids"])
    assert rows["row_ids"].tobytes() == everything["row_ids"][keep].tobytes()
    assert rows["weights"].tobytes() == everything["weights"][keep].tobytes()
    assert rows["states"][0].tobytes() == everything["states"][0][keep].tobytes()
    assert {k: v.tobytes() for k, v in rows["columns"].items()} == \
        {k: v[keep].tobytes() for k, v in everything["columns"].items()}


def test_the_kept_io_uring_reads_after_a_failure_and_in_a_forked_child(tmp_path):
    """pread_records keeps one io_uring per thread: it must read right after a failed call (which drops the ring)
    and in a forked child (which must set up its own, not use its parent's), and the parent's ring after that."""
    import os
    size = 16
    data = np.arange(64 * size, dtype=np.uint8)
    (tmp_path / "f").write_bytes(data.tobytes())
    fd = os.open(tmp_path / "f", os.O_RDONLY)
    rows = np.array([1, 5, 6, 40, 63], np.int64)

    def read() -> bool:
        out = np.zeros((len(rows), size), np.uint8)
        ok = kernels.pread_records(np.full(len(rows), fd, np.int32), rows * size, size, out, True) == (0, -1)
        return ok and np.array_equal(out, data.reshape(64, size)[rows])

    try:
        assert read()
        past = np.array([2, 70], np.int64)
        assert kernels.pread_records(np.full(2, fd, np.int32), past * size, size, np.zeros((2, size), np.uint8),
                                     True) == (-1, 1)
        assert read()
        pid = os.fork()
        if pid == 0:                      # the child: exit status 0 only if its read was right
            os._exit(0 if read() else 1)
        import signal
        import time
        deadline = time.monotonic() + 30
        while (done := os.waitpid(pid, os.WNOHANG))[0] == 0:
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                pytest.fail("the forked child did not finish its read within 30 s")
            time.sleep(0.01)
        assert os.waitstatus_to_exitcode(done[1]) == 0
        assert read()
    finally:
        os.close(fd)
