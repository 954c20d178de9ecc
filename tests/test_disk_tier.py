"""The disk tier in the server, sans-IO (KVSTORE_LAZY_DISK_DIR under a memory budget): rows the budget pushes out go
to disk whole and come back on their next touch, so the job is bit-identical to the same job with no budget at all;
admission and TTL act across both tiers; the accounting counts the disk index; bad settings are refused."""
from __future__ import annotations

import re

import numpy as np
import pytest

from kvstore_lazy.server.lifecycle import Settings
from kvstore_lazy.server.modes import MATERIALIZE_ON_PUSH, MATERIALIZE_ON_TOUCH
from kvstore_lazy.store import tier as tier_module
from kvstore_lazy.store.segments import DenseIndex
from test_lifecycle import DIM, KEY, ROWS, key_stats, server, streams, sync_round


# both indexes' buckets (memory, disk) and 200 rows of 48 bytes (4 + 4 floats, 8 of columns, 8 of id)
BUDGET = 4096 * 4 + 4096 * 4 + 200 * 48


def budget_for(index: str, monkeypatch) -> int:
    """BUDGET for a disk tier with a hash index; with "dense", the key's dense index (4 bytes a possible row) instead
    of the hash index's buckets, and the dense index chosen for it (the share of the budget it may take raised to
    all of it)."""
    if index == "hash":
        return BUDGET
    monkeypatch.setattr(tier_module, "DENSE_SHARE", 1)
    return BUDGET - 4096 * 4 + 4 * ROWS


def index_kind(peer) -> str:
    return "dense" if isinstance(peer.server.keys[KEY].disk.store._index, DenseIndex) else "hash"


def run(history, settings=None, pulls=True, **policy):
    peer, workers = server(settings=settings, **policy)
    pulled = []
    for step, per_worker in enumerate(history):
        if pulls:    # every worker pulls the rows it is about to push (as a training step does)
            pulled += [peer.values(w.rsp_pull(KEY, ids)) for w, ids in zip(workers, per_worker)]
        sync_round(peer, workers, per_worker, step)
    return peer, pulled


def tables(peer) -> dict:
    t = peer.server.keys[KEY].all_rows()
    return {"ids": t["row_ids"].tobytes(), "weights": t["weights"].tobytes(),
            "states": [s.tobytes() for s in t["states"]]}


# low watermark None: the disk tier's default (0.98); 0.9 (passes of a tenth of the budget) moves more rows in 40
# rounds, through compaction too
@pytest.mark.parametrize("evict,segment_rows,index,watermark", [
    ("lru", 1 << 16, "hash", None), ("lfu", 1 << 16, "hash", 0.9), ("lru", 64, "hash", 0.9),
    ("lru", 1 << 16, "dense", None), ("lfu", 64, "dense", 0.9)])
def test_rows_through_disk_and_back_are_bit_identical_to_no_budget(tmp_path, monkeypatch, evict, segment_rows,
                                                                    index, watermark):
    history = streams(rounds=40, span=20_000, batch=100)
    free, free_pulls = run(history)
    budget = budget_for(index, monkeypatch)
    tier, tier_pulls = run(history, Settings(memory_budget=budget, evict=evict, disk_dir=str(tmp_path),
                                             disk_segment_rows=segment_rows, low_watermark=watermark))
    assert index_kind(tier) == index
    assert all(np.array_equal(a, b) for a, b in zip(free_pulls, tier_pulls))
    assert tables(tier) == tables(free)               # every row, weights and momentum, both tiers together
    s = key_stats(tier)
    assert s["demoted"] > 500 and s["promoted"] > 100 and s["disk_rows"] > 500 \
        and s["rows"] < (350 if watermark == 0.9 else 400)   # the 0.98 default keeps memory fuller
    assert s["evicted"] == 0 and s["rows"] + s["disk_rows"] == len(np.frombuffer(tables(free)["ids"], np.uint64))
    assert 0 < s["hit_rate"] < 1
    accounted = tier.server.lifecycle.accounted(tier.server.keys)
    entry = tier.server.keys[KEY]
    assert accounted == entry._table.nbytes() + entry.disk.index_nbytes() <= budget
    assert (tmp_path / "rank0" / f"key{KEY}" / "store.json").exists()
    store = entry.disk.store
    if segment_rows == 64:        # small segments: promotions leave garbage, compaction reclaims it
        assert store.counters["segments_compacted"] >= 2
        files = list((tmp_path / "rank0" / f"key{KEY}").glob("seg-*.dat"))
        assert len(files) == store.stats()["segments"] <= len(entry.disk) // 64 * 2 + 2


@pytest.mark.parametrize("index", ["hash", "dense"])
def test_admission_and_ttl_act_on_both_tiers(tmp_path, monkeypatch, index):
    history = streams(rounds=48, span=20_000, batch=100)
    policy = dict(admit_min_count=2, ttl_rounds=16)
    free, _ = run(history, **policy)
    tier, _ = run(history, Settings(memory_budget=budget_for(index, monkeypatch), disk_dir=str(tmp_path)), **policy)
    assert index_kind(tier) == index
    assert tables(tier) == tables(free)
    s, f = key_stats(tier), key_stats(free)
    assert s["expired_disk"] > 0, "expired rows must leave the disk too"
    assert (s["admitted"], s["dropped"], s["evicted_ttl"]) == (f["admitted"], f["dropped"], f["evicted_ttl"])


@pytest.mark.parametrize("window,index", [(0, "hash"), (2, "hash"), (0, "dense"), (2, "dense")])
def test_a_restored_server_with_a_tier_continues_bit_identical(tmp_path, monkeypatch, window, index):
    """Snapshots (full, then deltas) hold the disk tier as a committed store with hard-linked segments; a server
    restored from them (into another disk directory) continues exactly. With an admission window (rows updated
    where they are on disk), a segment a snapshot links is never written in place (copy-on-write)."""
    from fakepeer import WORKER0, WORKER1, Requests
    from kvstore_lazy.persist import checkpoint
    from kvstore_lazy.server.core import KVServer
    from test_server import Peer
    history = streams(rounds=40, span=20_000, batch=100)
    free, _ = run(history)
    budget = budget_for(index, monkeypatch)
    settings = Settings(memory_budget=budget, disk_dir=str(tmp_path / "a"), track_changes=True,
                        disk_admit_window=window)
    a, workers = server(settings=settings)
    chain = checkpoint.SnapshotChain(tmp_path / "snap", 0, 1, compact_ratio=100.0)
    for step, per_worker in enumerate(history[:20]):
        for w, ids in zip(workers, per_worker):
            a.values(w.rsp_pull(KEY, ids))
        sync_round(a, workers, per_worker, step)
        if step % 5 == 4:           # a base, then deltas
            delta = chain.next_is_delta()
            meta, snap = a.server.snapshot(delta=delta)
            chain.write(meta, snap, delta)
            a.server.snapshot_written()
    assert (tmp_path / "snap" / "rank0" / "delta-000003" / f"key{KEY}.disk" / "index.npz").exists()
    seg = next((tmp_path / "snap" / "rank0" / "delta-000003" / f"key{KEY}.disk").glob("seg-*.dat"))
    assert seg.stat().st_nlink >= 2, "segments are hard-linked, not copied"
    loaded = checkpoint.load_snapshot(tmp_path / "snap", 0)
    if window:        # the snapshots' records were verified above (load_snapshot): rewrites went around them
        assert a.server.keys[KEY].disk.counters["updated_in_place"] > 0
    monkeypatch.setattr(tier_module, "DENSE_SHARE", 4)     # the store restored keeps the index kind it had
    b = Peer(KVServer(0, 1, 2, lifecycle=Settings(memory_budget=budget, disk_dir=str(tmp_path / "b"),
                                                  track_changes=True, disk_admit_window=window)))
    b.server.restore(loaded.manifest["server"], loaded.tables)
    assert index_kind(b) == index
    assert b.server.inspect() == a.server.inspect()
    wb = [Requests(WORKER0), Requests(WORKER1)]
    for step, per_worker in enumerate(history[20:], start=20):
        for w, ids in zip(wb, per_worker):
            b.values(w.rsp_pull(KEY, ids))
        sync_round(b, wb, per_worker, step)
    assert tables(b) == tables(free)
    assert key_stats(b)["disk_rows"] > 0



@pytest.mark.parametrize("removed_min", [1 << 30, 8])
def test_a_delta_of_a_key_that_demoted_too_many_rows_to_list_is_whole_and_restores_exactly(tmp_path, monkeypatch,
                                                                                           removed_min):
    """Between two snapshots a key under a budget demotes its rows many times over: the ids its table removed are
    kept only up to a share of its bytes (store.rows.REMOVED_MIN / REMOVED_SHARE), past it the key's next delta is
    whole (its rows in memory and its store). Either way a server restored from the chain, read in pieces as a
    restarting server reads it, is the one snapshotted; a whole delta with deltas after it included."""
    from fakepeer import WORKER0, WORKER1, Requests
    from kvstore_lazy.persist import checkpoint
    from kvstore_lazy.server.core import KVServer
    from kvstore_lazy.store import rows as rows_module
    from test_server import Peer
    monkeypatch.setattr(rows_module, "REMOVED_SHARE", 1 << 30)
    history = streams(rounds=50, span=20_000, batch=100)
    settings = Settings(memory_budget=BUDGET, disk_dir=str(tmp_path / "a"), track_changes=True)
    a, workers = server(settings=settings)
    chain = checkpoint.SnapshotChain(tmp_path / "snap", 0, 1, compact_ratio=100.0)
    modes = []
    for step, per_worker in enumerate(history[:30]):
        monkeypatch.setattr(rows_module, "REMOVED_MIN", removed_min if step < 20 else 1 << 30)
        sync_round(a, workers, per_worker, step)
        if step % 5 == 4:
            delta = chain.next_is_delta()
            meta, snap = a.server.snapshot(delta=delta)
            modes.append(snap[KEY].get("mode"))
            chain.write(meta, snap, delta)
            a.server.snapshot_written()
    assert modes[-2:] == ["delta", "delta"] and \
        (modes[1:-2] == ["delta"] * 3 if removed_min > 8 else "full" in modes[1:-2])
    assert a.server.keys[KEY].disk.counters["demoted"] > 100
    b = Peer(KVServer(0, 1, 2, lifecycle=Settings(memory_budget=BUDGET, disk_dir=str(tmp_path / "b"),
                                                  track_changes=True)))
    loaded = checkpoint.load_snapshot(tmp_path / "snap", 0, pieces=True)
    b.server.restore(loaded.manifest["server"], loaded.tables)
    assert b.server.inspect() == a.server.inspect()
    wb = [Requests(WORKER0), Requests(WORKER1)]
    for step, per_worker in enumerate(history[30:], start=30):
        sync_round(b, wb, per_worker, step)
    assert tables(b) == tables(run(history, pulls=False)[0])

def test_a_damaged_segment_in_a_snapshot_stops_the_restore_naming_it(tmp_path):
    from kvstore_lazy.persist import checkpoint
    from kvstore_lazy.server.core import KVServer
    from kvstore_lazy.store.tier import DiskTierFailure
    settings = Settings(memory_budget=BUDGET, disk_dir=str(tmp_path / "a"), track_changes=True)
    a, _ = run(streams(rounds=20, span=20_000, batch=100), settings)
    meta, snap = a.server.snapshot()
    checkpoint.write_snapshot(tmp_path / "snap", 0, 1, snap, meta)
    seg = sorted((tmp_path / "snap" / "rank0" / f"key{KEY}.disk").glob("seg-*.dat"))[0]
    seg.unlink()                 # the snapshot's own copy (a link): the server's files stay good
    with open(seg, "wb") as f, open(tmp_path / "a" / "rank0" / f"key{KEY}" / seg.name, "rb") as src:
        data = bytearray(src.read())
        data[100] ^= 0xFF
        f.write(data)
    loaded = checkpoint.load_snapshot(tmp_path / "snap", 0)
    b = KVServer(0, 1, 2, lifecycle=Settings(memory_budget=BUDGET, disk_dir=str(tmp_path / "b")))
    with pytest.raises(DiskTierFailure, match=rf"{seg.name} is damaged: record \d+"):
        b.restore(loaded.manifest["server"], loaded.tables)


def test_state_listing_reads_disk_rows_without_promoting_them(tmp_path):
    history = streams(rounds=30, span=20_000, batch=100)
    tier, _ = run(history, Settings(memory_budget=BUDGET, disk_dir=str(tmp_path)))
    entry = tier.server.keys[KEY]
    ids = entry.row_ids()
    before = (len(entry._table), len(entry.disk))
    states = entry.state_rows(ids, 0)
    assert (len(entry._table), len(entry.disk)) == before
    assert states.tobytes() == entry.all_rows()["states"][0].tobytes()


def test_disk_dir_needs_a_budget_and_a_foreign_directory_is_left_alone(tmp_path):
    with pytest.raises(ValueError, match="KVSTORE_LAZY_DISK_DIR='/x' needs KVSTORE_LAZY_MEMORY_BUDGET"):
        Settings.from_env({"KVSTORE_LAZY_DISK_DIR": "/x"})
    assert Settings.from_env({"KVSTORE_LAZY_DISK_DIR": "/x", "KVSTORE_LAZY_MEMORY_BUDGET": "8MiB"}).disk_dir == "/x"
    mine = tmp_path / "rank0" / f"key{KEY}"
    mine.mkdir(parents=True)
    (mine / "notes.txt").write_text("not ours")
    from kvstore_lazy.store.tier import DiskTierFailure
    with pytest.raises(DiskTierFailure, match="is not a disk tier of kvstore_lazy"):
        run(streams(rounds=1), Settings(memory_budget=1 << 20, disk_dir=str(tmp_path)))
    assert (mine / "notes.txt").read_text() == "not ours"



def test_a_new_optimizer_resets_the_states_of_rows_on_disk_too(tmp_path):
    """kController again (a new optimizer: every row's states start over, their number may change): the rows on
    disk are rewritten to the new layout, as the rows in memory are."""
    from test_lifecycle import optimizer_body
    from kvstore_lazy.protocol import mxnet as proto
    history = streams(rounds=30, span=20_000, batch=100)
    out = []
    for settings in (None, Settings(memory_budget=BUDGET, disk_dir=str(tmp_path))):
        peer, workers = server(settings=settings)
        for step, per_worker in enumerate(history):
            if step == 15:
                peer.ok(workers[0].command(proto.CONTROLLER, optimizer_body("adam", learning_rate=0.01)))
            for w, ids in zip(workers, per_worker):
                peer.values(w.rsp_pull(KEY, ids))
            sync_round(peer, workers, per_worker, step)
        out.append(tables(peer))
        if settings is not None:
            entry = peer.server.keys[KEY]
            assert entry.num_states == 2 and len(entry.disk) > 0
    assert out[0] == out[1]


@pytest.mark.parametrize("ring", [True, False])
def test_demotion_in_small_chunks_and_either_read_path_stay_bit_identical(tmp_path, monkeypatch, ring):
    """Demotions written a few rows a pwrite, reads through an io_uring (where there is one) or pread, and the
    store-wide compaction of 32-row segments: still the run with everything in memory, row for row."""
    from kvstore_lazy.store import segments, tier as tier_module
    monkeypatch.setattr(tier_module, "DEMOTE_CHUNK", 16)
    monkeypatch.setattr(segments, "READ_RING", ring)
    history = streams(rounds=40, span=20_000, batch=100)
    free, free_pulls = run(history)
    tier, tier_pulls = run(history, Settings(memory_budget=BUDGET, disk_dir=str(tmp_path), disk_segment_rows=32,
                                             disk_compact=0.1))
    assert all(np.array_equal(a, b) for a, b in zip(free_pulls, tier_pulls))
    assert tables(tier) == tables(free)
    store = tier.server.keys[KEY].disk.store
    s = store.stats()
    assert s["segments_compacted"] >= 2 and s["records_read"] >= key_stats(tier)["promoted"] > 100
    store.compact_store(limit=1000)
    written = sum(store._fill.values())      # within the store-wide ratio, or only the active segment has garbage
    assert written - len(store) <= 0.1 * written or all(store._live[x] == 32 for x in store._sealed())
    assert tables(tier) == tables(free)


@pytest.mark.parametrize("evict,optimizer,policy", [
    ("lru", ("sgd", {"learning_rate": 0.1, "momentum": 0.9}), {}),
    ("lfu", ("adam", {"learning_rate": 0.01}), {}),       # Adam: the step count (t) must be counted once a round
    ("lru", ("sgd", {"learning_rate": 0.1, "momentum": 0.9}), {"admit_min_count": 2, "ttl_rounds": 16})])
def test_rows_the_memory_tier_does_not_admit_are_updated_on_disk_bit_identical(tmp_path, evict, optimizer, policy):
    """KVSTORE_LAZY_DISK_ADMIT_WINDOW: a row on disk not pushed in the key's last W rounds is updated where it is
    (the optimizer on its record's bytes, written back in place) instead of coming back into memory: every value
    is still the run's with everything in memory, and fewer rows move."""
    history = streams(rounds=40, span=20_000, batch=100)
    free, free_pulls = run(history, optimizer=optimizer, **policy)
    out = {}
    for window in (0, 2):
        settings = Settings(memory_budget=BUDGET, evict=evict, disk_dir=str(tmp_path / f"w{window}"),
                            disk_admit_window=window)
        tier, tier_pulls = run(history, settings, optimizer=optimizer, **policy)
        assert all(np.array_equal(a, b) for a, b in zip(free_pulls, tier_pulls))
        assert tables(tier) == tables(free)
        entry = tier.server.keys[KEY]
        out[window] = (key_stats(tier), dict(entry.disk.counters), dict(entry.disk.store.counters))
        opt = tier.server.optimizer
        assert opt.update_count(KEY) == free.server.optimizer.update_count(KEY) == len(history)
    (s0, c0, _), (s2, c2, st2) = out[0], out[2]
    assert c0["updated_in_place"] == 0 and c2["updated_in_place"] > 100
    assert st2["records_rewritten"] > 0, "records written back where they are"
    assert c2["promoted"] < c0["promoted"] and c2["demoted"] < c0["demoted"]
    if policy:
        assert s2["expired_disk"] > 0 and (s2["admitted"], s2["dropped"]) == (s0["admitted"], s0["dropped"])


def test_the_admission_window_is_a_checked_setting():
    assert Settings.from_env({"KVSTORE_LAZY_DISK_ADMIT_WINDOW": "8"}).disk_admit_window == 8
    assert Settings().disk_admit_window == 0
    for bad in ("-1", "x", "1.5"):
        with pytest.raises(ValueError, match="KVSTORE_LAZY_DISK_ADMIT_WINDOW"):
            Settings.from_env({"KVSTORE_LAZY_DISK_ADMIT_WINDOW": bad})


def test_rows_updated_on_disk_after_a_snapshot_leave_the_snapshot_as_it_was(tmp_path):
    """The snapshot hard-links the tier's segments; rows the server then updates on disk (admission window) must
    not be written into those shared files (copy-on-write): a server restored from the snapshot and given the
    same rounds ends where the server that went on ended, and both where the run with everything in memory did."""
    from fakepeer import WORKER0, WORKER1, Requests
    from kvstore_lazy.persist import checkpoint
    from kvstore_lazy.server.core import KVServer
    from test_server import Peer
    history = streams(rounds=40, span=20_000, batch=100)
    free, _ = run(history)

    def rounds(peer, workers, start, stop):
        for step in range(start, stop):
            for w, ids in zip(workers, history[step]):
                peer.values(w.rsp_pull(KEY, ids))
            sync_round(peer, workers, history[step], step)

    settings = Settings(memory_budget=BUDGET, disk_dir=str(tmp_path / "a"), disk_admit_window=2)
    a, workers = server(settings=settings)
    rounds(a, workers, 0, 20)
    meta, snap = a.server.snapshot()
    checkpoint.write_snapshot(tmp_path / "snap", 0, 1, snap, meta)
    updated = a.server.keys[KEY].disk.counters["updated_in_place"]
    rounds(a, workers, 20, 40)
    assert a.server.keys[KEY].disk.counters["updated_in_place"] > updated
    assert tables(a) == tables(free)
    b = Peer(KVServer(0, 1, 2, lifecycle=Settings(memory_budget=BUDGET, disk_dir=str(tmp_path / "b"),
                                                  disk_admit_window=2)))
    loaded = checkpoint.load_snapshot(tmp_path / "snap", 0)
    b.server.restore(loaded.manifest["server"], loaded.tables)
    rounds(b, [Requests(WORKER0), Requests(WORKER1)], 20, 40)
    assert tables(b) == tables(free)


def test_a_clear_killed_half_way_leaves_no_half_removed_store(tmp_path, monkeypatch):
    """A previous process's store is cleared by renaming it aside and removing it there: a process killed while
    removing it leaves a `.key<k>.old` (removed by the next clear), never a store without its store.json at the
    store's own path (which the next start would refuse as 'not a disk tier')."""
    from pathlib import Path

    from kvstore_lazy.store.segments import SegmentStore
    path = tmp_path / "rank0" / f"key{KEY}"
    path.parent.mkdir(parents=True)
    store = SegmentStore(path, np.dtype([("v", "<f4", (4,))]), 16, 0.25)
    store.close()
    assert (path / "store.json").exists()

    def killed(target, *args, **kwargs):   # rmtree removes store.json first, then the process dies
        (Path(target) / "store.json").unlink()
        raise KeyboardInterrupt("killed")
    monkeypatch.setattr(tier_module.shutil, "rmtree", killed)
    with pytest.raises(KeyboardInterrupt):
        tier_module.clear_dir(path)
    monkeypatch.undo()
    assert not path.exists() and (path.parent / f".key{KEY}.old").is_dir()
    tier_module.clear_dir(path)            # the next start: the leftover goes, the path is free
    assert not path.exists() and not (path.parent / f".key{KEY}.old").exists()


def test_a_budget_the_disk_index_outgrows_is_named_as_the_cause(tmp_path, caplog):
    """When what stays in memory is the disk tier's index of the rows on disk, the warning says so and what to set
    (it used to blame 'keys not declared lazy, pending tables')."""
    import logging
    caplog.set_level(logging.WARNING, logger="kvstore_lazy")
    peer, _ = run(streams(rounds=20, span=3000, batch=200), Settings(memory_budget=8 << 10, disk_dir=str(tmp_path)))
    assert len(peer.server.keys[KEY].disk) > 0
    said = [r.getMessage() for r in caplog.records if "memory budget" in r.getMessage()]
    assert len(said) == 1, said
    assert "by what no budget pass can move: the disk tier's index of its rows on disk, " in said[0]
    assert "raise KVSTORE_LAZY_MEMORY_BUDGET for this many rows on disk" in said[0]
    entry = peer.server.keys[KEY]
    found = re.search(r"\((\d+) rows: ([\d.]+) bytes a row now, (\d+) bytes an entry plus the buckets for each "
                      r"further row; .* to more than (\d+) bytes now\)", said[0])
    assert found, said[0]
    rows, average, entry_bytes, wanted = found.groups()
    assert int(entry_bytes) == entry.disk.index_row_nbytes() and float(average) > int(entry_bytes)
    assert 0 < int(rows) <= len(entry.disk) and int(wanted) > 8 << 10
    assert "not declared lazy" not in said[0]


@pytest.mark.parametrize("materialize", [MATERIALIZE_ON_PUSH, MATERIALIZE_ON_TOUCH])
def test_a_checkpoint_read_of_rows_on_disk_reads_a_chunk_at_a_time_and_promotes_none(tmp_path, monkeypatch,
                                                                                    materialize):
    """A worker checkpoint pulls every row, far more than the budget holds: the rows on disk are read in place, at
    most READ_CHUNK records at once (not a record per row asked for), none promoted, also where pulls create rows
    (touch); values and states as stored."""
    monkeypatch.setattr(tier_module, "READ_CHUNK", 64)
    monkeypatch.setattr(tier_module, "CACHE_ROWS", 64)
    settings = Settings(memory_budget=BUDGET, disk_dir=str(tmp_path))
    peer, workers = server(settings=settings, materialize=materialize)
    for step, per_worker in enumerate(streams(rounds=30, span=20_000, batch=100)):
        sync_round(peer, workers, per_worker, step)
    entry = peer.server.keys[KEY]
    assert len(entry.disk) > 4 * 64
    stored = entry.all_rows()
    ids = stored["row_ids"].astype(np.int64)
    sizes: list[int] = []
    get_records = entry.disk.store.get_records

    def counted(row_ids):
        sizes.append(len(row_ids))
        return get_records(row_ids)

    monkeypatch.setattr(entry.disk.store, "get_records", counted)
    before = (len(entry._table), len(entry.disk), entry.disk.counters["promoted"])
    values = peer.values(workers[0].rsp_pull(KEY, ids))
    states = entry.state_rows(stored["row_ids"], 0)
    assert (len(entry._table), len(entry.disk), entry.disk.counters["promoted"]) == before
    assert values.tobytes() == stored["weights"].tobytes()
    assert states.tobytes() == stored["states"][0].tobytes()
    assert sizes and max(sizes) <= 64, sizes
    # the compiled pull path answers the rows in memory and takes the others from the key MISSING_CHUNK at a time
    from kvstore_lazy.server import fastpath
    monkeypatch.setattr(fastpath, "MISSING_CHUNK", 50)
    sizes.clear()
    partial = peer.server.fast.partial
    values = peer.values(workers[0].rsp_pull(KEY, ids))
    assert peer.server.fast.partial == partial + 1
    assert values.tobytes() == stored["weights"].tobytes()
    assert len(sizes) >= len(entry.disk) // 50 and max(sizes) <= 50, sizes


def test_a_restore_of_optimizer_states_writes_rows_on_disk_where_they_are(tmp_path):
    """A worker restoring a checkpoint's optimizer states sets every row's (restore_states: one push per state of
    all the rows the server holds): rows on disk take their new state on disk, none promoted, every other part of
    them as it was; rows in memory take it there."""
    settings = Settings(memory_budget=BUDGET, disk_dir=str(tmp_path))
    peer, workers = server(settings=settings, materialize=MATERIALIZE_ON_PUSH)
    for step, per_worker in enumerate(streams(rounds=30, span=20_000, batch=100)):
        sync_round(peer, workers, per_worker, step)
    entry = peer.server.keys[KEY]
    before = entry.all_rows()
    ids = before["row_ids"]
    counts = (len(entry._table), len(entry.disk), entry.disk.counters["promoted"])
    assert counts[1] > 100
    new = np.arange(len(ids) * entry.row_size, dtype=np.float32).reshape(len(ids), entry.row_size) / 7
    entry.set_state_rows(ids, 0, new.reshape(-1))
    assert (len(entry._table), len(entry.disk), entry.disk.counters["promoted"]) == counts
    after = entry.all_rows()
    assert after["row_ids"].tobytes() == ids.tobytes()
    assert after["states"][0].tobytes() == new.tobytes()
    assert after["weights"].tobytes() == before["weights"].tobytes()
    assert [s.tobytes() for s in after["states"][1:]] == [s.tobytes() for s in before["states"][1:]]
    assert {n: c.tobytes() for n, c in after["columns"].items()} == \
        {n: c.tobytes() for n, c in before["columns"].items()}
    assert entry.state_rows(ids, 0).tobytes() == new.tobytes()


@pytest.mark.parametrize("index", [None, "dense"])
def test_an_init_with_rows_under_a_budget_goes_in_chunks_within_it(tmp_path, monkeypatch, index):
    """A worker loading a checkpoint inits the key with every row it saved: with a disk tier they go in INIT_CHUNK
    at a time with the budget's pass after each, so the table ends within the budget (not the whole checkpoint in
    memory until the first round ends), the rows where they belong, the same as without a budget."""
    from fakepeer import WORKER0, Requests
    from kvstore_lazy.protocol import mxnet as proto
    from kvstore_lazy.server.core import KVServer
    from kvstore_lazy.server.keys import row_sparse
    from kvstore_lazy.worker import lazy_spec_body
    from test_lifecycle import DIM, UNIFORM
    from test_server import Peer
    monkeypatch.setattr(row_sparse, "INIT_CHUNK", 100)
    # (the dense index: its cost is fixed, so the budget holds it whatever goes to disk)
    budget = 0 if index is None else budget_for(index, monkeypatch)
    settings = Settings(memory_budget=budget, disk_dir=str(tmp_path) if budget else "")
    peer, w = Peer(KVServer(0, 1, 1, lifecycle=settings)), Requests(WORKER0)
    peer.ok(w.command(proto.LAZY_DECLARE, lazy_spec_body(KEY, (ROWS, DIM), "float32", UNIFORM, 3)))
    ids = np.arange(5, ROWS, 23)[:3000]
    values = (ids[:, None] * 0.001 + np.arange(DIM)).astype(np.float32)
    peer.ok(w.rsp_push(KEY, ids, values))
    entry = peer.server.keys[KEY]
    rows = entry.all_rows()
    assert rows["row_ids"].astype(np.int64).tolist() == ids.tolist()
    assert rows["weights"].tobytes() == values.tobytes()
    if budget:
        assert len(entry.disk) > len(ids) // 2 and len(entry.disk) + len(entry._table) == len(ids)
        assert peer.server.lifecycle.accounted(peer.server.keys) <= budget


def open_files_in(directory) -> int:
    """Files this process has open in `directory` (an unnamed temporary file's link names it, "(deleted)")."""
    import os
    links = [os.readlink(f"/proc/self/fd/{fd}") for fd in os.listdir("/proc/self/fd")
             if os.path.exists(f"/proc/self/fd/{fd}")]
    return sum(link.startswith(str(directory) + "/") for link in links)


def test_a_listing_merges_the_memory_rows_a_range_at_a_time_with_the_disk_rows_in_order(tmp_path, monkeypatch):
    """row_id_chunks (what a checkpoint's listing file is written from): the rows in memory sorted a range of ids
    at a time (store.pieces.id_ranges), merged piece by piece with the disk index's stream; every piece ascending,
    the pieces in order, together exactly the key's ids in both tiers."""
    from kvstore_lazy.store import pieces
    monkeypatch.setattr(pieces, "ORDER_PASS", 40)
    tier, _ = run(streams(rounds=30, span=20_000, batch=100), Settings(memory_budget=BUDGET, disk_dir=str(tmp_path)))
    entry = tier.server.keys[KEY]
    assert len(entry.disk) > 300 and len(entry._table) > 50
    expect = entry.all_rows()["row_ids"]
    for chunk in (7, 64, 1 << 16):
        got = list(entry.row_id_chunks(chunk))
        assert all(len(p) and (np.diff(p.astype(np.int64)) > 0).all() for p in got)
        assert np.array_equal(np.concatenate(got), expect), chunk


def test_a_checkpoint_listing_of_a_disk_tier_key_is_a_file_read_back_by_position(tmp_path):
    """LAZY_ROWS of a key with a disk tier: the ids of that moment, both tiers, ascending, written to an unnamed
    temporary file in the key's store directory (no id list in RAM, no name left in the directory), read back piece
    by piece by the virtual pulls; rows made afterwards are not in it; the node's next LAZY_ROWS closes the file."""
    import json
    import os
    from fakepeer import F32, F64, WORKER0, WORKER1, Requests
    from kvstore_lazy.protocol import mxnet as proto
    from kvstore_lazy.server import listing as listing_module
    width = proto.ROWS_WIDTH
    history = streams(rounds=30, span=20_000, batch=100)
    tier, _ = run(history, Settings(memory_budget=BUDGET, disk_dir=str(tmp_path)))
    entry, workers = tier.server.keys[KEY], [Requests(WORKER0), Requests(WORKER1)]
    w = workers[0]
    ids, rows = entry.row_ids(), entry.all_rows()
    assert len(entry.disk) > 300 and len(entry._table) > 50
    store_dir = tmp_path / "rank0" / f"key{KEY}"
    names, files = sorted(os.listdir(store_dir)), open_files_in(store_dir)
    tier.ok(w.command(proto.LAZY_ROWS, json.dumps({"key": KEY})))
    listing = tier.server.transfer.listings[WORKER0]
    assert not listing.in_memory and len(listing) == len(ids)
    assert sorted(os.listdir(store_dir)) == names and open_files_in(store_dir) == files + 1
    sync_round(tier, workers, [np.array([20_001])] * 2, 99)          # a row made after the listing
    assert 20_001 in entry.row_ids() and 20_001 not in ids
    # the header, then the ids 3 virtual rows a pull, read 100 at a time (pieces joined within a reply)
    old_piece, listing_module.PIECE = listing_module.PIECE, 100
    try:
        header = tier.values(w.rsp_pull(proto.ROWS_HEADER_KEY, [0], F64), np.float64)
        assert int(header[0]) == len(ids)
        chunks = -(-len(ids) // width)
        got = np.concatenate([tier.values(w.rsp_pull(proto.ROWS_HEADER_KEY, range(lo, min(lo + 3, chunks + 1)),
                                                     F64), np.float64) for lo in range(1, chunks + 1, 3)])
    finally:
        listing_module.PIECE = old_piece
    assert got[:len(ids)].astype(np.uint64).tolist() == ids.tolist() and (got[len(ids):] == -1).all()
    # the momentum of the listed rows through the flat-state key, 5 virtual rows a pull
    n = -(-len(ids) * DIM // width)
    flat = np.concatenate([tier.values(w.rsp_pull(proto.flat_state_key(0), range(lo, min(lo + 5, n)), F32))
                           for lo in range(0, n, 5)])
    assert flat[:len(ids) * DIM].tobytes() == rows["states"][0].reshape(-1).tobytes()
    tier.ok(w.command(proto.LAZY_ROWS, json.dumps({"key": KEY})))      # the next one: the old file is closed
    assert len(tier.server.transfer.listings[WORKER0]) == len(ids) + 1
    assert open_files_in(store_dir) == files + 1


@pytest.mark.parametrize("index", ["hash", "dense"])
def test_a_restored_tier_is_the_snapshots_store_opened_with_one_index_built(tmp_path, monkeypatch, index):
    """A restore opens the snapshot's committed store as the key's tier (its files linked into the key's
    directory): no fresh tier, and so no second dense index (4 bytes a possible row), is built beside it, not even
    for a moment; the key restored reads the same rows as the one snapshotted."""
    from kvstore_lazy.persist import checkpoint
    from kvstore_lazy.server.core import KVServer
    from kvstore_lazy.store.disk import index as disk_index
    from test_server import Peer
    history = streams(rounds=20, span=20_000, batch=100)
    budget = budget_for(index, monkeypatch)
    settings = Settings(memory_budget=budget, disk_dir=str(tmp_path / "a"), track_changes=True)
    a, workers = server(settings=settings)
    for step, per_worker in enumerate(history):
        for w, ids in zip(workers, per_worker):
            a.values(w.rsp_pull(KEY, ids))
        sync_round(a, workers, per_worker, step)
    assert key_stats(a)["disk_rows"] > 0
    meta, snap = a.server.snapshot()
    checkpoint.write_snapshot(tmp_path / "snap", 0, 1, snap, meta)
    loaded = checkpoint.load_snapshot(tmp_path / "snap", 0, pieces=True)
    built: list[int] = []
    dense_init, runs_init = disk_index.DenseIndex.__init__, disk_index.RunIndex.__init__

    def dense(self, first, count):
        if count:
            built.append(count)
        dense_init(self, first, count)

    def runs(self, *args, **kwargs):
        built.append(-1)
        runs_init(self, *args, **kwargs)
    monkeypatch.setattr(disk_index.DenseIndex, "__init__", dense)
    monkeypatch.setattr(disk_index.RunIndex, "__init__", runs)
    monkeypatch.setattr(tier_module, "DENSE_SHARE", 4)     # the store restored keeps the index kind it had
    b = Peer(KVServer(0, 1, 2, lifecycle=Settings(memory_budget=budget, disk_dir=str(tmp_path / "b"),
                                                  track_changes=True)))
    b.server.restore(loaded.manifest["server"], loaded.tables)
    assert len(built) == 1, f"indexes built by the restore: {built}"
    assert index_kind(b) == index
    assert (built[0] > 0) == (index == "dense")
    assert tables(b) == tables(a)
    assert b.server.inspect() == a.server.inspect()
