"""A row_sparse dist_sync round merged once when it completes (issue 33): the same bits as merging push after push
(each row summed in arrival order, as stock's merge buffer does), in one pass over the rows pushed."""
from __future__ import annotations

import numpy as np
import pytest

from kvstore_lazy.server.keys import RowSparseKey, SyncRound
from kvstore_lazy.store import kernels


def pairwise(pushes):
    """The merge as it was: push after push into the union so far (kernels.merge_rows, a + b)."""
    merged = pushes[0]
    for ids, vals in pushes[1:]:
        if len(ids):
            merged = kernels.merge_rows(merged[0], merged[1], ids, vals)
    return merged


def by_row(pushes):
    """Each row's float32 sum in arrival order: push 1's row as it is, a row first pushed later as 0 + it."""
    rows: dict[int, np.ndarray] = {}
    for j, (ids, vals) in enumerate(pushes):
        for i, row in zip(ids.tolist(), vals):
            rows[i] = rows[i] + row if i in rows else (row.copy() if j == 0 else np.float32(0) + row)
    order = sorted(rows)
    return np.array(order, np.int64), np.array([rows[i] for i in order], np.float32).reshape(len(order), -1)


def same(got, want):
    """The same ids and the same bits (-0.0, inf, denormals), NaN for NaN: which of two NaNs a sum keeps (its sign
    and payload) is the compiler's choice of operand order (C's + commutes), in the pairwise kernel too."""
    assert got[0].tolist() == want[0].tolist()
    assert got[1].dtype == want[1].dtype and got[1].shape == want[1].shape
    nan = np.isnan(got[1])
    assert np.array_equal(nan, np.isnan(want[1]))
    assert got[1][~nan].tobytes() == want[1][~nan].tobytes()


def push(ids, vals, dtype=np.float32, cols=-1):
    return np.array(ids, np.int64), np.array(vals, dtype).reshape(len(ids), cols)


def test_a_round_sums_each_row_in_arrival_order():
    big = 1e8   # float32: (big + 1) - big == 0, (big - big) + 1 == 1
    pushes = [push([1, 2, 5], [[big, -0.0], [1.0, 2.0], [-0.0, 3.0]]),
              push([1, 3], [[1.0, 0.5], [-0.0, 7.0]]),
              push([1, 2, 3], [[-big, 0.25], [big, 1e-40], [1.0, -7.0]]),
              push([], [], cols=2), push([2, 4], [[-big, 1.0], [-0.0, 1.0]])]
    got = RowSparseKey.merge(pushes)
    same(got, by_row(pushes))
    same(got, pairwise(pushes))
    assert got[1][0, 0] == 0.0                          # (big + 1) - big, not (big - big) + 1
    assert np.signbit(got[1][4, 0]) and not np.signbit(got[1][3, 0])   # -0.0 of push 1 kept; later 0 + -0.0
    assert RowSparseKey.merge([pushes[0], pushes[2], pushes[1]])[1][0, 0] == 1.0   # (big - big) + 1: order decides


@pytest.mark.parametrize("seed", range(6))
def test_random_rounds_are_the_pairwise_merge_bit_for_bit(seed):
    rng = np.random.default_rng(seed)
    k, cols = int(rng.integers(1, 10)), int(rng.integers(1, 6))
    pushes = []
    for _ in range(k):
        n = int(rng.integers(0, 40)) if rng.random() > 0.2 else 0
        ids = np.sort(rng.choice(60, n, replace=False)).astype(np.int64)
        vals = rng.choice(np.float32([0.0, -0.0, 1.5, -2.25, 1e-40, 3e38, np.inf, np.nan, 1e8, -1e8]), (n, cols))
        pushes.append((ids, (vals * rng.standard_normal((n, cols))).astype(np.float32)))
    same(RowSparseKey.merge(pushes), pairwise(pushes))


def test_other_dtypes_merge_push_after_push():
    pushes = [push([0, 2], [[1.5], [2.5]], np.float16), push([1, 2], [[3.0], [4.0]], np.float16),
              push([0], [[0.125]], np.float16)]
    same(RowSparseKey.merge(pushes), pairwise(pushes))


def test_a_round_is_one_pass_over_the_rows_pushed(monkeypatch):
    """N pushes: nothing merged until the last (the round holds the pushes' own arrays), then one call over each
    push's rows once (the rows read: the sum of the pushes' rows, not N - 1 passes over the growing union); a
    mid-round read merges what came so far."""
    calls = []
    merge_round = kernels.merge_round
    monkeypatch.setattr(kernels, "merge_round", lambda ids, vals: calls.append([len(i) for i in ids]) or
                        merge_round(ids, vals))
    monkeypatch.setattr(kernels, "merge_rows", lambda *a: pytest.fail("a pairwise merge"))
    rng = np.random.default_rng(7)
    pushes = [(np.sort(rng.choice(1000, 300, replace=False)).astype(np.int64),
               rng.standard_normal((300, 4)).astype(np.float32)) for _ in range(8)]
    rnd = SyncRound()
    for i, grad in enumerate(pushes[:-1]):
        assert rnd.add(f"request {i}", grad, RowSparseKey.merge, len(pushes)) is None
    assert calls == [] and all(kept is grad for kept, grad in zip(rnd.pushes, pushes))   # the pushes' arrays, no copy
    same(rnd.merged, by_row(pushes[:-1]))               # what inspect() and snapshots' checks read mid-round
    assert calls == [[300] * 7] and len(rnd.pushes) == 7 and rnd.pending
    calls.clear()
    merged, requests, slots = rnd.add("last", pushes[-1], RowSparseKey.merge, len(pushes))
    assert calls == [[300] * 8]                         # one pass: 8 x 300 rows, each read once
    assert requests == [f"request {i}" for i in range(7)] + ["last"] and slots is None
    same(merged, by_row(pushes))
    assert not rnd.pending and rnd.pushes == [] and rnd.merged is None


def test_a_round_merges_the_slots_its_pushes_came_with():
    """Pushes with their rows' slots (as their workers' pulls found them; -1: absent then; None: not known): the
    merged rows get the first push's slot that knows it, in the same pass, and the same merged bits as without."""
    rng = np.random.default_rng(11)
    pushes, slots = [], []
    for j in range(5):
        ids = np.sort(rng.choice(60, 25, replace=False)).astype(np.int64)
        pushes.append((ids, rng.standard_normal((25, 3)).astype(np.float32)))
        known = np.where(rng.random(25) < 0.3, -1, ids * 10 + 7)   # a row's slot, or -1
        slots.append(None if j == 2 else (known.astype(np.int64), "token", False))
    want = {}
    for (ids, _), hint in zip(pushes, slots):
        for i, slot in zip(ids.tolist(), [-1] * len(ids) if hint is None else hint[0].tolist()):
            if want.get(i, -1) < 0:
                want[i] = slot
    rnd = SyncRound()
    for i, (grad, known) in enumerate(zip(pushes, slots)):
        done = rnd.add(i, grad, RowSparseKey.merge, len(pushes), known, RowSparseKey.merge_slots)
    merged, requests, (merged_slots, token, complete) = done
    same(merged, by_row(pushes))
    assert merged_slots.tolist() == [want[i] for i in merged[0].tolist()] and token == "token"
    assert complete == all(want[i] >= 0 for i in merged[0].tolist())
    assert requests == list(range(5)) and rnd.slots == []
    first = push([3, 4], [[1.0], [-0.0]])
    assert RowSparseKey.merge_slots([first], [(np.array([5, -1]), "t", False)])[1][0].tolist() == [5, -1]
    other = [(np.array([5, -1]), "t", False), (np.array([5, -1]), "another table", False)]   # other tokens
    assert RowSparseKey.merge_slots([first, first], other)[1] is None
    with pytest.raises(ValueError):
        kernels.merge_round_slots([first[0]], [first[1]], [np.array([5], np.int64)])   # a slot per row


def test_a_round_of_one_push_or_of_empty_pushes_is_the_first_push():
    first = push([3, 4], [[1.0], [-0.0]])
    empty = (np.zeros(0, np.int64), np.zeros((0, 1), np.float32))
    assert RowSparseKey.merge([first]) is first
    assert RowSparseKey.merge([first, empty, empty]) is first
    same(RowSparseKey.merge([empty, first]), pairwise([empty, first]))   # 0 + -0.0: as before


def test_the_reused_round_buffers_keep_no_more_than_their_cap():
    """A round's merged rows go into buffers reused from round to round (no fresh mapping each round), up to
    ROUND_BUFFER_MAX bytes: a larger round gets arrays of its own, and the kept ones do not grow to it (memory the
    budget does not count, held for the life of the process)."""
    from kvstore_lazy.server.keys import row_sparse
    buffers = row_sparse._RoundBuffers()
    ids, values, slots = buffers(1000, 32)
    assert values.shape == (1000, 32) and len(ids) == len(slots) == 1000
    again = buffers(800, 32)
    assert np.shares_memory(again[1], values) and np.shares_memory(again[0], ids)
    rows = row_sparse.ROUND_BUFFER_MAX // (16 + 4 * 32) + 1
    big = buffers(rows, 32)
    assert big[1].shape == (rows, 32) and not np.shares_memory(big[1], values)
    assert len(buffers.values) == 1000 * 32 and len(buffers.ids) == 1000


def first_come(pushes):
    """The ids in the order each first comes: push 0's, then the new ones of push 1, ..."""
    seen: dict[int, None] = {}
    for ids, _ in pushes:
        seen.update(dict.fromkeys(ids.tolist()))
    return list(seen)


@pytest.mark.parametrize("seed", range(8))
def test_a_round_merged_in_any_order_has_the_same_rows_and_slots_bit_for_bit(seed):
    """merge_slots(any_order=True) (a hash table of the ids, for a key whose update takes its rows by slot): each
    row the same bits and the same slot as the sorted merge, the rows in the order each first came."""
    rng = np.random.default_rng(seed)
    k, cols = int(rng.integers(1, 10)), int(rng.choice([1, 3, 32]))
    pushes, slots = [], []
    for j in range(k):
        n = int(rng.integers(0, 300)) if rng.random() > 0.2 else 0
        ids = np.sort(rng.choice(2000, n, replace=False)).astype(np.int64)
        vals = rng.choice(np.float32([0.0, -0.0, 1.5, -2.25, 1e-40, 3e38, np.inf, np.nan, 1e8, -1e8]), (n, cols))
        pushes.append((ids, (vals * rng.standard_normal((n, cols))).astype(np.float32)))
        known = np.where(rng.random(n) < 0.2, -1, ids * 3 + 1).astype(np.int64)
        slots.append(None if j == 1 else (known, "token", False))
    (ids, vals), (got_slots, token, complete) = RowSparseKey.merge_slots(pushes, slots, any_order=True)
    assert ids.tolist() == first_come(pushes) and token == "token"
    (want_ids, want_vals), (want_slots, _, want_complete) = RowSparseKey.merge_slots(pushes, slots)
    order = np.argsort(ids, kind="stable")
    same((ids[order], vals[order]), (want_ids, want_vals))
    with np.errstate(all="ignore"):     # (3e38 + 3e38: inf, as in C)
        same((ids[order], vals[order]), by_row(pushes))
    assert got_slots[order].tolist() == want_slots.tolist() and complete == want_complete


def test_a_key_merges_its_round_in_any_order_only_when_its_update_takes_slots(tmp_path):
    """A key that reuses slots (no policy, disk tier or history) gets its round in first-come order; any other key
    sorted by id (its update looks its rows up, admits and stamps them in id order)."""
    from kvstore_lazy.server.lifecycle import Lifecycle, Policy, RowPolicy, Settings
    key = RowSparseKey(3, np.dtype(np.float32), 2, np.dtype(np.float32), 1, 100)
    pushes = [push([5, 9], [[1.0, 2.0], [3.0, 4.0]]), push([2, 9], [[5.0, 6.0], [7.0, 8.0]])]
    slots = [(np.array([0, 1], np.int64), key.slot_token(), True), (np.array([2, 1], np.int64), key.slot_token(),
                                                                       True)]
    assert key.reuses_slots()
    (ids, _), (merged_slots, _, complete) = key.merge_slots_any_order(pushes, slots)
    assert ids.tolist() == [5, 9, 2] and merged_slots.tolist() == [0, 1, 2] and complete
    key.policy = RowPolicy(Policy(admit_min_count=2), Lifecycle(Settings(), 1), 3, 0)
    assert not key.reuses_slots()
    (ids, _), _ = key.merge_slots_any_order(pushes, slots)
    assert ids.tolist() == [2, 5, 9]


def test_a_round_in_any_order_whose_slots_went_stale_is_applied_as_if_sorted():
    """A round merged in first-come order whose pull-time slots no longer hold (another token) takes the general
    path: its rows are put in id order first, so new rows get the slots, and the table the rows, that a round
    merged by id gives."""
    ids = np.array([9, 2, 5, 40, 1], np.int64)
    values = np.arange(10, dtype=np.float32).reshape(5, 2)
    keys = [RowSparseKey(3, np.dtype(np.float32), 2, np.dtype(np.float32), 0, 100) for _ in range(2)]
    keys[0]._table.insert_absent(np.array([5], np.int64))       # one row there before the round, in both
    keys[1]._table.insert_absent(np.array([5], np.int64))
    stale = (np.array([3, 4, 0, 6, 7], np.int64), ("another table", 0), True)
    keys[0].apply((ids, values), None, True, stale)
    order = np.argsort(ids)
    keys[1].apply((ids[order], values[order]), None, True)
    for key in keys:
        assert key._table.lookup(np.sort(ids)).tolist() == keys[1]._table.lookup(np.sort(ids)).tolist()
    assert keys[0]._table.export()["weights"].tobytes() == keys[1]._table.export()["weights"].tobytes()
    assert keys[0]._table.weights(keys[0]._table.lookup(ids)).tolist() == values.tolist()
