"""persist/members.py: a key file's members read in pieces, and a base and its deltas folded by id in pieces
(FoldedRows, FoldedColumn) exactly as the fold of the arrays read whole, within a transient that does not grow
with the rows; the ids checked as they are read."""
from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

from kvstore_lazy.persist import members, snapshots
from kvstore_lazy.store import rows as rows_module
from kvstore_lazy.store.rows import RowTable

D = 3


def random_chain(seed: int, deltas: int, base_rows: int = 2_000, space: int = 6_000) -> list[dict]:
    """A base and `deltas` deltas of one key (tables as a server writes them: row ids sorted, weights, a state, a
    column, pending ids with their columns; a delta's tombstones of rows and of pending ids), random but valid: a
    tombstone is of an id the delta does not write (some never stored at all)."""
    rng = np.random.default_rng(seed)

    def rows(n: int, step: int) -> dict:
        ids = np.unique(rng.integers(0, space, n)).astype(np.uint64)
        pending = np.unique(rng.integers(0, space, n // 4)).astype(np.uint64)
        return {"row_ids": ids, "weights": rng.standard_normal((len(ids), D)).astype(np.float32),
                "states": [rng.standard_normal((len(ids), D)).astype(np.float32)],
                "arrays": {"col_last": np.full(len(ids), step, np.int32),
                           "pending_ids": pending, "pending_count": rng.integers(1, 9, len(pending)).astype(np.int32),
                           "pending_last": np.full(len(pending), step, np.int32)},
                "meta": {"kind": "row_sparse"}}

    chain = [rows(base_rows, 0)]
    for step in range(1, deltas + 1):
        delta = rows(int(rng.integers(0, base_rows // 3)), step)
        for dead_name, ids_name in (("dead_ids", "row_ids"), ("pending_dead", "pending_ids")):
            ids = delta[ids_name] if ids_name == "row_ids" else delta["arrays"][ids_name]
            dead = np.unique(rng.integers(0, space, int(rng.integers(0, 300)))).astype(np.uint64)
            delta["arrays"][dead_name] = np.setdiff1d(dead, ids).astype(np.uint64)
        delta["meta"] = {"kind": "row_sparse", "mode": "delta"}
        chain.append(delta)
    return chain


def model(chain: list[dict]) -> dict:
    """The fold as a dict of rows: each table's rows replace, its tombstones remove (the reference)."""
    out = {}
    for group, dead_name, columns in (("row_ids", "dead_ids", ("weights", "state0", "col_last")),
                                      ("pending_ids", "pending_dead", ("pending_count", "pending_last"))):
        rows: dict = {}
        for table in chain:
            arrays = dict(table["arrays"], weights=table["weights"], state0=table["states"][0],
                          row_ids=table["row_ids"])
            for row_id in arrays.get(dead_name, []):
                rows.pop(int(row_id), None)
            for at, row_id in enumerate(arrays[group]):
                rows[int(row_id)] = tuple(arrays[n][at] for n in columns)
        ids = sorted(rows)
        out[group] = np.array(ids, np.uint64)
        for i, name in enumerate(columns):
            out[name] = np.array([rows[r][i] for r in ids], table_dtype(chain[0], name)).reshape(
                (len(ids),) + table_row_shape(chain[0], name))
    return out


def table_dtype(table: dict, name: str):
    return {"weights": table["weights"], "state0": table["states"][0]}.get(name, table["arrays"].get(name)).dtype


def table_row_shape(table: dict, name: str) -> tuple:
    return {"weights": table["weights"], "state0": table["states"][0]}.get(name, table["arrays"].get(name)).shape[1:]


def written(tmp_path, chain: list[dict]) -> list[dict]:
    """Each table of `chain` written as a key file, and read back with its per-row members and ids in pieces."""
    out = []
    for at, table in enumerate(chain):
        directory = tmp_path / f"t{at}"
        directory.mkdir()
        entry = snapshots._write_key(directory, 1, table, checksum=False)
        entry["kind"] = "row_sparse"
        out.append(dict(snapshots._read_key(directory / "key1.npz", entry, pieces=True), meta=entry))
    return out


def flat(table: dict) -> dict:
    arrays = table["arrays"]
    out = {"row_ids": np.asarray(table["row_ids"]), "weights": np.asarray(table["weights"]),
           "state0": np.asarray(table["states"][0])}
    out.update({n: np.asarray(arrays[n]) for n in ("col_last", "pending_ids", "pending_count", "pending_last")})
    return out


@pytest.mark.parametrize("seed,deltas,chunk", [(0, 1, 5), (1, 3, 64), (2, 6, 7), (3, 4, 1 << 16), (4, 0, 11)])
def test_a_fold_in_pieces_equals_the_fold_of_the_arrays_and_the_model(tmp_path, monkeypatch, seed, deltas, chunk):
    monkeypatch.setattr(members, "LOAD_CHUNK", chunk)
    chain = random_chain(seed, deltas)
    parts = written(tmp_path, chain)
    assert isinstance(parts[0]["row_ids"], members.MemberPieces)
    if deltas:
        assert isinstance(parts[1]["arrays"]["dead_ids"], members.MemberPieces)
    folded = snapshots._fold_all(parts)
    assert isinstance(folded["row_ids"], members.FoldedRows) and isinstance(folded["weights"], members.FoldedColumn)
    assert len(folded["row_ids"]) == len(np.asarray(folded["row_ids"]))
    arrays_fold = chain[0]          # the fold of the arrays read whole, a delta at a time (load_snapshot's)
    for delta in chain[1:]:
        arrays_fold = snapshots._fold(arrays_fold, delta, base=True)
    want, got, whole = model(chain), flat(folded), flat(arrays_fold)
    for name, value in want.items():
        assert got[name].dtype == value.dtype and got[name].tobytes() == value.tobytes(), name
        assert whole[name].tobytes() == value.tobytes(), name
    table = RowTable.load({"row_ids": folded["row_ids"], "weights": folded["weights"], "states": folded["states"],
                           "columns": {"last": folded["arrays"]["col_last"]}})
    assert table.export()["row_ids"].tobytes() == want["row_ids"].tobytes()
    assert table.export()["weights"].tobytes() == want["weights"].tobytes()


@pytest.mark.parametrize("damage,match", [
    ("unsorted", r"key1\.npz: member 'row_ids': the ids are not sorted and unique"),
    ("twice", r"key1\.npz: member 'row_ids': the ids are not sorted and unique"),
    ("float", r"key1\.npz: member 'pending_ids' is not a 1-D array of integer ids"),
    ("2d", r"key1\.npz: member 'dead_ids' is not a 1-D array of integer ids"),
    ("column", r"key1\.npz: member 'col_last' of shape \(\d+,\) is not one row per id of 'row_ids'"),
    ("pending", r"key1\.npz: member 'pending_ids': the ids are not sorted and unique")])
def test_bad_ids_or_members_are_refused_naming_file_and_member(tmp_path, monkeypatch, damage, match):
    monkeypatch.setattr(members, "LOAD_CHUNK", 100)     # an id out of order in a later piece, or across two
    chain = random_chain(7, 1)
    table = chain[-1] if damage == "2d" else chain[0]
    ids = table["row_ids"]
    if damage == "unsorted":
        ids[[150, 151]] = ids[[151, 150]]
    elif damage == "twice":
        ids[100] = ids[99]
    elif damage == "float":
        table["arrays"]["pending_ids"] = table["arrays"]["pending_ids"].astype(np.float64)
    elif damage == "2d":
        table["arrays"]["dead_ids"] = np.stack([table["arrays"]["dead_ids"]] * 2, 1)
    elif damage == "column":
        table["arrays"]["col_last"] = table["arrays"]["col_last"][:-1]
    else:
        table["arrays"]["pending_ids"] = table["arrays"]["pending_ids"][::-1].copy()
    with pytest.raises(snapshots.SnapshotError, match=match):
        len(snapshots._fold_all(written(tmp_path, chain))["row_ids"])     # (load_snapshot counts the rows)


def test_a_fold_in_pieces_holds_a_few_pieces_not_the_rows(tmp_path, monkeypatch):
    """A base of 500k rows and three deltas folded and loaded into a table: traced memory beyond the table's own
    peaks under 2 MiB (with pieces of 2048 rows: what it holds is a few pieces of each source for each array the
    table reads at once, never their ids, an order of all rows or the rows picked from each: 4 MiB of ids alone)."""
    monkeypatch.setattr(members, "LOAD_CHUNK", 2048)
    monkeypatch.setattr(rows_module, "EXPORT_CHUNK", 2048)
    rng = np.random.default_rng(11)
    space = 2_000_000
    base_ids = np.unique(rng.integers(0, space, 520_000)).astype(np.uint64)[:500_000]
    chain = [{"row_ids": base_ids, "weights": np.zeros((len(base_ids), 2), np.float32), "states": [],
              "arrays": {"col_last": np.zeros(len(base_ids), np.int32)}, "meta": {"kind": "row_sparse"}}]
    for step in range(1, 4):
        ids = np.unique(rng.integers(0, space, 60_000)).astype(np.uint64)
        dead = np.setdiff1d(np.unique(rng.integers(0, space, 20_000)), ids).astype(np.uint64)
        chain.append({"row_ids": ids, "weights": np.full((len(ids), 2), step, np.float32), "states": [],
                      "arrays": {"col_last": np.full(len(ids), step, np.int32), "dead_ids": dead},
                      "meta": {"kind": "row_sparse", "mode": "delta"}})
    parts = written(tmp_path, chain)
    del chain, base_ids, ids, dead
    tracemalloc.start()
    try:
        folded = snapshots._fold_all(parts)
        rows = len(folded["row_ids"])
        table = RowTable.load({"row_ids": folded["row_ids"], "weights": folded["weights"], "states": [],
                               "columns": {"last": folded["arrays"]["col_last"]}})
        held, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(table) == rows > 450_000
    assert peak - held < 2 << 20, f"{(peak - held) / 2**20:.1f} MiB beyond what the table holds"
