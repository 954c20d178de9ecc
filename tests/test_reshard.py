"""Growing and shrinking a job's servers (persist/reshard.py, node/restore_from.py): a dist_sync job of stock
MXNet 1.9.1 workers trains N steps on 2 servers and stops (its servers' shutdown snapshots); a job of 3 servers
(KVSTORE_LAZY_RESTORE_FROM, the online form) and one of 1 server (kvstore-lazy reshard, the offline form) restore
from them and train M more steps. The final model, every stored row's optimizer states and the update counts must
equal, bit for bit, those of a 2-server job that trained N + M steps straight through. A damaged, partial or
unknown-format source is refused by name and never changed; a declaration that differs from the snapshot's is
refused naming the key and both values. The same grow and shrink with a memory budget, a disk tier and
admission/TTL policies in every job also carry the lifecycle columns and the ids waiting for admission. The online
form reads each key's rows of its range by seeking (persist/ranged.py): it gives each new server what the offline
form's whole, verified read gives it (base and deltas), reads its share of the rows plus the ids, and refuses
damaged ids by file and member."""
from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kvstore_lazy.launch import Job
from kvstore_lazy.persist import reshard, snapshots

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "workers" / "reshard_train.py"
ENV = {"OMP_NUM_THREADS": "1", "MXNET_KVSTORE_BIGARRAY_BOUND": "10000", "PYTHONPATH": str(ROOT)}
N, M = 6, 6


def run_job(out: Path, servers: int, start: int, steps: int, server_env: dict, extra: list[str] = ()) -> int:
    out.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, str(WORKER), "--out", str(out), "--start", str(start), "--steps", str(steps),
               *extra]
    with open(out / "job.log", "w") as log:
        job = Job(command, 2, servers, env=dict(ENV), server_env=server_env, out=log)
        try:
            job.start()
            return job.supervise(150)
        finally:
            job.stop()


def final(out: Path) -> dict:
    with np.load(out / "final.npz") as data:
        return {k: data[k] for k in data.files}


def one_server(snap: Path, tmp: Path) -> snapshots.Loaded:
    """A job's shutdown snapshots re-cut for one server: the whole model in one place, whatever the server count."""
    dst = tmp / f"one-{hashlib.sha1(str(snap).encode()).hexdigest()[:8]}"
    reshard.reshard(snap, dst, 1, bound=10000, log=lambda line: None)
    loaded = snapshots.load_snapshot(dst, 0)
    assert loaded is not None
    return loaded


def assert_same_state(a: snapshots.Loaded, b: snapshots.Loaded) -> None:
    assert sorted(a.tables) == sorted(b.tables) == [3, 4, 5]
    for key in a.tables:
        x, y = a.tables[key], b.tables[key]
        for name in ("row_ids", "weights"):
            assert x[name].tobytes() == y[name].tobytes(), f"key {key}: {name} differ"
        assert len(x["states"]) == len(y["states"]) == 1, f"key {key}: momentum state missing"
        for i, (s, t) in enumerate(zip(x["states"], y["states"])):
            assert s.tobytes() == t.tobytes(), f"key {key}: optimizer state {i} differs"
    counts = [m.manifest["server"]["optimizer_counts"] for m in (a, b)]
    assert counts[0] == counts[1] and counts[0]["counts"] == {"3": N + M, "4": N + M, "5": N + M}


def tree(path: Path) -> dict:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    base = tmp_path_factory.mktemp("reshard")
    assert run_job(base / "straight", 2, 0, N + M, {"KVSTORE_LAZY_SNAPSHOT_DIR": str(base / "straight/snap")}) == 0
    assert run_job(base / "first", 2, 0, N, {"KVSTORE_LAZY_SNAPSHOT_DIR": str(base / "first/snap")}) == 0
    return base


@pytest.mark.integration
def test_grow_to_three_servers_online(jobs, tmp_path):
    src = jobs / "first" / "snap"
    before = tree(src)
    out = tmp_path / "grown"
    code = run_job(out, 3, N, N + M, {"KVSTORE_LAZY_SNAPSHOT_DIR": str(out / "snap"),
                                      "KVSTORE_LAZY_RESTORE_FROM": str(src)})
    log = (out / "job.log").read_text()
    assert code == 0, log[-5000:]
    assert "KVSTORE_LAZY_RESTORE_FROM=" in log and "kv.init push from worker 0 is dropped" in log
    assert "keeping its states and counts" in log
    want, got = final(jobs / "straight"), final(out)
    assert want.keys() == got.keys() and all(want[k].tobytes() == got[k].tobytes() for k in want)
    assert_same_state(one_server(jobs / "straight" / "snap", tmp_path), one_server(out / "snap", tmp_path))
    assert tree(src) == before, "the source directory changed"


@pytest.mark.integration
def test_shrink_to_one_server_offline(jobs, tmp_path):
    src, dst = jobs / "first" / "snap", tmp_path / "one"
    before = tree(src)
    done = subprocess.run([sys.executable, "-m", "kvstore_lazy", "reshard", str(src), str(dst), "--servers", "1"],
                          capture_output=True, text=True, timeout=120, env={**ENV, "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr
    assert snapshots.snapshot_ranks(dst) == [0] and tree(src) == before
    out = tmp_path / "shrunk"
    code = run_job(out, 1, N, N + M, {"KVSTORE_LAZY_SNAPSHOT_DIR": str(dst)})
    assert code == 0, (out / "job.log").read_text()[-5000:]
    want, got = final(jobs / "straight"), final(out)
    assert want.keys() == got.keys() and all(want[k].tobytes() == got[k].tobytes() for k in want)
    assert_same_state(one_server(jobs / "straight" / "snap", tmp_path), one_server(dst, tmp_path))


@pytest.mark.integration
def test_another_declaration_is_refused_naming_both_values(jobs, tmp_path):
    out = tmp_path / "other-seed"
    code = run_job(out, 3, N, N + M, {"KVSTORE_LAZY_SNAPSHOT_DIR": str(out / "snap"),
                                      "KVSTORE_LAZY_RESTORE_FROM": str(jobs / "first" / "snap")}, ["--seed", "8"])
    log = (out / "job.log").read_text()
    assert code != 0
    assert "key 3 is declared by this job with seed 8 (restored: 7)" in log, log[-4000:]


# ----------------------------------------------------------------------------------------------------------------
# the same grow and shrink under dense semantics (SGD lazy_update=False: the stock server moves every row every step;
# ours keeps the key's step history and each row's tick, which the snapshots and the re-cut carry)

DENSE = ["--optimizer", "sgd-dense"]


@pytest.fixture(scope="module")
def dense_jobs(tmp_path_factory):
    base = tmp_path_factory.mktemp("reshard-dense")
    for name, steps in (("straight", N + M), ("first", N)):
        out = base / name
        env = {"KVSTORE_LAZY_SNAPSHOT_DIR": str(out / "snap")}
        assert run_job(out, 2, 0, steps, env, DENSE) == 0, (out / "job.log").read_text()[-4000:]
    return base


def assert_dense_history(loaded: snapshots.Loaded) -> None:
    meta = loaded.tables[3]["meta"]
    assert meta["history"]["eras"][0]["rule"] == "sgd_mom" and "col_tick" in loaded.tables[3]["arrays"]


@pytest.mark.integration
@pytest.mark.parametrize("form", ["online-3", "offline-1"])
def test_grow_and_shrink_under_dense_semantics(dense_jobs, tmp_path, form):
    src = dense_jobs / "first" / "snap"
    before = tree(src)
    out = tmp_path / form
    if form == "online-3":
        servers, env = 3, {"KVSTORE_LAZY_SNAPSHOT_DIR": str(out / "snap"), "KVSTORE_LAZY_RESTORE_FROM": str(src)}
    else:
        dst = tmp_path / "one"
        reshard.reshard(src, dst, 1, bound=10000, log=lambda line: None)
        servers, env = 1, {"KVSTORE_LAZY_SNAPSHOT_DIR": str(dst)}
    code = run_job(out, servers, N, N + M, env, DENSE)
    assert code == 0, (out / "job.log").read_text()[-5000:]
    want, got = final(dense_jobs / "straight"), final(out)
    assert want.keys() == got.keys() and all(want[k].tobytes() == got[k].tobytes() for k in want)
    straight = one_server(dense_jobs / "straight" / "snap", tmp_path)
    moved = one_server(Path(env["KVSTORE_LAZY_SNAPSHOT_DIR"]), tmp_path)
    assert_dense_history(straight)
    assert_same_state(straight, moved)
    assert moved.tables[3]["meta"]["history"] == straight.tables[3]["meta"]["history"]
    assert tree(src) == before, "the source directory changed"


# ----------------------------------------------------------------------------------------------------------------
# refusals (the source of the jobs above, copied and damaged)


@pytest.fixture
def source(jobs, tmp_path):
    copy = tmp_path / "src"
    for rank in (0, 1):
        for file in (jobs / "first" / "snap" / f"rank{rank}").iterdir():
            (copy / f"rank{rank}").mkdir(parents=True, exist_ok=True)
            (copy / f"rank{rank}" / file.name).write_bytes(file.read_bytes())
    return copy


@pytest.mark.integration
def test_a_damaged_file_is_refused_by_name(source, tmp_path):
    victim = source / "rank0" / "key3.npz"
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    with pytest.raises(snapshots.SnapshotError, match=str(victim)):
        reshard.reshard(source, tmp_path / "out", 3)
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out*"))


@pytest.mark.integration
def test_a_partial_or_unknown_source_is_refused(source, tmp_path):
    manifest = source / "rank1" / "manifest.json"
    text = manifest.read_text()
    manifest.write_text(json.dumps(dict(json.loads(text), format=7)))
    with pytest.raises(snapshots.SnapshotError, match=f"{manifest}: unknown snapshot format 7"):
        reshard.reshard(source, tmp_path / "out", 3)
    manifest.unlink()
    with pytest.raises(reshard.ReshardError, match="partial source"):
        reshard.reshard(source, tmp_path / "out", 3)
    done = subprocess.run([sys.executable, "-m", "kvstore_lazy.persist.reshard", str(source), str(tmp_path / "o"),
                           "--servers", "2"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and "partial source" in done.stderr and len(done.stderr.splitlines()) == 1


@pytest.mark.integration
def test_disk_tier_rows_and_lifecycle_columns_carry_over(tmp_path):
    """A source whose servers kept rows in a disk tier (a tiny memory budget) and ids waiting for admission: the
    re-cut holds every row of both tiers with its states and columns, and every pending id with its count, as the
    server's own restore (into memory, no tier) reads them."""
    from kvstore_lazy.server.core import KVServer

    out = tmp_path / "tiered"
    env = {"KVSTORE_LAZY_SNAPSHOT_DIR": str(out / "snap"), "KVSTORE_LAZY_MEMORY_BUDGET": "6KiB",
           "KVSTORE_LAZY_DISK_DIR": str(out / "disk"), "KVSTORE_LAZY_ADMIT_MIN_COUNT": "2"}
    assert run_job(out, 2, 0, N, env) == 0, (out / "job.log").read_text()[-4000:]
    assert list((out / "snap").glob("rank*/key3.disk")), "no disk tier in the source"
    src = tmp_path / "src-copy"             # the oracle opens stores in place: give it a copy
    subprocess.run(["cp", "-a", str(out / "snap"), str(src)], check=True)
    reshard.reshard(out / "snap", tmp_path / "one", 1, log=lambda line: None)
    got = snapshots.load_snapshot(tmp_path / "one", 0).tables[3]
    parts, pending = [], []
    for rank in (0, 1):
        loaded = snapshots.load_snapshot(src, rank)
        server = KVServer(rank, 2, 2)
        server.restore(loaded.manifest["server"], loaded.tables)
        entry = server.keys[3]
        parts.append(entry.all_rows())
        pending.append(entry.policy.pending_rows())
    ids = np.concatenate([p["row_ids"] for p in parts])
    assert len(got["row_ids"]) == len(ids) > 0 and got["row_ids"].tobytes() == ids.tobytes()
    assert got["weights"].tobytes() == np.concatenate([p["weights"] for p in parts]).tobytes()
    assert got["states"][0].tobytes() == np.concatenate([p["states"][0] for p in parts]).tobytes()
    for name in parts[0]["columns"]:
        assert got["arrays"][f"col_{name}"].tobytes() == np.concatenate([p["columns"][name] for p in parts]).tobytes()
    want_pending = np.concatenate([p["row_ids"] for p in pending])
    assert len(want_pending) and got["arrays"]["pending_ids"].tobytes() == want_pending.tobytes()
    assert got["arrays"]["pending_count"].tobytes() == \
        np.concatenate([p["weights"].reshape(-1) for p in pending]).tobytes()


def test_the_launcher_sets_restore_from_for_servers_only(tmp_path):
    from kvstore_lazy.launch.errors import LaunchError
    from kvstore_lazy.launch.options import build_parser, job_from_args

    def job(*argv):
        return job_from_args(build_parser().parse_args(["-n", "2", "-s", "3", *argv, "python", "train.py"]))

    with pytest.raises(LaunchError, match="--restore-from needs --snapshot-dir"):
        job("--restore-from", str(tmp_path / "old"))
    with pytest.raises(LaunchError, match="is this job's --snapshot-dir"):
        job("--restore-from", str(tmp_path / "old"), "--snapshot-dir", str(tmp_path / "old"))
    made = job("--restore-from", str(tmp_path / "old"), "--snapshot-dir", str(tmp_path / "new"))
    assert made.server_env["KVSTORE_LAZY_RESTORE_FROM"] == str(tmp_path / "old")
    assert "KVSTORE_LAZY_RESTORE_FROM" not in made.env and "KVSTORE_LAZY_RESTORE_FROM" not in made.worker_env


# ----------------------------------------------------------------------------------------------------------------
# the same grow and shrink with the row lifecycle active in every job: a memory budget small enough that rows go to
# the disk tier (a directory per job), admission after 2 pushes and a TTL in rounds


def lifecycle_env(out: Path, **more: str) -> dict:
    return {"KVSTORE_LAZY_SNAPSHOT_DIR": str(out / "snap"), "KVSTORE_LAZY_MEMORY_BUDGET": "6KiB",
            "KVSTORE_LAZY_DISK_DIR": str(out / "disk"), "KVSTORE_LAZY_ADMIT_MIN_COUNT": "2",
            "KVSTORE_LAZY_TTL_ROUNDS": "4", **more}


def assert_same_lifecycle(a: snapshots.Loaded, b: snapshots.Loaded) -> None:
    """Model, states and counts as :func:`assert_same_state`, and every lifecycle column of every row and every id
    waiting for admission with its count and round (both re-cut for one server: both tiers' rows in one table)."""
    assert_same_state(a, b)
    x, y = a.tables[3]["arrays"], b.tables[3]["arrays"]
    assert sorted(x) == sorted(y) and any(n.startswith("col_") for n in x), sorted(x)
    assert len(x.get("pending_ids", ())) > 0, "no id waiting for admission: the policy was not exercised"
    policies = [m.tables[3]["meta"]["policy_state"] for m in (a, b)]
    assert policies[0]["round"] == policies[1]["round"] == N + M
    assert all(p["counters"]["evicted_ttl"] > 0 for p in policies), "the TTL removed no row"
    for name in x:
        assert x[name].tobytes() == y[name].tobytes(), f"key 3: {name} differs"


@pytest.fixture(scope="module")
def tiered_jobs(tmp_path_factory):
    base = tmp_path_factory.mktemp("reshard-tiered")
    for name, steps in (("straight", N + M), ("first", N)):
        out = base / name
        assert run_job(out, 2, 0, steps, lifecycle_env(out)) == 0, (out / "job.log").read_text()[-4000:]
    assert list((base / "first" / "snap").glob("rank*/key3.disk")), "no disk tier in the source"
    return base


@pytest.mark.integration
def test_grow_with_lifecycle_and_disk_tier(tiered_jobs, tmp_path):
    src = tiered_jobs / "first" / "snap"
    before = tree(src)
    out = tmp_path / "grown"
    code = run_job(out, 3, N, N + M, lifecycle_env(out, KVSTORE_LAZY_RESTORE_FROM=str(src)))
    assert code == 0, (out / "job.log").read_text()[-5000:]
    assert list((out / "disk").rglob("*")), "the new job's budget sent no row to its disk tier"
    want, got = final(tiered_jobs / "straight"), final(out)
    assert want.keys() == got.keys() and all(want[k].tobytes() == got[k].tobytes() for k in want)
    assert_same_lifecycle(one_server(tiered_jobs / "straight" / "snap", tmp_path), one_server(out / "snap", tmp_path))
    assert tree(src) == before, "the source directory changed"


@pytest.mark.integration
def test_shrink_with_lifecycle_and_disk_tier(tiered_jobs, tmp_path):
    src, dst = tiered_jobs / "first" / "snap", tmp_path / "one"
    before = tree(src)
    reshard.reshard(src, dst, 1, bound=10000, log=lambda line: None)
    assert tree(src) == before
    out = tmp_path / "shrunk"
    code = run_job(out, 1, N, N + M, lifecycle_env(out, KVSTORE_LAZY_SNAPSHOT_DIR=str(dst)))
    assert code == 0, (out / "job.log").read_text()[-5000:]
    want, got = final(tiered_jobs / "straight"), final(out)
    assert want.keys() == got.keys() and all(want[k].tobytes() == got[k].tobytes() for k in want)
    assert_same_lifecycle(one_server(tiered_jobs / "straight" / "snap", tmp_path), one_server(dst, tmp_path))


def _same_tables(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    for key in a:
        x, y = a[key], b[key]
        for name in ("row_ids", "weights"):
            assert np.asarray(x[name]).tobytes() == np.asarray(y[name]).tobytes(), f"key {key}: {name} differ"
        assert [s.tobytes() for s in x["states"]] == [s.tobytes() for s in y["states"]], f"key {key}: states"
        xa, ya = x.get("arrays", {}), y.get("arrays", {})
        assert sorted(xa) == sorted(ya) and all(xa[n].tobytes() == ya[n].tobytes() for n in xa), f"key {key}"
        assert {k: v for k, v in x["meta"].items() if k != "rows"} == {k: v for k, v in y["meta"].items()
                                                                        if k != "rows"}


@pytest.mark.integration
@pytest.mark.parametrize("servers", [1, 3, 4])
def test_the_online_form_reads_by_range_what_the_offline_form_reads_whole(tiered_jobs, servers):
    """restore_for (each key's rows of the server's range, read by seeking; disk tier records of the range) gives
    each new rank exactly what the offline form's whole, verified read gives it; growing, a server reads less than
    the source holds."""
    src = tiered_jobs / "first" / "snap"
    whole = reshard.Source.open(src)
    size = sum(p.stat().st_size for p in src.rglob("*") if p.is_file())
    for rank in range(servers):
        counter = reshard.ranged.Counter()
        got = reshard.restore_for(src, rank, servers, bound=10000, counter=counter)
        server, want = reshard.rank_state(whole, rank, servers, 10000)
        assert got.manifest["server"] == server
        _same_tables({k: dict(t, disk=None) for k, t in got.tables.items()},
                     {k: dict(t, disk=None) for k, t in want.items()})
        assert 0 < counter.total < 2 * size


@pytest.mark.integration
def test_the_online_form_refuses_damaged_row_ids_by_name(source, tmp_path):
    import struct
    import zipfile

    victim = source / "rank1" / "key3.npz"
    with zipfile.ZipFile(victim) as archive:
        info = archive.getinfo("row_ids.npy")
    data = bytearray(victim.read_bytes())
    name, extra = struct.unpack_from("<2H", data, info.header_offset + 26)     # the local header's lengths
    data[info.header_offset + 30 + name + extra + info.file_size - 3] ^= 0x01  # in the last id
    victim.write_bytes(bytes(data))
    with pytest.raises(snapshots.SnapshotError, match=f"{victim}: member 'row_ids' is corrupted"):
        reshard.restore_for(source, 1, 3, bound=10000)


def synthetic_tables(rows: int, servers: int, rank: int, dim: int = 8, every: int = 3) -> tuple[dict, dict]:
    """(server state, tables) of rank `rank` of `servers`: every `every`-th row of a lazy key of `rows` rows (one
    state, two lifecycle columns, ids waiting for admission) and a small dense key."""
    spec = {"key": 3, "rows": rows, "row_shape": [dim], "dtype": "float32", "init": "zeros", "seed": 1,
            "bound": 1000}
    server = {"sync_mode": True, "specs": [spec], "aliases": {},
              "optimizer_counts": {"num_update": 5, "counts": {"3": 5, "9": 5}}}
    first, count = reshard.mx.row_partition(rows, servers, rank)
    ids = np.arange(first, first + count, every, dtype=np.uint64)
    weights = (ids[:, None] * dim + np.arange(dim)).astype(np.float32)
    pending = ids[:-1] + np.uint64(1)
    sparse = {"row_ids": ids, "weights": weights, "states": [-weights],
              "arrays": {"col_count": ids.astype(np.uint32), "col_last": ids.astype(np.int64) * 2,
                         "pending_ids": pending, "pending_count": np.ones(len(pending), np.uint32),
                         "pending_last": pending.astype(np.int64)},
              "meta": {"kind": "row_sparse", "dtype": "float32", "row_size": dim, "local_rows": count,
                       "row_offset": first, "lazy": True, "rank": rank}}
    tables = {3: sparse}
    if reshard.mx.dense_home_server(9, servers) == rank:
        tables[9] = {"row_ids": np.zeros(1, np.uint64), "weights": np.ones((1, 16), np.float32),
                     "states": [np.zeros((1, 16), np.float32)], "meta": {"kind": "dense", "dtype": "float32"}}
    return server, tables


def synthetic_source(directory: Path, rows: int, servers: int = 2) -> int:
    """A snapshot of :func:`synthetic_tables` written by the snapshots' own writer; the bytes of its row_sparse key
    files."""
    size = 0
    for rank in range(servers):
        server, tables = synthetic_tables(rows, servers, rank)
        snapshots.write_snapshot(directory, rank, servers, tables, server)
        size += (directory / f"rank{rank}" / "key3.npz").stat().st_size
    return size


def test_each_new_server_reads_its_share_by_seeking(tmp_path):
    """2 -> 4 servers: each new server reads of the row_sparse key its quarter of the rows (plus the ids, the
    index), and gets exactly what the offline form's whole read gives it."""
    size = synthetic_source(tmp_path / "src", 40000)
    whole = reshard.Source.open(tmp_path / "src")
    for rank in range(4):
        counter = reshard.ranged.Counter()
        got = reshard.restore_for(tmp_path / "src", rank, 4, bound=1000, counter=counter)
        _same_tables(got.tables, reshard.rank_state(whole, rank, 4, 1000)[1])
        rows = len(got.tables[3]["row_ids"])
        per_row = 8 * 4 * 2 + 4 + 8 + 4 + 8        # weights, state, col_count, col_last, pending count and last
        dense = 1024 if 9 in got.tables else 0        # the dense key, read whole with its npy headers
        assert rows > 3000 and counter.rows <= rows * per_row + dense
        assert counter.ids < size / 4 and counter.deltas == counter.whole == 0, counter
        assert counter.rows + counter.ids < 0.55 * size, (counter, size)


def test_the_online_form_folds_deltas_as_the_servers_own_restore_does(tmp_path):
    """A base and two deltas per rank (rows changed and added in every new range, rows and waiting ids removed,
    a full rewrite of the dense key): each of 3 new servers restores by range exactly what the offline form,
    which folds with ``snapshots.load_snapshot``, gives it."""
    src = tmp_path / "src"
    for rank in range(2):
        server, tables = synthetic_tables(30000, 2, rank)
        chain = snapshots.SnapshotChain(src, rank, 2)
        chain.write(server, tables, delta=False)
        for step in (1, 2):
            base = tables[3]
            changed = base["row_ids"][step::7] + np.uint64(step)      # existing ids moved by one: new rows
            ids = np.union1d(base["row_ids"][::5], changed).astype(np.uint64)
            weights = (ids[:, None] * 0.5 + np.arange(8) + step).astype(np.float32)
            pending = base["arrays"]["pending_ids"]
            delta = {"row_ids": ids, "weights": weights, "states": [weights * 2], "mode": "delta",
                     "meta": base["meta"],
                     "arrays": {"col_count": ids.astype(np.uint32) + step, "col_last": ids.astype(np.int64) + step,
                                "dead_ids": np.setdiff1d(base["row_ids"][3::11], ids).astype(np.uint64),
                                "pending_ids": pending[::9], "pending_count": np.full(len(pending[::9]), 1 + step,
                                                                                      np.uint32),
                                "pending_last": pending[::9].astype(np.int64) + step,
                                "pending_dead": pending[4::13]}}
            out = {3: delta}
            if 9 in tables:
                out[9] = dict(tables[9], weights=tables[9]["weights"] * (step + 1), mode="full")
            chain.write(dict(server, optimizer_counts={"num_update": 5 + step, "counts": {"3": 5 + step}}), out,
                        delta=True)
    assert len(list(src.glob("rank*/delta-*"))) == 4
    whole = reshard.Source.open(src)
    for rank in range(3):
        counter = reshard.ranged.Counter()
        got = reshard.restore_for(src, rank, 3, bound=1000, counter=counter)
        server, want = reshard.rank_state(whole, rank, 3, 1000)
        assert got.manifest["server"] == server and counter.deltas > 0
        _same_tables(got.tables, want)
