"""RowIndex and RowTable against a plain dict reference model (hypothesis state machines), plus edge cases."""
import re
from pathlib import Path

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvstore_lazy.store import rows
from kvstore_lazy.store.rows import RowIndex, RowTable

ROW = 3
U64 = np.uint64


@pytest.fixture(autouse=True)
def debug_checks(monkeypatch):
    """Every test runs with RowIndex.insert's precondition checks on."""
    monkeypatch.setattr(rows, "DEBUG", True)


def home_bucket(ids: np.ndarray, bucket_bits: int) -> np.ndarray:
    """The home bucket kernels.index_lookup computes, written out independently: top bits of splitmix-folded ids."""
    h = ((ids >> U64(31)) ^ ids) * U64(0xBF58476D1CE4E5B9)
    return (h >> U64(64 - bucket_bits)).astype(np.int64)


def ids_with_home(bucket_bits: int, buckets: set, starts=(0, 2**40, 2**64 - 2**18), span=2**18) -> list:
    """Ids from a few ranges whose home bucket in a 2**bucket_bits table is in ``buckets``.

    Home buckets are the top bits of the hash, so these ids also share their home in every smaller table.
    """
    out = []
    for start in starts:
        cand = np.arange(span, dtype=U64) + U64(start)
        out += cand[np.isin(home_bucket(cand, bucket_bits), list(buckets))].tolist()
    return out


# ids crowding bucket 0 and the last bucket (so probe runs wrap around the end of the table)
COLLIDING = ids_with_home(12, {0, 4095})

row_id = st.one_of(
    st.integers(0, 40),
    st.integers(2**40 - 20, 2**40 + 20),
    st.integers(2**64 - 20, 2**64 - 1),
    st.sampled_from(COLLIDING),
)
id_batch = st.lists(row_id, max_size=60)
unique_batch = st.lists(row_id, unique=True, max_size=60)
id_range = st.tuples(st.integers(0, 2**64 - 1), st.integers(1, 400))  # (start, count), clipped at 2**64 - 1


def range_ids(start, count) -> list:
    return list(range(start, min(start + count, 2**64)))


def arr(ids) -> np.ndarray:
    return np.array(ids, dtype=U64)


class IndexMachine(RuleBasedStateMachine):
    """The model is a set of ids; slots are checked for what they promise (dense, consistent with row_ids), not
    for which row a removal moved where."""

    @initialize(capacity=st.integers(0, 8))
    def start(self, capacity):
        self.index = RowIndex(capacity)
        self.model = set()

    def _insert(self, ids):
        new = [i for i in ids if i not in self.model]
        slots = self.index.insert(arr(new))
        assert slots.dtype == np.int64
        assert slots.tolist() == list(range(len(self.model), len(self.model) + len(new)))
        self.model.update(new)

    @rule(ids=unique_batch)
    def insert(self, ids):
        self._insert(ids)

    @rule(span=id_range)
    def insert_range(self, span):
        self._insert(range_ids(*span))

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def remove(self, data):
        gone = data.draw(st.lists(st.sampled_from(sorted(self.model)), unique=True, max_size=40))
        before = self.index.row_ids()
        holes, movers = self.index.remove(self.index.lookup(arr(gone)))
        self.model.difference_update(gone)
        # the moved rows are the survivors among the last slots, now in the removed slots below the new length
        assert before[movers].tolist() == self.index.row_ids()[holes].tolist()
        assert not set(before[movers].tolist()) & set(gone)

    @rule(ids=id_batch)
    def lookup(self, ids):
        got = self.index.lookup(arr(ids))
        assert got.dtype == np.int64
        assert [s >= 0 for s in got.tolist()] == [i in self.model for i in ids]
        present = got[got >= 0]
        assert (self.index.row_ids()[present] == arr([i for i in ids if i in self.model])).all()

    @invariant()
    def same_rows(self):
        assert len(self.index) == len(self.model)
        ids = self.index.row_ids()
        assert sorted(ids.tolist()) == sorted(self.model)
        assert self.index.lookup(ids).tolist() == list(range(len(ids)))     # slots dense, each id finds its own
        assert len(self.index) <= rows.MAX_LOAD * len(self.index._table)
        assert (self.index._table >= 0).sum() == len(ids)                  # no stale bucket left by a removal


class TableMachine(RuleBasedStateMachine):
    @initialize(capacity=st.integers(0, 6), num_states=st.integers(0, 2))
    def start(self, capacity, num_states):
        self.table = RowTable(ROW, np.float32, num_states, capacity, columns={"tag": np.int32}, track_changes=True)
        self.model = {}  # id -> [weights, [states], tag]
        self.calls = []
        self.changed, self.removed = set(), set()   # since the last clear_changes

    def make_rows(self, ids):
        self.calls.append(ids.tolist())
        return (ids % U64(1000)).astype(np.float32)[:, None] + np.arange(ROW, dtype=np.float32)

    def slots_of(self, ids):
        return self.table.lookup(arr(ids))

    def _ensure(self, ids):
        missing = [i for i in ids if i not in self.model]
        self.calls = []
        slots = self.table.ensure(arr(ids), self.make_rows)
        assert self.calls == ([missing] if missing else [])
        for i in missing:
            self.model[i] = [np.float32(i % 1000) + np.arange(ROW, dtype=np.float32),
                             [np.zeros(ROW, np.float32) for _ in range(self.table.num_states)], 0]
        self.changed.update(missing)
        assert slots.tolist() == self.slots_of(ids).tolist()
        assert self.table.row_ids()[slots].tolist() == ids
        np.testing.assert_array_equal(self.table.weights(slots),
                                      np.array([self.model[i][0] for i in ids]).reshape(-1, ROW))

    @rule(ids=unique_batch)
    def ensure(self, ids):
        self._ensure(ids)

    @rule(span=id_range)
    def ensure_range(self, span):
        self._ensure(range_ids(*span))

    @rule(ids=id_batch)
    def lookup(self, ids):
        assert [s >= 0 for s in self.slots_of(ids).tolist()] == [i in self.model for i in ids]

    @precondition(lambda self: self.model)
    @rule(data=st.data(), seed=st.integers(0, 2**32 - 1))
    def set_weights(self, data, seed):
        ids = data.draw(st.lists(st.sampled_from(sorted(self.model)), unique=True, max_size=20))
        values = np.random.default_rng(seed).standard_normal((len(ids), ROW)).astype(np.float32)
        self.table.set_weights(self.slots_of(ids), values)
        for i, v in zip(ids, values):
            self.model[i][0] = v
        self.changed.update(ids)

    @precondition(lambda self: self.model)
    @rule(data=st.data(), seed=st.integers(0, 2**32 - 1))
    def set_states(self, data, seed):
        ids = data.draw(st.lists(st.sampled_from(sorted(self.model)), unique=True, max_size=20))
        rng = np.random.default_rng(seed)
        values = [rng.standard_normal((len(ids), ROW)).astype(np.float32) for _ in range(self.table.num_states)]
        self.table.set_states(self.slots_of(ids), values)
        for k, i in enumerate(ids):
            self.model[i][1] = [v[k] for v in values]
        self.changed.update(ids)

    @precondition(lambda self: self.model)
    @rule(data=st.data(), tag=st.integers(-5, 5))
    def set_column(self, data, tag):
        """Write a column in place (not a change the table sees: columns are the caller's metadata)."""
        ids = data.draw(st.lists(st.sampled_from(sorted(self.model)), unique=True, max_size=20))
        self.table.column("tag")[self.slots_of(ids)] = tag
        for i in ids:
            self.model[i][2] = tag

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def remove(self, data):
        gone = data.draw(st.lists(st.sampled_from(sorted(self.model)), unique=True, max_size=30))
        got = self.table.remove_slots(self.slots_of(gone))
        assert sorted(got.tolist()) == sorted(gone)
        for i in gone:
            del self.model[i]
        self.changed.difference_update(gone)
        self.removed.update(gone)

    @rule()
    def clear_changes(self):
        self.table.clear_changes()
        self.changed, self.removed = set(), set()

    @rule(n=st.integers(0, 3))
    def set_num_states(self, n):
        self.table.set_num_states(n)
        for entry in self.model.values():
            entry[1] = [np.zeros(ROW, np.float32) for _ in range(n)]
        self.changed.update(self.model)

    @invariant()
    def same_rows(self):
        table, model = self.table, self.model
        assert len(table) == len(model)
        ids, weights, states = table.items()
        want = sorted(model)
        assert ids.dtype == U64 and ids.tolist() == want
        assert weights.shape == (len(want), ROW) and weights.dtype == np.float32
        np.testing.assert_array_equal(weights, np.array([model[i][0] for i in want]).reshape(-1, ROW))
        assert len(states) == table.num_states
        for k, s in enumerate(states):
            np.testing.assert_array_equal(s, np.array([model[i][1][k] for i in want]).reshape(-1, ROW))
        got = table.states(table.lookup(ids))
        for a, b in zip(got, states):
            np.testing.assert_array_equal(a, b)
        exported = table.export()
        assert exported["columns"]["tag"].tolist() == [model[i][2] for i in want]
        # rows past the length are zero in every arena: what makes a new (or re-created) row start clean
        for arena in table._all_arenas():
            assert not arena.array[len(table):].any()
        changes = table.changes()
        assert changes["row_ids"].tolist() == sorted(self.changed)
        assert changes["removed"].tolist() == sorted(self.removed - set(model))
        np.testing.assert_array_equal(changes["weights"],
                                      np.array([model[i][0] for i in sorted(self.changed)]).reshape(-1, ROW))
        row_bytes = ROW * 4 * (1 + table.num_states) + 4 + 1 + 8      # weights, states, tag, change flag, id
        assert table.nbytes() == len(model) * row_bytes + table._index._table.nbytes


STATEFUL = settings(max_examples=100, stateful_step_count=30, deadline=None)
TestIndexModel = IndexMachine.TestCase
TestIndexModel.settings = STATEFUL
TestTableModel = TableMachine.TestCase
TestTableModel.settings = STATEFUL


def test_colliding_pool_is_big_enough():
    assert len(COLLIDING) > 200


def test_empty_batches():
    index = RowIndex()
    for empty in ([], np.array([], dtype=U64), np.array([], dtype=np.int64)):
        assert index.lookup(empty).shape == (0,) and index.lookup(empty).dtype == np.int64
        assert index.insert(empty).shape == (0,)
    assert len(index) == 0 and index.row_ids().shape == (0,)
    table = RowTable(ROW, np.float32, 2)
    assert table.ensure([], lambda ids: pytest.fail("make_rows called")).shape == (0,)
    assert table.weights([]).shape == (0, ROW)
    assert [s.shape for s in table.states([])] == [(0, ROW), (0, ROW)]
    table.set_weights([], np.empty((0, ROW)))
    table.set_states([], [np.empty((0, ROW))] * 2)
    ids, weights, states = table.items()
    assert ids.shape == (0,) and weights.shape == (0, ROW) and [s.shape for s in states] == [(0, ROW)] * 2
    table.ensure([7], lambda ids: np.ones((1, ROW)))
    assert table.lookup([]).shape == (0,)


def test_extreme_ids():
    index = RowIndex(capacity=0)
    extremes = [0, 2**64 - 1, 2**63, 2**63 - 1, 1, 2**40]
    assert index.insert(extremes).tolist() == list(range(6))
    assert index.lookup([2**64 - 1, 0, 2**64 - 2, 2]).tolist() == [1, 0, -1, -1]
    assert index.row_ids().tolist() == extremes
    assert index.lookup(np.array([0, 2**40], dtype=np.int64)).tolist() == [0, 5]  # int64 input works too


def test_probe_runs_wrap_around_the_table_end():
    index = RowIndex(capacity=64)  # 128 buckets
    last = ids_with_home(7, {127})[:40]
    index.insert(last)
    assert (index._table[np.r_[127, 0:39]] >= 0).all()  # one run from the last bucket on through 0..38
    assert index.lookup(last).tolist() == list(range(40))
    assert (index.lookup(ids_with_home(7, {0})[:50]) == -1).all()  # absent ids probing that run


def test_batch_larger_than_capacity():
    rng = np.random.default_rng(0)
    ids = rng.permutation(np.unique(rng.integers(0, 2**64 - 1, 120_000, dtype=U64, endpoint=True)))
    index = RowIndex(capacity=1)
    assert (index.insert(ids) == np.arange(len(ids))).all()
    order = rng.permutation(len(ids))
    assert (index.lookup(ids[order]) == order).all()
    absent = np.setdiff1d(rng.integers(0, 2**64 - 1, 5000, dtype=U64, endpoint=True), ids)
    assert (index.lookup(absent) == -1).all()
    # and a second huge batch on top of the first
    more = np.setdiff1d(np.arange(2**40, 2**40 + 150_000, dtype=U64), ids)
    assert (index.insert(more) == np.arange(len(ids), len(ids) + len(more))).all()
    assert (index.lookup(more) == np.arange(len(ids), len(ids) + len(more))).all()
    assert (index.lookup(ids[order]) == order).all()

    table = RowTable(4, np.float64, 1, initial_capacity=1)
    slots = table.ensure(ids[:50_000], lambda new: new[:, None].astype(np.float64) + np.zeros(4))
    assert (slots == np.arange(50_000)).all()
    np.testing.assert_array_equal(table.weights(slots[::7])[:, 0], ids[:50_000:7].astype(np.float64))
    assert not table.states(slots)[0].any()


def test_ensure_mixes_present_and_absent_in_any_order():
    table = RowTable(2, np.float32, 1)
    table.ensure([5, 9], lambda ids: np.full((len(ids), 2), 1.0))
    seen = []

    def make_rows(ids):
        seen.append(ids.tolist())
        return np.full((len(ids), 2), 2.0)

    slots = table.ensure([3, 9, 11, 5], make_rows)
    assert seen == [[3, 11]]
    assert slots.tolist() == [2, 1, 3, 0]
    assert table.weights(slots)[:, 0].tolist() == [2.0, 1.0, 2.0, 1.0]


def test_moves_counts_removals():
    """RowTable.moves: slots a caller kept are those of the same rows while it is what it was (RowSparseKey
    .slot_token); adding rows or states leaves it, a removal (rows move into the freed slots) changes it."""
    table = RowTable(2, np.float32, 1)
    table.ensure([5, 9, 11], lambda ids: np.full((len(ids), 2), 1.0))
    table.ensure(np.arange(100, 3000), lambda ids: np.full((len(ids), 2), 1.0))   # growth and rehash too
    table.set_num_states(2)
    assert table.moves == 0
    table.remove_slots([0])
    assert table.moves == 1
    table.remove_slots([])
    assert table.moves == 1


def test_set_num_states_resets_states():
    table = RowTable(ROW, np.float32, num_states=1)
    slots = table.ensure([1, 2], lambda ids: np.ones((2, ROW)))
    table.set_states(slots, [np.full((2, ROW), 5.0)])
    table.set_num_states(2)
    assert table.num_states == 2
    states = table.states(slots)
    assert len(states) == 2 and not any(s.any() for s in states)
    table.set_states(slots, [np.ones((2, ROW)), np.full((2, ROW), 3.0)])
    table.set_num_states(2)  # same count: still fresh zeros
    assert not any(s.any() for s in table.states(slots))
    table.set_num_states(0)
    assert table.states(slots) == [] and table.items()[2] == []
    new = table.ensure([1, 3], lambda ids: np.full((1, ROW), 7.0))
    np.testing.assert_array_equal(table.weights(new), [[1.0] * ROW, [7.0] * ROW])  # weights survive
    with pytest.raises(ValueError):
        table.set_states(new, [np.zeros((2, ROW))])


def test_make_rows_of_wrong_shape_leaves_table_unchanged():
    table = RowTable(ROW, np.float32)
    table.ensure([1], lambda ids: np.ones((1, ROW)))
    with pytest.raises(ValueError):
        table.ensure([2, 3], lambda ids: np.ones((2, ROW + 1)))
    with pytest.raises(RuntimeError):
        table.ensure([2, 3], lambda ids: (_ for _ in ()).throw(RuntimeError("boom")))
    assert len(table) == 1 and table.lookup([2, 3]).tolist() == [-1, -1]


def test_out_of_memory_while_growing_leaves_table_unchanged(monkeypatch):
    table = RowTable(ROW, np.float32, 1, initial_capacity=2)
    table.ensure([1, 2], lambda ids: np.ones((2, ROW)))

    def no_memory(n):
        raise MemoryError

    monkeypatch.setattr(table, "_reserve", no_memory)
    with pytest.raises(MemoryError):
        table.ensure([3], lambda ids: np.ones((1, ROW)))
    assert len(table) == 2 and table.lookup([1, 2, 3]).tolist() == [0, 1, -1]


def test_slots_out_of_range():
    table = RowTable(ROW, np.float32, 1)
    table.ensure([1, 2], lambda ids: np.ones((2, ROW)))
    for bad in ([2], [-1], [0, 5]):
        with pytest.raises(IndexError):
            table.weights(bad)
        with pytest.raises(IndexError):
            table.set_weights(bad, 0)
        with pytest.raises(IndexError):
            table.states(bad)


def test_debug_checks_catch_bad_inserts():
    index = RowIndex()
    index.insert([1, 2])
    with pytest.raises(AssertionError):
        index.insert([3, 3])
    with pytest.raises(AssertionError):
        index.insert([4, 2])
    assert len(index) == 2


def test_growth_with_an_escaped_view_copies_instead():
    table = RowTable(2, np.int64, 1, initial_capacity=2)
    table.ensure([10, 11], lambda ids: ids[:, None].astype(np.int64) * [1, -1])
    view = table._arenas[0].array[:2]  # a live view makes growing in place (mremap) unsafe: growth must copy
    table.ensure(np.arange(100, 200, dtype=U64), lambda ids: ids[:, None].astype(np.int64) * [1, -1])
    assert view.tolist() == [[10, -10], [11, -11]]
    ids, weights, states = table.items()
    assert (weights[:, 0] == ids.astype(np.int64)).all() and not states[0].any()


def test_int64_slot_tables(monkeypatch):
    monkeypatch.setattr(rows, "_MAX_INT32_SLOTS", 0)
    index = RowIndex(capacity=2)
    ids = np.arange(2**64 - 5000, 2**64 - 1, dtype=U64)
    index.insert(ids)
    assert index._table.dtype == np.int64
    assert (index.lookup(ids[::-1]) == np.arange(len(ids))[::-1]).all()


def test_memory_per_row_near_raw():
    n, row_size, num_states = 100_000, 32, 2
    table = RowTable(row_size, np.float32, num_states)
    ids = np.arange(n, dtype=U64) * U64(0x9E3779B97F4A7C15)
    for lo in range(0, n, 8192):
        table.ensure(ids[lo:lo + 8192], lambda new: np.zeros((len(new), row_size), np.float32))
    raw = row_size * 4 * (1 + num_states)
    assert table.nbytes() <= 1.25 * raw * n
    assert table._index.nbytes() <= 32 * n


def _rss_bytes() -> int:
    status = Path("/proc/self/status").read_text()
    return int(re.search(r"^VmRSS:\s+(\d+) kB", status, re.M).group(1)) * 1024


def test_arena_grows_in_place_and_costs_only_the_rows_written():
    arena = rows.Arena((32,), np.float32, 4)
    arena.put(np.arange(4), np.arange(128, dtype=np.float32).reshape(4, 32))
    mapping = arena._map
    before = _rss_bytes()
    arena.grow(2**30 // 128, used=4)              # 1 GiB of capacity: address space only
    assert arena._map is mapping and len(arena) == 2**30 // 128
    assert _rss_bytes() - before < 16 * 2**20
    assert arena.take(np.arange(4)).reshape(-1).tolist() == list(range(128))
    assert not arena.take(np.array([4, len(arena) - 1])).any()   # new rows are zero
    arena.put(np.array([len(arena) - 1]), 7)
    assert arena.take(np.array([len(arena) - 1])).tolist() == [[7.0] * 32]
    assert arena.nbytes(5) == 4096 and arena.nbytes(0) == 0


def test_table_memory_follows_rows_stored_not_capacity():
    table = RowTable(64, np.float32, 2, initial_capacity=1)
    before = _rss_bytes()
    ids = np.arange(100_000, dtype=U64) * U64(0x9E3779B97F4A7C15)
    for lo in range(0, len(ids), 8192):
        slots = table.ensure(ids[lo:lo + 8192], lambda new: np.ones((len(new), 64), np.float32))
        table.set_states(slots, [np.ones((len(slots), 64), np.float32)] * 2)   # touch every state row too
    raw = 64 * 4 * 3 * len(ids)
    assert len(table._arenas[0]) >= len(ids)
    grown = _rss_bytes() - before
    assert raw * 0.9 < grown < raw * 1.25 + 8 * 2**20, (grown, raw)


def test_arena_clear_keeps_a_small_tail_zeroed_and_gives_a_large_one_back():
    """A freed tail of at most 1/KEEP_SHARE of the rows before it stays in memory, zeroed (the table grows into it
    again: no page faults); a larger one goes back to the kernel. Either way the rows read as zero."""
    n = 1 << 16                                            # 8 MiB of 128-byte rows
    arena = rows.Arena((32,), np.float32, n)
    arena.array[:] = 3.0
    before = _rss_bytes()
    small = n // rows.KEEP_SHARE // 2
    arena.clear(n - small, n)
    assert _rss_bytes() > before - 2**18                   # kept: 0.25 MiB would have gone back
    assert not arena.array[n - small:].any() and (arena.array[:n - small] == 3.0).all()
    before = _rss_bytes()
    arena.clear(n // 4, n)
    assert _rss_bytes() < before - 5 * 2**20               # 6 MiB returned
    assert not arena.array[n // 4:].any() and (arena.array[:n // 4] == 3.0).all()


def test_arena_clear_counts_every_tail_it_kept():
    """Small tails kept call after call add up: once the rows kept past the ones in use pass 1/KEEP_SHARE of them,
    all of their pages go back (a table does not keep the memory of its largest size for good)."""
    n = 1 << 18                                            # 32 MiB of 128-byte rows: 512 KiB a step
    arena = rows.Arena((32,), np.float32, n)
    arena.array[:] = 3.0
    step = n // rows.KEEP_SHARE // 4
    used = n
    before = _rss_bytes()
    for _ in range(3):                                     # 3/4 of the share: all kept
        arena.clear(used - step, used)
        used -= step
    assert _rss_bytes() > before - 2**18 and arena.top == n
    arena.clear(used - 2 * step, used)                     # past the share: every kept row's pages go back
    used -= 2 * step
    assert _rss_bytes() < before - 5 * step * 128 + 2**19 and arena.top == used
    assert not arena.array[used:].any() and (arena.array[:used] == 3.0).all()
    arena.clear(used - step, used)                         # kept again, until a phase that adds no rows ...
    used -= step
    before = _rss_bytes()
    arena.release(used)                                    # ... gives the kept rows back whatever their number
    assert _rss_bytes() < before - step * 128 + 2**17 and arena.top == used
    assert not arena.array[used:].any() and (arena.array[:used] == 3.0).all()


def test_remove_refuses_bad_slots_and_changes_nothing():
    table = RowTable(ROW, np.float32, 1)
    table.ensure([1, 2, 3], lambda ids: np.ones((3, ROW)))
    before = table.export()
    for bad, error in (([3], IndexError), ([-1], IndexError), ([0, 0], ValueError), ([1, 2, 1], ValueError)):
        with pytest.raises(error):
            table.remove_slots(bad)
    after = table.export()
    assert after["row_ids"].tolist() == before["row_ids"].tolist() == [1, 2, 3]
    assert table.remove_slots([]).tolist() == [] and len(table) == 3
    with pytest.raises(ValueError):
        table.changes()          # not tracking


def test_removed_row_comes_back_fresh():
    table = RowTable(ROW, np.float32, 2, columns={"count": np.uint32})
    slots = table.ensure([5, 6, 7], lambda ids: np.full((3, ROW), 2.0))
    table.set_states(slots, [np.full((3, ROW), 9.0)] * 2)
    table.column("count")[slots] = 4
    assert table.remove_slots(table.lookup([5])).tolist() == [5]
    assert table.lookup([5, 6, 7]).tolist()[0] == -1
    again = table.ensure([5], lambda ids: np.full((1, ROW), 1.0))
    assert table.weights(again).tolist() == [[1.0] * ROW]
    assert not any(s.any() for s in table.states(again)) and table.column("count")[again].tolist() == [0]


def test_load_keeps_buckets_and_bytes():
    table = RowTable(ROW, np.float32, 1, columns={"last": np.int32})
    ids = np.arange(5000, dtype=U64) * U64(7919)
    table.ensure(ids, lambda new: np.ones((len(new), ROW)))
    table.remove_slots(np.arange(0, 5000, 2))          # the table keeps the buckets of its peak
    table.column("last")[:len(table)] = np.arange(len(table))
    copy = RowTable.load(table.export(), columns={"last": np.int32}, buckets=table.buckets)
    assert copy.buckets == table.buckets and copy.nbytes() == table.nbytes()
    for name in ("row_ids", "weights"):
        np.testing.assert_array_equal(copy.export()[name], table.export()[name])
    np.testing.assert_array_equal(copy.export()["columns"]["last"], table.export()["columns"]["last"])
    assert RowTable.load(table.export()).buckets < table.buckets      # without it: sized for the rows now
    with pytest.raises(ValueError):
        RowTable.load({"row_ids": arr([3, 1]), "weights": np.zeros((2, ROW)), "states": []})


def test_removing_rows_gives_memory_back_and_slots_are_reused():
    """Insert 100k rows, remove them, insert 100k others, repeatedly: RSS stays at one table's worth."""
    table = RowTable(64, np.float32, 2, initial_capacity=1)
    rng = np.random.default_rng(1)

    def fill(ids):
        for lo in range(0, len(ids), 8192):
            slots = table.ensure(ids[lo:lo + 8192], lambda new: np.ones((len(new), 64), np.float32))
            table.set_states(slots, [np.ones((len(slots), 64), np.float32)] * 2)

    raw = 64 * 4 * 3 * 100_000
    fill(rng.choice(2**50, 100_000, replace=False).astype(U64))
    peak = _rss_bytes()
    for _ in range(4):
        table.remove_slots(np.arange(len(table)))
        assert len(table) == 0 and _rss_bytes() < peak - raw * 0.8       # the arenas' pages went back
        fill(rng.choice(2**50, 100_000, replace=False).astype(U64))
        assert _rss_bytes() < peak + raw * 0.1, (_rss_bytes() - peak) / raw
    table.remove_slots(np.arange(0, len(table), 3))                     # partial removals keep it consistent
    ids = table.row_ids()
    assert table.lookup(ids).tolist() == list(range(len(ids)))


def test_large_removal_moves_rows_in_chunks_and_keeps_them():
    table = RowTable(2, np.float32, 1, columns={"tag": np.int32})
    ids = np.arange(300_000, dtype=U64) * U64(2654435761)
    slots = table.ensure(ids, lambda new: np.stack([new.astype(np.float32), -new.astype(np.float32)], 1))
    table.set_states(slots, [np.arange(600_000, dtype=np.float32).reshape(-1, 2)])
    table.column("tag")[slots] = np.arange(300_000, dtype=np.int32)
    gone = np.arange(0, 300_000, 2)
    table.remove_slots(slots[gone])                  # 75,000 holes below the new length: more than one chunk
    assert len(table) == 150_000
    kept = np.setdiff1d(np.arange(300_000), gone)
    out = table.export()
    np.testing.assert_array_equal(out["row_ids"], np.sort(ids[kept]))
    order = np.argsort(ids[kept])
    np.testing.assert_array_equal(out["weights"][:, 0], ids[kept][order].astype(np.float32))
    np.testing.assert_array_equal(out["states"][0][:, 0], (2 * kept[order]).astype(np.float32))
    np.testing.assert_array_equal(out["columns"]["tag"], kept[order].astype(np.int32))


def test_a_table_stops_listing_its_removed_ids_past_a_share_of_its_bytes(monkeypatch):
    """The ids a change-tracking table removed since clear_changes are kept up to max(REMOVED_MIN, nbytes /
    REMOVED_SHARE) bytes (8 an id); past that, changes() is refused (its caller snapshots the table whole) and no
    more are kept, until clear_changes."""
    monkeypatch.setattr(rows, "REMOVED_MIN", 8 * 100)
    table = RowTable(4, np.float32, 1, track_changes=True)
    table.ensure(np.arange(4000, dtype=np.uint64), lambda ids: np.ones((len(ids), 4), np.float32))
    table.clear_changes()
    share = table.nbytes() // rows.REMOVED_SHARE // 8          # ids kept at most (above REMOVED_MIN's 100)
    assert share > 100
    table.remove_slots(table.lookup(np.arange(share // 2, dtype=np.uint64)))
    assert table.changes_complete
    assert table.changes()["removed"].tolist() == list(range(share // 2))
    table.remove_slots(table.lookup(np.arange(share // 2, share + 10, dtype=np.uint64)))
    assert not table.changes_complete and table._removed == []
    with pytest.raises(ValueError, match="removed too many rows since its changes were cleared"):
        table.changes()
    table.clear_changes()
    table.remove_slots(table.lookup(np.arange(share + 10, share + 20, dtype=np.uint64)))
    assert table.changes_complete and table.changes()["removed"].tolist() == list(range(share + 10, share + 20))


@pytest.mark.parametrize("layout", ["uniform", "sequential", "clustered", "extremes"])
def test_a_table_sorted_a_range_of_ids_at_a_time_is_argsort(layout, monkeypatch):
    """store.pieces.id_ranges cuts the ids into ranges at quantiles of a sample and sorts one range at a time (a
    snapshot or a checkpoint's listing never holds a sort of every id): its parts joined are np.argsort's order, for
    ids spread over 2^64, consecutive, in a few dense clusters, or at the ends of the uint64 range; no range holds
    much more than its share."""
    from kvstore_lazy.store import pieces
    monkeypatch.setattr(pieces, "ORDER_PASS", 500)
    monkeypatch.setattr(pieces, "SCAN", 333)
    rng = np.random.default_rng(7)
    n = 6_001
    ids = {"uniform": rng.choice(2 ** 62, n, replace=False).astype(np.uint64) * np.uint64(3),
           "sequential": np.arange(n, dtype=np.uint64) + np.uint64(10 ** 12),
           "clustered": np.concatenate([np.arange(k * 2 ** 50, k * 2 ** 50 + m, dtype=np.uint64)
                                        for k, m in ((1, 2_000), (7, 2_000), (900, 2_001))]),
           "extremes": np.concatenate([np.arange(n // 2, dtype=np.uint64),
                                       np.uint64(2 ** 64 - 1) - np.arange(n - n // 2, dtype=np.uint64)])}[layout]
    rng.shuffle(ids)
    parts = list(pieces.id_ranges(ids))
    assert len(parts) == min(pieces.ORDER_PASSES, -(-len(ids) // 500)) == 13
    assert max(len(p) for p in parts) < 3 * len(ids) / len(parts)
    assert np.array_equal(np.concatenate(parts), np.argsort(ids, kind="stable"))
    assert np.array_equal(pieces.id_order(ids), np.argsort(ids, kind="stable"))
    table = RowTable(4, np.float32, num_states=1)
    slots = table.ensure(ids, lambda new: np.arange(len(new) * 4, dtype=np.float32).reshape(-1, 4))
    table.set_states(slots, [np.ones((len(ids), 4), np.float32)])
    whole, streamed = table.export(), table.export_pieces(chunk=77)
    assert np.array_equal(whole["row_ids"], np.sort(ids))
    assert np.asarray(streamed["row_ids"]).tobytes() == whole["row_ids"].tobytes()
    assert np.concatenate(list(streamed["weights"].pieces())).tobytes() == whole["weights"].tobytes()
    assert len(streamed["weights"]) == len(ids)
