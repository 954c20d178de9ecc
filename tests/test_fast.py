"""protocol/_fast.c against the Python it must agree with: RowIndex probing, the initializers' uniform values, the
row_sparse layout checks, and the loader's refusal of a stale build. (The PBMeta codec's C half is compared with
the reference codec in tests/test_protocol.py, beside the Python fast path.)"""
from __future__ import annotations

import functools
import hashlib
import importlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvstore_lazy.numerics.initializers as ki
import kvstore_lazy.numerics.optimizers as opt
from kvstore_lazy.protocol import fast
from kvstore_lazy.protocol.fast import native
from kvstore_lazy.store import rows
from kvstore_lazy.store.rows import RowTable

uint64 = st.integers(0, (1 << 64) - 1)


def table_of(ids, cols: int = 3, wide: bool = False) -> RowTable:
    table = RowTable(cols, np.float32)
    table.ensure(np.asarray(ids, np.uint64), lambda new: np.random.default_rng(0).standard_normal(
        (len(new), cols)).astype(np.float32))
    if wide:   # int64 buckets (tables that may hold 2**31 rows): the same probe over 8-byte slots
        table._index._table = table._index._table.astype(np.int64)
    return table


def gather(table: RowTable, keys, row_offset: int = 0, local_rows: int = 1 << 62):
    frame = np.asarray(keys, np.uint64).tobytes()
    buckets, slot_ids, shift, weights = table.probe_arrays()
    return native.gather_rows(frame, buckets, slot_ids, shift, weights, row_offset, local_rows, 4 * weights.shape[1])


@settings(max_examples=150, deadline=None)
@given(stored=st.sets(uint64, min_size=1, max_size=400), master=st.integers(0, 1 << 40), offset=uint64,
       wide=st.booleans(), data=st.data())
def test_gather_rows_is_lookup_then_take(stored, master, offset, wide, data):
    """Row keys master + local id, row id local id + offset (mod 2**64, as RowSparseKey.row_ids_of)."""
    table = table_of(sorted(stored), wide=wide)
    local = sorted({(row_id - offset) % (1 << 64) for row_id in data.draw(st.lists(st.sampled_from(sorted(stored)),
                                                                                 min_size=1, max_size=50))})
    local = [i for i in local if master + i < 1 << 64 and i < 1 << 62]   # what gather's local_rows allows
    if not local:
        return
    got = gather(table, [master] + [master + i for i in local], offset)
    row_ids = (np.array(local, np.uint64) + np.uint64(offset))
    slots = table.lookup(row_ids)
    assert (slots >= 0).all()
    payload, lens, missing, missing_ids = got
    assert missing is None and missing_ids is None
    assert payload == table.weights(slots).tobytes()
    assert lens == np.array([0] + [3] * len(local), np.int32).tobytes()


def test_gather_rows_leaves_the_rows_not_in_the_table_to_the_caller():
    table = table_of([3, 10, 11, 500])
    # local ids 1, 3, 4, 8, 9 -> row ids 3, 5, 6, 10, 11 (offset 2)
    payload, lens, missing, missing_ids = gather(table, [100, 101, 103, 104, 108, 109], row_offset=2)
    assert type(payload) is bytearray
    rows = np.frombuffer(payload, np.float32).reshape(5, 3)
    assert rows[[0, 3, 4]].tobytes() == table.weights(table.lookup([3, 10, 11])).tobytes()
    assert not rows[[1, 2]].any()
    assert np.frombuffer(missing, np.int64).tolist() == [1, 2]            # positions among the rows
    assert np.frombuffer(missing_ids, np.int64).tolist() == [3, 4]        # their local ids (rows 5 and 6)
    assert lens == np.array([0, 3, 3, 3, 3, 3], np.int32).tobytes()


@pytest.mark.parametrize("init", [ki.UniformRows(-0.07, 0.07), ki.ConstantRows(0.0, "zero"),
                                  ki.ConstantRows(2.5), ki.ConstantRows(float("inf"))])
def test_gather_rows_fills_the_rows_not_in_the_table_with_their_initial_values(init):
    """With a fill, an absent row gets what the initializer's fill gives its row id (local id + offset), bit for
    bit, in its place; the rows in the table are as without one."""
    table = table_of([3, 10, 11, 500])
    keys = [100, 101, 103, 104, 108, 109]
    plain = gather(table, keys, row_offset=2)
    frame = np.asarray(keys, np.uint64).tobytes()
    buckets, slot_ids, shift, weights = table.probe_arrays()
    fill = init.compiled_fill(42, 7)
    payload, lens, missing, missing_ids = native.gather_rows(frame, buckets, slot_ids, shift, weights, 2, 1 << 62,
                                                             12, fill)
    assert type(payload) is bytes and missing == 2 and missing_ids is None and lens == plain[1]
    rows = np.frombuffer(payload, np.float32).reshape(5, 3)
    want = np.empty((2, 3), np.float32)
    init.fill(42, 7, np.array([5, 6], np.uint64), (1000, 3), want)   # rows 5 and 6 (local ids 3 and 4)
    assert rows[[1, 2]].tobytes() == want.tobytes()
    assert rows[[0, 3, 4]].tobytes() == np.frombuffer(plain[0], np.float32).reshape(5, 3)[[0, 3, 4]].tobytes()
    # every row in the table: the fill changes nothing
    assert native.gather_rows(np.asarray([100, 101, 108], np.uint64).tobytes(), buckets, slot_ids, shift, weights,
                              2, 1 << 62, 12, fill) == gather(table, [100, 101, 108], row_offset=2)


def test_only_initializers_the_compiled_loop_reproduces_offer_a_fill():
    assert ki.ConstantRows(-0.0).compiled_fill(1, 2) is None     # +0.0 + -0.0 would lose the sign
    assert ki.ConstantRows([1.0, 2.0]).compiled_fill(1, 2) is None
    assert ki.NormalRows(0.1).compiled_fill(1, 2) is None
    buckets, slot_ids, shift, weights = table_of([3]).probe_arrays()
    with pytest.raises(TypeError):   # a fill is (key_state, span, low)
        native.gather_rows(b"\0" * 16, buckets, slot_ids, shift, weights, 0, 10, 12, (1, 2.0))


def test_gather_rows_hands_back_what_it_does_not_take():
    table = table_of([3, 10, 11, 500])
    assert gather(table, [100, 103, 110])[0] == table.weights(table.lookup([3, 10])).tobytes()
    assert gather(table, [100, 110, 103]) is None             # unsorted
    assert gather(table, [100, 103, 103]) is None             # duplicate
    assert gather(table, [100, 99]) is None                   # a row key below its master
    assert gather(table, [100]) is None                       # no rows
    assert gather(table, [100, 103, 600], local_rows=500) is None   # beyond the rows this server holds
    assert gather(table, [100, 103, 600], local_rows=501) is not None
    buckets, slot_ids, shift, weights = table.probe_arrays()
    assert native.gather_rows(b"\0" * 12, buckets, slot_ids, shift, weights, 0, 10, 12) is None  # not whole keys
    with pytest.raises(ValueError):
        native.gather_rows(b"\0" * 16, buckets, slot_ids, 0, weights, 0, 10, 12)


def test_gather_rows_hands_over_the_slots_it_found():
    """slots_out: each row's slot as RowTable.lookup gives it (-1 for a row not in the table), with or without a
    fill; a buffer of the wrong size is an error, and a pull it does not take writes nothing."""
    table = table_of([3, 10, 11, 500])
    buckets, slot_ids, shift, weights = table.probe_arrays()
    frame = np.asarray([100, 101, 103, 104, 108, 109], np.uint64).tobytes()   # row ids 3, 5, 6, 10, 11
    for fill in (None, ki.UniformRows(-0.07, 0.07).compiled_fill(1, 2)):
        slots = np.full(5, 77, np.int64)
        got = native.gather_rows(frame, buckets, slot_ids, shift, weights, 2, 1 << 62, 12, fill, slots)
        assert got is not None
        assert slots.tolist() == table.lookup([3, 5, 6, 10, 11]).tolist()
    with pytest.raises(ValueError):
        native.gather_rows(frame, buckets, slot_ids, shift, weights, 2, 1 << 62, 12, None, np.empty(4, np.int64))
    slots = np.full(2, 77, np.int64)
    unsorted = np.asarray([100, 103, 101], np.uint64).tobytes()
    assert native.gather_rows(unsorted, buckets, slot_ids, shift, weights, 0, 1 << 62, 12, None, slots) is None
    assert slots.tolist() == [77, 77]


def test_same_bytes():
    frame = np.arange(8193, dtype=np.uint64).tobytes()
    assert native.same_bytes(memoryview(frame), bytearray(frame))
    assert native.same_bytes(b"", b"")
    assert not native.same_bytes(frame, frame[:-1])
    changed = bytearray(frame)
    changed[-1] ^= 1
    assert not native.same_bytes(frame, changed)


@settings(max_examples=120, deadline=None)
@given(seed=st.integers(-(1 << 70), 1 << 70), key=st.integers(0, 1 << 40),
       ids=st.lists(uint64, max_size=40), cols=st.integers(1, 40),
       init=st.sampled_from(['["uniform", {"scale": 0.07}]', '["uniform", {"scale": 3.5}]', '["normal", {}]',
                             '["normal", {"sigma": 2.0}]', '["xavier", {"magnitude": 2.0}]',
                             '["xavier", {"rnd_type": "gaussian"}]']),
       dtype=st.sampled_from([np.float32, np.float64, np.float16]))
def test_compiled_uniform_values_are_the_numpy_ones(seed, key, ids, cols, init, dtype):
    initializer = ki.parse_initializer(init)
    if isinstance(initializer, ki.XavierRows):
        s = initializer.scale((1 << 20, cols))
        initializer = ki.UniformRows(-s, s) if initializer.rnd_type == "uniform" else ki.NormalRows(s)
    row_ids = np.array(ids, np.uint64)
    compiled, reference = (np.empty((len(ids), cols), dtype) for _ in range(2))
    initializer._fill(seed, key, row_ids, (1 << 20, cols), compiled)
    initializer._fill_numpy(seed, key, row_ids, (1 << 20, cols), reference)
    assert compiled.tobytes() == reference.tobytes()


def test_uniform_rows_refuses_a_wrong_buffer():
    with pytest.raises(ValueError):
        native.uniform_rows(np.empty(5, np.float32), np.zeros(2, np.uint64), 0, 1.0, 0.0, 4)   # not 2 whole rows
    with pytest.raises(ValueError):
        native.uniform_rows(np.empty((3, 2), np.float16), np.zeros(3, np.uint64), 0, 1.0, 0.0, 2)
    with pytest.raises((BufferError, ValueError)):    # read-only
        native.uniform_rows(np.frombuffer(bytes(24), np.float32), np.zeros(3, np.uint64), 0, 1.0, 0.0, 4)


@settings(max_examples=300, deadline=None)
@given(st.lists(uint64, max_size=12) | st.lists(st.integers(0, 20), max_size=8).map(
    lambda d: [1 << 40] + [(1 << 40) + x for x in np.cumsum(d).tolist()]))
def test_sorted_rows_is_the_numpy_check(keys):
    raw = np.array(keys, np.uint64)
    want = len(raw) > 1 and int(raw[1]) >= int(raw[0]) and int(raw[-1]) - int(raw[0]) <= (1 << 63) - 1 \
        and bool(np.all(raw[2:] > raw[1:-1]))
    assert native.sorted_rows(raw) is want
    assert native.sorted_rows(raw.tobytes()) is want


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from([0, 4, 16, 64, -1, 1 << 30]), min_size=1, max_size=8),
       st.sampled_from([(64, 16), (16, 4), (4, 1)]))
def test_row_lens_is_the_numpy_check(lens, row):
    row_bytes, row_size = row
    raw = np.array(lens, np.int32)
    want = raw[0] == 0 and not np.count_nonzero((raw[1:] != row_bytes) & (raw[1:] != row_size))
    assert native.row_lens(raw, row_bytes, row_size) is bool(want)


def test_a_stale_build_is_refused(tmp_path, monkeypatch):
    source = tmp_path / "_fast.c"
    source.write_text("/* another _fast.c */\n")
    monkeypatch.setattr(fast, "SOURCES", (source,))
    with pytest.raises(fast.FastLoadError, match="built from another _fast.c"):
        fast.load()
    monkeypatch.undo()
    assert importlib.reload(fast).native.digest() == native.digest()


def test_the_module_was_built_from_every_source_beside_it():
    """The digest covers every unit and header (setup.py's digest, written out), so a build older than any one of
    them is refused; and the protocol's compiled code holds no socket code (ZeroMQ's calls are transport/'s)."""
    digest = hashlib.sha256()
    for path in sorted(fast.SOURCES, key=lambda p: p.name):
        data = path.read_bytes()
        digest.update(path.name.encode() + b"\0" + str(len(data)).encode() + b"\0" + data)
    assert native.digest() == digest.hexdigest()
    beside = {p.name for p in fast.SOURCE.parent.glob("*.[ch]")}
    assert beside == {p.name for p in fast.SOURCES} and fast.SOURCE in fast.SOURCES
    assert not any("zmq_" in p.read_text() for p in fast.SOURCES)
    assert not any(hasattr(native, name) for name in ("set_zmq", "recv_message", "send_message"))


@pytest.mark.parametrize("name", [p.name for p in fast.SOURCES])
def test_a_build_older_than_any_one_of_its_units_is_refused(tmp_path, monkeypatch, name):
    sources = [tmp_path / p.name for p in fast.SOURCES]
    for original, copy in zip(fast.SOURCES, sources):
        copy.write_bytes(original.read_bytes())
    monkeypatch.setattr(fast, "SOURCES", tuple(sources))
    assert fast.load() is native
    changed = tmp_path / name
    changed.write_bytes(changed.read_bytes() + b"\n")
    with pytest.raises(fast.FastLoadError, match="built from another _fast.c or another of its units"):
        fast.load()


# -- parse_float32: optimizers' dmlc::ParseFloat<float> (the Python steps are the reference)

@settings(max_examples=3000, deadline=None)
@given(st.one_of(st.floats(allow_nan=False, allow_infinity=False),
                 st.floats(1e-12, 10.0), st.floats(-1e-3, 1e-3), st.integers(-10 ** 20, 10 ** 20)))
def test_parse_float32_is_the_python_parser_on_str_of_a_number(value):
    text = str(value)
    parsed = native.parse_float32(text)
    with np.errstate(all="ignore"):   # values past float32's range overflow to inf in both
        want = opt._dmlc_parse.__wrapped__(text, np.float32)
    if parsed is None:   # only what it hands back: a long integer part
        assert len(text.lstrip("+-").split(".")[0].split("e")[0]) > 15
        return
    assert np.float32(parsed).tobytes() == np.float32(want).tobytes(), text


@settings(max_examples=3000, deadline=None)
@given(st.text(alphabet="0123456789+-.eE", max_size=40) | st.text(max_size=12))
def test_parse_float32_is_the_python_parser_or_hands_back(text):
    parsed = native.parse_float32(text)
    if parsed is None:
        return
    with np.errstate(all="ignore"):
        want = opt._dmlc_parse.__wrapped__(text, np.float32)
    assert np.float32(parsed).tobytes() == np.float32(want).tobytes(), text


def test_parse_float32_hands_back_what_python_must_decide():
    for text in (" 0.5", "0.5\n", "inf", "-nan", "NaN", "1" * 16 + ".0", "\u0661.5", "0.\u0665"):
        assert native.parse_float32(text) is None, text
    assert native.parse_float32("0.001") == float(np.float32(opt._dmlc_parse.__wrapped__("0.001", np.float32)))


# -- the update kernels in one call: kernels.py's wrappers are the reference (the same compiled kernels)

def _tables(k: int, rows: int = 6, cols: int = 5, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((rows, cols)).astype(np.float32) for _ in range(k)]


F = np.float32


@pytest.mark.parametrize("clip", [F(-1), F(0.3)])
def test_compiled_updates_are_the_kernels_wrappers(clip):
    from kvstore_lazy.store import kernels
    slots = np.array([4, 0, 2], np.int64)
    grad = _tables(1, 3, 5, seed=1)[0]
    ours, ref = _tables(3), _tables(3)
    assert native.adam(*ours, slots, grad, F(0.1), F(0.01), F(0.9), F(0.999), F(1e-8), F(1), clip, True)
    kernels.adam_rows(*ref, slots, grad, F(0.1), F(0.01), F(0.9), F(0.999), F(1e-8), F(1), clip, True)
    assert [a.tobytes() for a in ours] == [a.tobytes() for a in ref]
    ours, ref = _tables(2), _tables(2)
    assert native.sgd_mom(*ours, slots, grad, F(0.1), F(0.01), F(1), clip, F(0.9))
    kernels.sgd_mom_rows(*ref, slots, grad, F(0.1), F(0.01), F(1), clip, F(0.9), True)
    assert [a.tobytes() for a in ours] == [a.tobytes() for a in ref]
    ours, ref = _tables(1), _tables(1)
    assert native.sgd(ours[0], slots, grad, F(0.1), F(0.01), F(1), clip)
    kernels.sgd_rows(ref[0], slots, grad, F(0.1), F(0.01), F(1), clip)
    assert ours[0].tobytes() == ref[0].tobytes()
    # slots None: a dense array is one row
    dense, flat = _tables(1, 2, 3)[0], _tables(1, 1, 6)[0]
    g = _tables(1, 2, 3, seed=2)[0]
    assert native.sgd_mom(dense, None, None, g, F(0.1), F(0.01), F(1), clip, F(0))
    kernels.sgd_mom_rows(flat, flat, np.zeros(1, np.int64), g.reshape(1, 6), F(0.1), F(0.01), F(1), clip, F(0),
                         False)
    assert dense.tobytes() == flat.tobytes()


def test_compiled_updates_decline_what_the_kernels_cannot_take():
    grad = _tables(1, 2, 5, seed=1)[0]
    slots = np.array([1, 3], np.int64)
    args = (F(0.1), F(0.01), F(1), F(-1), F(0.9))
    w, m = _tables(2)
    before = w.tobytes(), m.tobytes()
    read_only = w.copy()
    read_only.flags.writeable = False
    for bad in [(w.astype(np.float64), m, slots, grad), (w, m[:, :4], slots, grad), (w, m, slots, grad[:1]),
                (w, m, np.array([1, 6], np.int64), grad), (w, m, np.array([-1, 3], np.int64), grad),
                (w, m, slots.astype(np.int32), grad), (w, m, slots, _tables(1, 2, 10)[0][:, ::2]),
                (read_only, m, slots, grad), (w, m, None, grad), (w[:, ::2], m[:, ::2], slots, grad[:, ::2])]:
        assert native.sgd_mom(*bad, *args) is False
        assert (w.tobytes(), m.tobytes()) == before


@settings(max_examples=200, deadline=None)
@given(st.sets(st.integers(0, 60), max_size=30), st.sets(st.integers(0, 60), max_size=30), st.integers(1, 5))
def test_compiled_merge_is_kernels_merge_rows(a, b, cols):
    import kvstore_lazy.numerics.optimizers  # noqa: F401  (hands the kernels' addresses over)
    from kvstore_lazy.store import kernels
    ids_a, ids_b = np.array(sorted(a), np.int64), np.array(sorted(b), np.int64)
    rng = np.random.default_rng(len(a) * 100 + len(b))
    vals_a = rng.standard_normal((len(ids_a), cols)).astype(np.float32)
    vals_b = rng.standard_normal((len(ids_b), cols)).astype(np.float32)
    got = native.merge_rows(ids_a, vals_a, ids_b, vals_b)
    want = kernels.merge_rows(ids_a, vals_a, ids_b, vals_b)
    assert got is not None
    assert (bytes(got[0]), bytes(got[1])) == (want[0].tobytes(), want[1].tobytes())
    assert native.merge_rows(ids_a, vals_a.astype(np.float16), ids_b, vals_b) is None   # kernels.py decides
    assert native.merge_rows(ids_a.astype(np.int32), vals_a, ids_b, vals_b) is None
    assert native.merge_rows(ids_a, vals_a, ids_b, vals_b[:, :cols - 1]) is None


@settings(max_examples=60, deadline=None)
@given(batches=st.lists(st.lists(st.one_of(st.integers(0, 300), uint64), unique=True, max_size=90), max_size=8),
       init=st.sampled_from([ki.UniformRows(-0.07, 0.07), ki.ConstantRows(0.0, "zero"), ki.ConstantRows(2.5)]),
       wide=st.booleans(), capacity=st.sampled_from([1, 64, 4096]))
def test_ensure_with_a_fill_makes_the_table_the_general_path_makes(batches, init, wide, capacity):
    """RowTable.ensure with ensure_rows and an initializer's compiled fill (one call when the rows fit, the general
    path when the table or an arena must grow) leaves every slot, weight, state, bucket and change mark the general
    path leaves."""
    if wide:
        rows._MAX_INT32_SLOTS, saved = 0, rows._MAX_INT32_SLOTS
    try:
        place = functools.partial(native.ensure_rows, 12, init.compiled_fill(42, 7))
        make = lambda ids: init.rows(42, 7, ids, (1 << 62, 3), np.float32)   # noqa: E731
        plain, fast = (RowTable(3, np.float32, 2, initial_capacity=capacity, track_changes=True) for _ in range(2))
        for batch in batches:
            ids = np.array(batch, np.uint64)
            want = plain.ensure(ids, make)
            got = fast.ensure(ids, make, place)
            assert got.tolist() == want.tolist()
        assert fast.buckets == plain.buckets and len(fast) == len(plain)
        assert fast._index._table.tobytes() == plain._index._table.tobytes()
        for a, b in zip(fast.items(), plain.items()):
            assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
        assert fast.changes()["row_ids"].tolist() == plain.changes()["row_ids"].tolist()
    finally:
        if wide:
            rows._MAX_INT32_SLOTS = saved


def test_ensure_rows_refuses_what_does_not_fit_and_changes_nothing():
    table = RowTable(3, np.float32, 1, initial_capacity=4)
    table.ensure(np.array([1, 2], np.uint64), lambda ids: np.ones((len(ids), 3), np.float32))
    index = table._index
    before = index._table.copy(), index._keys.array.copy(), table.arrays()[0].copy()
    slots = np.empty(3, np.int64)
    fill = (0, 0.0, 1.0)
    args = (np.array([2, 5, 6], np.uint64), index._table, index._keys.array, rows._shift(index._table), 2)
    weights = table.arrays()[0]
    assert native.ensure_rows(12, fill, *args, 3, weights, slots) is None   # the table would grow
    assert native.ensure_rows(12, fill, *args[:4], 3, 8, weights, slots) is None   # beyond the arenas (4)
    assert (index._table.tobytes(), index._keys.array.tobytes(), weights.tobytes()) == tuple(
        a.tobytes() for a in before)
    with pytest.raises(ValueError):
        native.ensure_rows(12, fill, *args, 8, weights, np.empty(2, np.int64))   # a slot per id
    with pytest.raises(TypeError):
        native.ensure_rows(12, (0, 1.0), *args, 8, weights, slots)
    assert native.ensure_rows(12, fill, *args, 8, weights, slots) == 2
    assert slots.tolist() == [1, 2, 3] and len(index) == 2   # (RowIndex.ensure_placed counts the rows it made)
