"""One full durability cycle of a server, in process, and the recovery of a server from a directory it left.

Owns: :func:`run_cycle` (a server with the journal, a memory budget and a disk tier of small segments serves a
stream of dist_sync rounds: the epoch's base, deltas, new bases after ``SNAPSHOT_DELTAS`` deltas (each a journal
rotation and a base swap), demotions to the disk tier and its compaction, a full snapshot at the end, as the node
does at shutdown; with a hook at every durability call through ``crashtrace.Tracer``), the model after every
request of that run (:func:`model`), and :func:`recover` (a fresh server's ``Durability.recover`` on a crash
state, as ``--restart-servers`` starts it). Requests go through ``Durability.write_ahead`` and ``process`` and
the round's budget pass as ``node.runtime`` runs them; no socket, the node's fake clock.
Does not own: the crash states (``crashtrace``) or what a test asserts.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from fakepeer import WORKER0, Requests
from kvstore_lazy.node.clock import FakeClock
from kvstore_lazy.node.delivery import Delivery
from kvstore_lazy.node.durability import Durability
from kvstore_lazy.node.runtime import Config
from kvstore_lazy.protocol import mxnet as proto
from kvstore_lazy.protocol.message import Message, identity_of
from kvstore_lazy.server.core import KVServer
from kvstore_lazy.server.lifecycle import Settings
from kvstore_lazy.worker import lazy_spec_body
from test_server import optimizer_body

KEY, ROWS, DIM, SEED = 7, 100_000, 4, 42
UNIFORM = '["uniform", {"scale": 0.07}]'
SERVER_ID, PORT = 8, 9200
ROUNDS, SNAPSHOT_EVERY, SNAPSHOT_DELTAS = 18, 2, 2        # a snapshot every 2 rounds: b d d b d d b d d + final
BUDGET = 4096 * 4 + 4096 * 4 + 200 * 48                   # both indexes' buckets and 200 rows in memory
SPAN = 1000                                               # row ids 0..999: ~500 rows exist, most on disk
SEGMENT_ROWS = 64                                         # small segments: promotions leave garbage to compact


def config(root: Path, journal_fsync: bool = False) -> Config:
    settings = Settings(memory_budget=BUDGET, disk_dir=str(root / "disk"), disk_segment_rows=SEGMENT_ROWS,
                        low_watermark=0.9, disk_compact=0.2, track_changes=True)
    return Config(root_uri="127.0.0.1", root_port=9000, num_workers=1, num_servers=1, host="127.0.0.1", port=PORT,
                  snapshot_dir=str(root / "snap"), journal=True, journal_fsync=journal_fsync,
                  snapshot_deltas=SNAPSHOT_DELTAS, lifecycle=settings)


def requests() -> list[Message]:
    """The stream: mode, optimizer, declaration, kv.init, then each round a pull and a push of its rows (the
    round's end: requests 5, 7, 9, ...)."""
    w = Requests(WORKER0)
    out = [w.command(proto.SYNC_MODE), w.command(proto.CONTROLLER, optimizer_body("sgd", learning_rate=0.1,
                                                                                 momentum=0.9)),
           w.command(proto.LAZY_DECLARE, lazy_spec_body(KEY, (ROWS, DIM), "float32", UNIFORM, SEED)),
           w.rsp_push(KEY, [], np.zeros((0, DIM), np.float32))]
    rng = np.random.default_rng(0)
    for step in range(ROUNDS):
        hot, cold = np.minimum(rng.zipf(1.3, 60) - 1, SPAN - 1), rng.integers(0, SPAN, 60)
        ids = np.unique(np.concatenate([hot, cold]))
        grads = ((ids[:, None] % 5) + np.arange(DIM) + step).astype(np.float32) / 8 - 0.3
        out += [w.rsp_pull(KEY, ids), w.rsp_push(KEY, ids, grads)]
    # as a van hands them over: through the codec
    return [Message.from_frames([identity_of(m.sender)] + m.to_frames()) for m in out]


def model(server: KVServer) -> str:
    """A digest of everything the model is: every row (memory and disk) with its optimizer state, and the
    optimizer's update counts."""
    digest = hashlib.sha256()
    for key in sorted(server.keys):
        entry = server.keys[key]
        rows = entry.all_rows() if hasattr(entry, "all_rows") else None
        if rows is not None:
            for array in [rows["row_ids"], rows["weights"], *rows["states"]]:
                digest.update(np.ascontiguousarray(array).tobytes())
    if server.optimizer is not None:
        digest.update(repr(sorted(server.optimizer.update_counts().items())).encode())
    return digest.hexdigest()


def _durability(cfg: Config, clock: FakeClock) -> tuple[Durability, KVServer]:
    delivery = Delivery(lambda recver, msg: None, clock.monotonic, False, 1.0)
    delivery.my_id = SERVER_ID
    durability = Durability(cfg, clock, delivery)
    server = KVServer(0, 1, 1, lifecycle=cfg.lifecycle)
    server.lifecycle.defer = True          # as node.runtime: a round end's budget pass after its replies
    durability.attach(server, PORT)
    return durability, server


@dataclass
class Cycle:
    models: dict[int, str] = field(default_factory=dict)     # journal seq -> model after that many requests
    first_commit: int = -1                                    # trace length when the epoch's base had committed
    stats: dict = field(default_factory=dict)
    journaled: int = 0            # requests whose write_ahead returned (live: what a crash hook sees)
    appending: bool = False       # inside a write_ahead: its record may or may not be on disk yet
    snapshot_seq: int = 0         # the journal seq of the last snapshot save_snapshot returned from


def run_cycle(root: Path, traced: Callable | None = None, journal_fsync: bool = False,
              cycle: Cycle | None = None) -> Cycle:
    """The undisturbed cycle in `root` (snap/, disk/); `traced` a context manager factory (``crashtrace.Tracer``)
    installed around it, whose ``points`` tell how far the trace was when the epoch's base committed; `cycle`
    (made here if None) is kept up to date as it runs, for a hook to read."""
    cfg = config(root, journal_fsync)
    Path(cfg.snapshot_dir).mkdir(parents=True)        # (the node's membership record made it)
    clock = FakeClock()
    cycle = Cycle() if cycle is None else cycle
    tracer = traced() if traced is not None else None
    if tracer is not None:
        tracer.__enter__()
    try:
        durability, server = _durability(cfg, clock)
        cycle.models[0] = model(server)
        durability.new_epoch()                     # the epoch's journal and its base
        # then each request as node.runtime handles it: journaled, processed, then the round's budget pass
        cycle.first_commit = len(tracer.points) if tracer is not None else 0
        for i, msg in enumerate(requests()):
            cycle.appending = True
            durability.write_ahead(msg)
            assert durability.journal is not None
            cycle.journaled, cycle.appending = durability.journal.seq, False
            durability.process(msg)
            if server.lifecycle.due:
                server.settle()
            cycle.models[durability.journal.seq] = model(server)
            if i >= 5 and i % 2 == 1 and (i - 3) // 2 % SNAPSHOT_EVERY == 0:     # the end of every 2nd round
                durability.save_snapshot()
                cycle.snapshot_seq = durability.journal.seq
        durability.save_snapshot(full=True)        # as at shutdown
        durability.close()
        entry = server.keys[KEY]
        cycle.stats = dict(entry.disk.store.counters) if entry.disk is not None else {}
    finally:
        if tracer is not None:
            tracer.__exit__(None, None, None)
    return cycle


def recover(root: Path, journal_fsync: bool = False) -> tuple[int, str]:
    """A restarted server's recovery from `root` (snap/, disk/): (the journal seq it recovered to, its model). Then
    it goes on as a recovered server does: its next snapshot (a new base) is written and loaded back, to the same
    model (the directory is left writable, not just readable). StartupError if it cannot recover."""
    cfg = config(root, journal_fsync)
    clock = FakeClock()
    durability, server = _durability(cfg, clock)
    durability.recover()
    assert durability.journal is not None
    seq, digest = durability.journal.seq, model(server)
    durability.save_snapshot(full=True)
    durability.close()
    again, server2 = _durability(cfg, FakeClock())
    again.recover()
    assert again.journal is not None and again.journal.seq == seq and model(server2) == digest, \
        "the snapshot a recovered server wrote does not load back to its model"
    again.close()
    return seq, digest


def leftovers(root: Path) -> list[str]:
    """Names in `root` that only an interrupted write makes: hidden entries of the snapshot directory and of its
    snapshots, and temp files anywhere."""
    found = []
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root)
        if any(part.startswith(".") for part in rel.parts) or path.name.endswith(".tmp"):
            found.append(str(rel))
    return found
