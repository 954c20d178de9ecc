"""Lazy row_sparse keys against stock workers (issue: lazy row tables).

- the init push of a lazy (10_000_000, 32) key ships no rows (bytes the worker's TCP sockets sent during kv.init),
  next to the stock server initialising the same key in the same test;
- the rows stored across all servers are exactly the rows trained (the default policy, push; with touch, the rows
  pulled or pushed), and pulled values before any update equal the initializer's function of (seed, key, row),
  whatever the number of servers and the pull order;
- with rows given explicitly at init, training matches the stock server on every row;
- a pull of a row beyond input_dim makes the worker fail loudly, the server logs it and stays up;
- fetch_rows, fetch_states and a save/restore of optimizer states (what Gluon's Trainer.save_states/load_states
  run) give global row ids for a key that was never declared lazy and is split over 2 servers (each server knows
  its rows by local id only), and the restore writes each server's own rows.
"""
import numpy as np
import pytest

from common import load
from lazy_jobs import stored_rows as snapshot_rows
from kvstore_lazy.persist import checkpoint
from kvstore_lazy.numerics.initializers import parse_initializer
from kvstore_lazy.protocol.mxnet import row_partition

pytestmark = pytest.mark.integration

UNIFORM = '["uniform", {"scale": 0.07}]'


def run(job_factory, name, server, servers, args, mode="dist_sync", bound=1000, timeout=180, workers=2,
        server_env=None):
    job = job_factory(name, num_workers=workers, num_servers=servers, server=server,
                      mode_env={"MXNET_KVSTORE_BIGARRAY_BOUND": str(bound)})
    env = {"KVSTORE_LAZY_SNAPSHOT_DIR": str(job.tmp / "snap")}
    env.update(server_env or {})
    job.start(server_env=env)
    out = str(job.tmp / "res")
    job.run_workers("lazy.py", ["--out", out, "--mode", mode] + args, timeout=timeout)
    return [load(out, r) for r in range(workers)], job


def stored_rows(job, servers, key):
    """Global row ids stored on all servers, from the snapshots they write at shutdown."""
    return snapshot_rows(job.tmp / "snap", servers, key)


def expected_rows(ids, rows, dim, seed=42, key=3, init=UNIFORM):
    return parse_initializer(init).rows(seed, key, np.asarray(ids, np.uint64), (rows, dim), np.float32)


@pytest.mark.parametrize("servers,bound,materialize", [(1, 1000, "touch"), (2, 1000, None), (2, 10 ** 9, None)],
                         ids=["1server-touch", "2servers-partitioned", "2servers-unpartitioned"])
def test_lazy_init_ships_no_rows_and_stores_only_trained(job_factory, servers, bound, materialize):
    rows, dim = 10_000_000, 32
    res, job = run(job_factory, "lazy", "lazy", servers,
                   ["--init", "lazy", "--rows", str(rows), "--dim", str(dim), "--optimizer", "sgd",
                    "--shuffle-pulls"], bound=bound,
                   server_env={"KVSTORE_LAZY_MATERIALIZE": materialize} if materialize else None)
    # rank 0 pushed the init: no rows, only master keys and the declaration command
    assert res[0]["init_bytes"] < 4096, res[0]["init_bytes"]
    # before any update every worker saw the initializer's values, in any pull order
    for r in range(2):
        np.testing.assert_array_equal(res[r]["probe_vals"], expected_rows(res[r]["probe_ids"], rows, dim))
    # push (the default): the probe rows pulled and never pushed are not stored; touch: every row pulled is
    stored = "touched" if materialize == "touch" else "trained"
    want = np.unique(np.concatenate([res[r][stored] for r in range(2)])).astype(np.uint64)
    np.testing.assert_array_equal(stored_rows(job, servers, 3), want)
    if materialize is None:
        assert len(want) < len(np.unique(np.concatenate([res[r]["touched"] for r in range(2)])))
    # training moved the rows
    assert not np.allclose(res[0]["final_vals"], expected_rows(res[0]["final_ids"], rows, dim))


def test_stock_init_ships_every_row(job_factory):
    """The same key on the stock server: kv.init must ship every row (here 1_000_000 x 32 float32 = 128 MB;
    10_000_000 rows ship 1.28 GB and are measured by `make bench`)."""
    rows, dim = 1_000_000, 32
    res, _ = run(job_factory, "stock", "stock", 1,
                 ["--init", "explicit", "--rows", str(rows), "--dim", str(dim), "--optimizer", "sgd", "--steps", "1"])
    assert res[0]["init_bytes"] >= rows * dim * 4


@pytest.mark.parametrize("optimizer", ["sgd", "adam", "adagrad", "ftrl"])
def test_explicit_rows_match_stock(job_factory, optimizer):
    args = ["--init", "explicit", "--rows", "2000", "--dim", "8", "--optimizer", optimizer, "--steps", "6"]
    stock, _ = run(job_factory, "stock", "stock", 2, args)
    lazy, _ = run(job_factory, "lazy", "lazy", 2, args)
    for r in range(2):
        np.testing.assert_array_equal(lazy[r]["final_ids"], stock[r]["final_ids"])
        np.testing.assert_allclose(lazy[r]["final_vals"], stock[r]["final_vals"], rtol=1e-6, atol=1e-7)
        np.testing.assert_array_equal(lazy[r]["probe_vals"], stock[r]["probe_vals"])


def test_same_initial_rows_with_1_and_2_servers_and_shuffled_pulls(job_factory):
    args = ["--init", "lazy", "--rows", "100000", "--dim", "4", "--optimizer", "adam",
            "--initializer", '["normal", {"sigma": 0.5}]']
    one, _ = run(job_factory, "one", "lazy", 1, args)
    two, _ = run(job_factory, "two", "lazy", 2, args + ["--shuffle-pulls"], mode="dist_async")
    for r in range(2):
        np.testing.assert_array_equal(one[r]["probe_vals"], two[r]["probe_vals"])
        np.testing.assert_array_equal(one[r]["probe_vals"],
                                      expected_rows(one[r]["probe_ids"], 100000, 4, init='["normal", {"sigma": 0.5}]'))


def test_pull_beyond_input_dim_fails_the_worker_loudly(job_factory):
    job = job_factory("bad", num_workers=1, num_servers=1, server="lazy")
    job.start()
    job.spawn_workers("lazy.py", ["--out", str(job.tmp / "res"), "--init", "lazy", "--rows", "1000", "--bad-row"])
    codes = job.wait_for(["worker0"], timeout=60)
    assert codes["worker0"] != 0
    assert job.alive("server0"), "the server must survive a bad request"
    worker_log = job.log("worker0")
    assert "UNEXPECTED" not in worker_log
    assert "Check failed" in worker_log
    server_log = job.log("server0")
    assert "row 1005 is out of range" in server_log and "worker 0" in server_log


def test_fetch_rows_returns_exactly_the_stored_rows_and_checkpoint_loads(job_factory):
    rows, dim = 10_000_000, 4
    res, job = run(job_factory, "fetch", "lazy", 2,
                   ["--init", "lazy", "--rows", str(rows), "--dim", str(dim), "--optimizer", "adam", "--fetch"])
    r0 = res[0]
    trained = np.unique(np.concatenate([res[r]["trained"] for r in range(2)]))   # the rows that exist (push policy)
    np.testing.assert_array_equal(r0["fetched_ids"], trained)
    np.testing.assert_array_equal(stored_rows(job, 2, 3), trained.astype(np.uint64))
    # values: what rank 0 pulled at the end for the rows it used that exist
    mine = np.isin(r0["final_ids"], trained)
    pos = np.searchsorted(r0["fetched_ids"], r0["final_ids"][mine])
    np.testing.assert_array_equal(r0["fetched_vals"][pos], r0["final_vals"][mine])
    # Adam keeps two states per row; they equal the servers' snapshot
    assert int(r0["fetched_num_states"]) == 2
    snap_states = {}
    for rank in range(2):
        info = checkpoint.read_manifest(job.tmp / "snap", rank)["keys"]["3"]
        part = checkpoint.read_snapshot_key(job.tmp / "snap", rank, 3, info)
        for i, row in enumerate(part["row_ids"].tolist()):
            snap_states[row] = part["states"][0][i]
    np.testing.assert_array_equal(r0["fetched_state0"], np.stack([snap_states[i] for i in trained.tolist()]))
    # the checkpoint mx.nd.load reads holds exactly those rows, and its sidecar what init_lazy declared
    assert str(r0["loaded_stype"]) == "row_sparse"
    np.testing.assert_array_equal(r0["loaded_indices"], trained)
    np.testing.assert_array_equal(r0["loaded_data"], r0["fetched_vals"])
    assert checkpoint.lazy_params(job.tmp / "res.params") == {
        "arg:embed_weight": {"key": 3, "rows": rows, "row_shape": [dim], "dtype": "float32", "init": UNIFORM,
                             "seed": 42}}


UNDECLARED, DECLARED, SMALL = 3, 5, 7     # tests/workers/undeclared_states.py
STATE_SHAPES = {UNDECLARED: (1000, 4), DECLARED: (1000, 4), SMALL: (60, 4)}


def snapshot_states(snap_dir, servers: int, key: int, bound: int) -> tuple[np.ndarray, list[np.ndarray]]:
    """(global row ids, [states]) of `key` in the servers' snapshots in `snap_dir`. A key that was not declared lazy
    is stored by local id: made global here with the part of the key MXNet's worker gives each server."""
    rows, dim = STATE_SHAPES[key]
    ids, states = [], []
    for rank in range(servers):
        info = checkpoint.read_manifest(snap_dir, rank)["keys"].get(str(key))
        if info is None:
            continue
        part = checkpoint.read_snapshot_key(snap_dir, rank, key, info)
        first = 0 if info["lazy"] or rows * dim < bound else row_partition(rows, servers, rank)[0]
        ids.append(part["row_ids"].astype(np.int64) + first)
        states.append(part["states"])
    order = np.argsort(np.concatenate(ids))
    return (np.concatenate(ids)[order],
            [np.concatenate([s[j] for s in states])[order] for j in range(len(states[0]))])


def positions(saved_ids, ids, key) -> np.ndarray:
    """Where the saved rows are among the rows that exist later: all of them (a declared key may have more)."""
    assert np.isin(saved_ids, ids).all() and (key == DECLARED or len(ids) == len(saved_ids))
    return np.searchsorted(ids, saved_ids)


def test_undeclared_split_key_states_fetch_save_and_restore_by_global_row_id(job_factory):
    """A key kv.init'ed with every row and never declared, split over 2 servers: each server lists its rows by local
    id (its init push carried ids relative to its part), and fetch_rows/fetch_states must return global ids (they
    returned [0..499, 0..499]), a save of the states must hold them, and its restore must write each server's
    rows by the server's local ids. A declared split key and an unsplit undeclared key alongside, unchanged."""
    bound = 1000
    job = job_factory("undeclared", num_workers=2, num_servers=2, server="lazy",
                      mode_env={"MXNET_KVSTORE_BIGARRAY_BOUND": str(bound)})
    snap = job.tmp / "snap"
    job.start(server_env={"KVSTORE_LAZY_SNAPSHOT_DIR": str(snap)})
    out = str(job.tmp / "res")
    job.run_workers("undeclared_states.py", ["--out", out], timeout=60)
    r0 = load(out, 0)
    for key, (rows, dim) in STATE_SHAPES.items():
        ids = r0[f"fetched_ids{key}"]
        # what the servers held when rank 0 read them: their tagged snapshot, by global row id
        held_ids, held = snapshot_states(snap / "tagged", 2, key, bound)
        assert int(r0[f"fetched_num_states{key}"]) == 2 == len(held)
        np.testing.assert_array_equal(ids, held_ids)
        if key != DECLARED:   # every row of a key inited with every row exists
            np.testing.assert_array_equal(ids, np.arange(rows))
        # values: a row_sparse_pull of every row
        np.testing.assert_array_equal(r0[f"pulled_ids{key}"], np.arange(rows))
        np.testing.assert_array_equal(r0[f"fetched{key}"], r0[f"pulled{key}"][ids])
        for j in range(2):
            np.testing.assert_array_equal(r0[f"fetched_state{j}_{key}"], held[j])
            # fetch_states and the saved file: the same rows and states
            np.testing.assert_array_equal(r0[f"states_ids{key}"], ids)
            np.testing.assert_array_equal(r0[f"states_state{j}_{key}"], held[j])
            np.testing.assert_array_equal(r0[f"saved_ids{key}"], ids)
            np.testing.assert_array_equal(r0[f"saved_state{j}_{key}"], held[j])
        # more training changed the states on both servers' parts; the restore put the saved ones back, each
        # server's on its own rows (the servers' snapshots at exit). A declared key gained rows since the save,
        # which the restore leaves alone.
        changed = np.any(r0[f"retrained_state0_{key}"][positions(ids, r0[f"retrained_ids{key}"], key)] != held[0],
                         axis=1)
        assert changed[ids < rows // 2].any() and changed[ids >= rows // 2].any()
        restored = positions(ids, r0[f"restored_ids{key}"], key)
        final_ids, final = snapshot_states(snap, 2, key, bound)
        np.testing.assert_array_equal(final_ids, r0[f"restored_ids{key}"])
        for j in range(2):
            np.testing.assert_array_equal(r0[f"restored_state{j}_{key}"][restored], held[j])
            np.testing.assert_array_equal(final[j][restored], held[j])
