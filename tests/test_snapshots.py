"""Incremental server snapshots (snapshots.SnapshotChain, load_snapshot): a base plus deltas of only the rows that
changed, tombstones for removed rows, compaction, and a loader that refuses a gap, a stale or a corrupted delta.
A server restored from base + deltas equals the server that wrote them (its public inspection, pending rounds
aside), including lifecycle state (columns, pending ids, counters)."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from fakepeer import WORKER0, WORKER1, Requests
from kvstore_lazy.persist import snapshots
from kvstore_lazy.server.core import KVServer
from kvstore_lazy.server.lifecycle import Settings
from test_lifecycle import KEY, server, streams, sync_round
from test_server import Peer


def chain_writer(tmp_path, max_deltas=8, compact_ratio=1.0):
    return snapshots.SnapshotChain(tmp_path, 0, 1, max_deltas, compact_ratio)


def write(chain, peer, full=False):
    delta = not full and chain.next_is_delta()
    meta, tables = peer.server.snapshot(delta=delta)
    path, size = chain.write(meta, tables, delta)
    peer.server.snapshot_written()
    return path, size, delta


def restored(tmp_path, settings):
    loaded = snapshots.load_snapshot(tmp_path, 0)
    fresh = KVServer(0, 1, 2, lifecycle=settings)
    fresh.restore(json.loads(json.dumps(loaded.manifest["server"])), loaded.tables)
    return fresh, loaded


SETTINGS = Settings(memory_budget=30_000, track_changes=True)


@pytest.fixture
def run(tmp_path):
    """A job with admission, TTL and a budget, snapshotted every 4 rounds through one chain (max 4 deltas; deltas up
    to 5x the base's bytes, so that only the count compacts here)."""
    peer, workers = server(settings=SETTINGS, admit_min_count=2, ttl_rounds=16)
    chain = chain_writer(tmp_path, max_deltas=4, compact_ratio=5.0)
    kinds = []
    for step, per_worker in enumerate(streams(rounds=40, span=3000, batch=60)):
        sync_round(peer, workers, per_worker, step)
        if step % 4 == 3:                                        # the last write is after the last round
            kinds.append(write(chain, peer)[2])
    return peer, chain, kinds


def test_base_and_deltas_restore_exactly_and_compact(tmp_path, run):
    peer, chain, kinds = run
    # a base, 4 deltas, a base (compaction after max_deltas), ...
    assert kinds[:6] == [False, True, True, True, True, False]
    s = peer.server.stats()["sparse"][str(KEY)]
    assert s["evicted_ttl"] > 0 and s["evicted_budget"] > 0 and s["pending"] > 0     # every kind of change
    fresh, loaded = restored(tmp_path, SETTINGS)
    assert fresh.inspect() == peer.server.inspect()
    assert loaded.chain["seq"] == chain.state["seq"] > 0
    # the restored server continues the chain and keeps matching
    history = streams(rounds=6, span=3000, batch=60, seed=9)
    again = Peer(fresh)
    wa = [Requests(WORKER0), Requests(WORKER1)]
    chain2 = chain_writer(tmp_path, max_deltas=8, compact_ratio=5.0)
    chain2.resume(loaded)
    for step, per_worker in enumerate(history):
        sync_round(again, wa, per_worker, step)
    path, _, delta = write(chain2, again)
    assert delta and path.name == f"delta-{loaded.chain['seq'] + 1:06d}"
    third, _ = restored(tmp_path, SETTINGS)
    assert third.inspect() == fresh.inspect()


def test_tombstones_and_a_row_evicted_then_back(tmp_path):
    peer, workers = server(num_workers=1, settings=Settings(track_changes=True), ttl_rounds=2)
    chain = chain_writer(tmp_path, compact_ratio=100.0)
    sync_round(peer, workers, [[1, 2, 3]])
    write(chain, peer)                                           # base: 1, 2, 3
    sync_round(peer, workers, [[1]])
    sync_round(peer, workers, [[4]])                             # round 3: 2 and 3 expire (last push round 1)
    path, _, delta = write(chain, peer)
    assert delta
    with np.load(path / f"key{KEY}.npz") as data:
        assert data["row_ids"].tolist() == [1, 4] and data["dead_ids"].tolist() == [2, 3]
    sync_round(peer, workers, [[2]])             # round 4: 2 comes back (a row again, not a tombstone), 1 expires
    path, _, delta = write(chain, peer)
    assert delta
    with np.load(path / f"key{KEY}.npz") as data:
        assert data["row_ids"].tolist() == [2] and data["dead_ids"].tolist() == [1]
    fresh, _ = restored(tmp_path, Settings(track_changes=True))
    assert fresh.snapshot()[1][KEY]["row_ids"].tolist() == [2, 4]
    assert fresh.inspect() == peer.server.inspect()


def test_a_delta_of_one_percent_of_the_rows_is_small(tmp_path):
    peer, workers = server(num_workers=1, settings=Settings(track_changes=True))
    sync_round(peer, workers, [np.arange(20_000)])
    chain = chain_writer(tmp_path)
    _, base, _ = write(chain, peer)
    sync_round(peer, workers, [np.arange(0, 20_000, 100)])      # 1% of the rows
    _, delta, is_delta = write(chain, peer)
    assert is_delta and delta < 0.05 * base, (delta, base)
    # deltas whose bytes pass the base's make the next snapshot a base
    sync_round(peer, workers, [np.arange(20_000)])               # every row: a delta as big as the base
    write(chain, peer)
    assert chain.state["seq"] == 2 and chain.state["delta_bytes"] > chain.state["base_bytes"]
    assert not chain.next_is_delta()
    write(chain, peer)
    assert chain.state["seq"] == 0 and not (tmp_path / "rank0" / "delta-000001").exists()   # compacted


@pytest.fixture
def chain_on_disk(tmp_path, run):
    rank = tmp_path / "rank0"
    deltas = sorted(p.name for p in rank.iterdir() if p.name.startswith("delta-"))
    assert len(deltas) >= 2, deltas
    return rank, deltas


def test_a_missing_delta_is_refused(chain_on_disk):
    rank, deltas = chain_on_disk
    shutil.rmtree(rank / deltas[0])
    with pytest.raises(snapshots.SnapshotError, match=f"delta {int(deltas[0][6:])} is missing"):
        snapshots.load_snapshot(rank.parent, 0)


def test_a_corrupted_delta_is_refused(chain_on_disk):
    rank, deltas = chain_on_disk
    victim = next((rank / deltas[-1]).glob("key*.npz"))
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    with pytest.raises(snapshots.SnapshotError, match="corrupted"):
        snapshots.load_snapshot(rank.parent, 0)


def test_a_stale_delta_is_refused(tmp_path, chain_on_disk):
    rank, deltas = chain_on_disk
    # a delta left from another chain (an earlier run) in the place of the first one
    other = tmp_path / "other"
    peer, workers = server(settings=SETTINGS, admit_min_count=2)
    chain = snapshots.SnapshotChain(other, 0, 1)
    for step in range(2):
        sync_round(peer, workers, [[step], [step + 1]], step)
        write(chain, peer)
    shutil.rmtree(rank / deltas[0])
    shutil.copytree(other / "rank0" / "delta-000001", rank / deltas[0])
    with pytest.raises(snapshots.SnapshotError, match="stale delta"):
        snapshots.load_snapshot(rank.parent, 0)


def test_a_rewritten_predecessor_is_refused(chain_on_disk):
    rank, deltas = chain_on_disk
    manifest = rank / deltas[0] / "manifest.json"
    body = json.loads(manifest.read_text())
    body["server"]["sync_mode"] = body["server"]["sync_mode"]     # same content, other bytes
    manifest.write_text(json.dumps(body))
    with pytest.raises(snapshots.SnapshotError, match="does not follow its predecessor"):
        snapshots.load_snapshot(rank.parent, 0)


def test_a_snapshot_streamed_in_pieces_writes_the_same_files_as_one_copied_whole(tmp_path, monkeypatch):
    """The writer gathers each key's rows sorted by id a few at a time (RowTable.export_pieces, store.npz.savez)
    instead of a sorted copy of the table: every member of every key file is byte for byte what np.savez wrote of
    the copy, for bases and deltas, and the loads are equal."""
    import zipfile

    from kvstore_lazy.store import rows as rows_module
    from kvstore_lazy.store import pieces
    monkeypatch.setattr(rows_module, "EXPORT_CHUNK", 7)          # many pieces, the last one short
    monkeypatch.setattr(pieces, "ORDER_PASS", 64)                # the table sorted a range of ids at a time
    peer, workers = server(settings=SETTINGS, admit_min_count=2, ttl_rounds=16)
    chains = {stream: chain_writer(tmp_path / str(stream), max_deltas=2, compact_ratio=5.0)
              for stream in (False, True)}
    compared = set()
    for step, per_worker in enumerate(streams(rounds=24, span=3000, batch=60)):
        sync_round(peer, workers, per_worker, step)
        if step % 4 != 3:
            continue
        delta = chains[False].next_is_delta()
        for stream, chain in chains.items():
            meta, tables = peer.server.snapshot(delta=delta, stream=stream)
            assert any(hasattr(t["weights"], "pieces") for t in tables.values()) == stream
            chain.write(meta, tables, delta)
        peer.server.snapshot_written()
        written = chains[False].state
        for name in sorted(p.relative_to(tmp_path / "False") for p in (tmp_path / "False").rglob("key*.npz")):
            with zipfile.ZipFile(tmp_path / "False" / name) as whole, \
                    zipfile.ZipFile(tmp_path / "True" / name) as cut:
                assert whole.namelist() == cut.namelist()
                for member in whole.namelist():
                    assert whole.read(member) == cut.read(member), (name, member)
            compared.add((str(name), written["id"]))
        loads = [snapshots.load_snapshot(tmp_path / str(stream), 0) for stream in (False, True)]
        a, b = (loaded.tables[KEY] for loaded in loads)
        assert a["row_ids"].tobytes() == b["row_ids"].tobytes() and len(a["row_ids"]) > 7
        assert a["weights"].tobytes() == b["weights"].tobytes()
        assert [s.tobytes() for s in a["states"]] == [s.tobytes() for s in b["states"]]
        assert {n: v.tobytes() for n, v in a["arrays"].items()} == {n: v.tobytes() for n, v in b["arrays"].items()}
    assert any("delta" in name for name, _ in compared) and len({chain for _, chain in compared}) == 2


def test_a_restore_reading_the_rows_in_pieces_equals_one_reading_them_whole(tmp_path, run, monkeypatch):
    """A server restores a key's rows a piece at a time from the base's file and the deltas' (persist.members),
    merged by id as they come (FoldedRows), the table built piece by piece (RowTable.load): the same server as
    from the files read whole, with many short pieces."""
    from kvstore_lazy.persist import members
    from kvstore_lazy.store import rows as rows_module
    monkeypatch.setattr(members, "LOAD_CHUNK", 5)
    monkeypatch.setattr(rows_module, "EXPORT_CHUNK", 7)
    peer, chain, kinds = run
    assert chain.state["seq"] > 0                       # a base and deltas to fold
    whole = snapshots.load_snapshot(tmp_path, 0)
    cut = snapshots.load_snapshot(tmp_path, 0, pieces=True)
    assert isinstance(cut.tables[KEY]["weights"], members.FoldedColumn)
    sources = cut.tables[KEY]["weights"].sources        # the base and every delta after it: all read in pieces
    assert len(sources) == chain.state["seq"] + 1 and all(isinstance(s, members.MemberPieces) for s in sources)
    servers = []
    for loaded in (whole, cut):
        fresh = KVServer(0, 1, 2, lifecycle=SETTINGS)
        fresh.restore(json.loads(json.dumps(loaded.manifest["server"])), loaded.tables)
        servers.append(fresh)
    assert servers[1].inspect() == servers[0].inspect() == peer.server.inspect()
    # a base alone (no deltas): its members as they are, in pieces
    write(chain, peer, full=True)
    cut = snapshots.load_snapshot(tmp_path, 0, pieces=True)
    assert isinstance(cut.tables[KEY]["weights"], members.MemberPieces)
    fresh = KVServer(0, 1, 2, lifecycle=SETTINGS)
    fresh.restore(json.loads(json.dumps(cut.manifest["server"])), cut.tables)
    assert fresh.inspect() == peer.server.inspect()


def test_a_damaged_row_read_in_pieces_is_refused_naming_the_file(tmp_path, run):
    """A flipped bit in a base's weights: read in pieces, the member's zip CRC is checked once its last piece is
    read, so the restore fails naming the file and member, as a whole read does."""
    import zipfile
    peer, chain, _ = run
    write(chain, peer, full=True)
    path = tmp_path / "rank0" / f"key{KEY}.npz"
    with zipfile.ZipFile(path) as archive:
        info = archive.getinfo("weights.npy")
    raw = bytearray(path.read_bytes())
    raw[info.header_offset + 30 + len("weights.npy") + len(info.extra) + 200] ^= 0x10   # past the npy header
    path.write_bytes(bytes(raw))
    with pytest.raises(snapshots.SnapshotError, match="unreadable|corrupted"):
        snapshots.load_snapshot(tmp_path, 0)
    cut = snapshots.load_snapshot(tmp_path, 0, pieces=True)     # nothing of the rows read yet
    fresh = KVServer(0, 1, 2, lifecycle=SETTINGS)
    with pytest.raises(snapshots.SnapshotError, match=rf"key{KEY}\.npz: member 'weights' is corrupted"):
        fresh.restore(json.loads(json.dumps(cut.manifest["server"])), cut.tables)
