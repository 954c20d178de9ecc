"""What survives a server: snapshots, the journal's epochs, and replaying them (KVSTORE_LAZY_SNAPSHOT_DIR,
KVSTORE_LAZY_JOURNAL, KVSTORE_LAZY_RECOVERY).

Owns: when a snapshot is taken and what goes with it, which journal the requests go to, restoring a snapshot on a
fresh start (with the ``ResumeGate`` in front of the server) or for recovery (with the journal replayed after it),
the journaled clock ticks, and the one path every request takes into the server (``process``, also what replay
runs).
Does not own: the file formats (``persist.checkpoint``, ``persist.journal``), the seen set and the outbox
(``delivery``; kept here across a rotation and given back on replay), the sockets, or the choice to recover
(``recovery``).

- Snapshots (``checkpoint``) hold the applied state. The periodic one (KVSTORE_LAZY_SNAPSHOT_INTERVAL) is taken at
  the first moment no dist_sync round is half-way (nothing merged and unanswered), so it is exactly "the state after
  the rounds so far". A LAZY_SNAPSHOT command with a body (a tag, e.g. ``{"step": 40}``) writes ``tagged/rank<r>``
  before it is answered: a whole job restarted later resumes from it (see ``ResumeGate``).
- The periodic snapshots are a base plus deltas of what changed since the previous one (``checkpoint.SnapshotChain``;
  a new base after KVSTORE_LAZY_SNAPSHOT_DELTAS deltas or when their bytes pass the base's, and at shutdown).
- The journal (``journal``) has every request received since the last snapshot, written before the request is
  ACKed or handled, and which of our replies the peers ACKed (PS_RESEND); and, when a key expires rows by time, the
  server's clock ticks (records from "node 0"), so a replay sees the same times between the same requests.
"""
from __future__ import annotations

import json
import logging
import secrets
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvstore_lazy.node import placement, recovery, restore_from
from kvstore_lazy.node.clock import Clock
from kvstore_lazy.node.delivery import Delivery
from kvstore_lazy.node.errors import StartupError
from kvstore_lazy.persist import checkpoint
from kvstore_lazy.persist import journal as journal_mod
from kvstore_lazy.protocol import mxnet as mx
from kvstore_lazy.protocol.message import Message, identity_of
from kvstore_lazy.server.core import KVServer
from kvstore_lazy.server.resume import ResumeGate

log = logging.getLogger("kvstore_lazy")

TAGGED_DIR = checkpoint.TAGGED_DIR   # <snapshot dir>/tagged/rank<r>: the last snapshot a worker asked for (its tag)
CLOCK_SENDER = 0                # journal records from "node 0" are the server's own clock ticks (ttl_seconds)
CLOCK_EVERY = 1.0               # s between clock ticks, when a key expires rows by time


@dataclass
class Recovered:
    """A restored snapshot with its journal replayed: the replies still owed, and what to log."""

    directory: Path
    base: int                     # the journal seq the snapshot includes
    contents: Any                 # journal_mod.Contents
    owed: dict[int, tuple[int, Message]] = field(default_factory=dict)   # signature -> (recver, reply)
    replayed: int = 0
    ticks: int = 0


class Durability:
    """Snapshots and the journal of one server (`cfg`: the node's Config; nothing is written without its
    snapshot_dir). `metrics` is the Prometheus exporter, or None."""

    def __init__(self, cfg: Any, clock: Clock, delivery: Delivery, metrics: Any = None) -> None:
        self.cfg = cfg
        self.clock = clock
        self.delivery = delivery
        self.metrics = metrics
        self.server: KVServer | None = None
        self.port = 0
        self.journal: journal_mod.Journal | None = None
        self.chain: checkpoint.SnapshotChain | None = None   # where periodic snapshots go (base or delta)
        self.gate: ResumeGate | None = None
        self.declarations: restore_from.DeclarationCheck | None = None   # a restored server's declarations
        self.snapshot_due = False
        self._snapshot_seq = -1          # journal seq the last snapshot includes
        self._replaying = False
        delivery.acked = self._acked

    def attach(self, server: KVServer, port: int) -> None:
        self.server, self.port = server, port

    def _writer(self) -> dict:
        return placement.writer_of(self.cfg.host, self.port)

    # ------------------------------------------------------------------------------------------------------------
    # requests

    def write_ahead(self, msg: Message) -> None:
        """A request goes into the journal before it is ACKed or changes anything."""
        if self.journal is not None and self.server is not None:
            self.journal.append(msg.sender, getattr(msg, "frames", None) or msg.to_frames())

    def _acked(self, signature: int) -> None:
        if self.journal is not None:
            self.journal.ack(signature)

    def process(self, msg: Message) -> list[tuple[int, Message]]:
        """One request through the resume gate and the KVServer (also what journal replay runs)."""
        assert self.server is not None
        if self.declarations is not None:
            self.declarations.check(msg)
        if self.gate is not None and self.gate.active:
            replies = self.gate.intercept(self.server.key_range, msg)
            if replies is not None:
                return replies
        replies = self.server.handle(msg)
        if msg.meta.simple_app and msg.meta.head == mx.LAZY_SNAPSHOT:
            if self.cfg.snapshot_dir and not self._replaying:
                self.save_tagged(_tag_of(bytes(msg.meta.body)))
                self.snapshot_due = True
        return replies

    def clock_tick(self, now: float) -> bool:
        """The lifecycle's clock (ttl_seconds) moves only here, journaled like a request so a replay repeats it.
        (A timer's action: False while no key expires rows by time.)"""
        assert self.server is not None
        if not self.server.lifecycle.wants_clock:
            return False
        seconds = self.clock.time()
        if self.journal is not None and not self._replaying:
            self.journal.append(CLOCK_SENDER, [struct.pack("<d", seconds)])
        self.server.lifecycle.set_clock(seconds)
        return True

    # ------------------------------------------------------------------------------------------------------------
    # the timers' side: asking for a snapshot, taking it at the first quiescent moment

    def interval_passed(self, now: float) -> None:
        self.snapshot_due = True

    def upkeep(self, now: float) -> None:
        """Every pass of the loop: flush the journal; take a due snapshot once it may be taken."""
        if self.journal is not None:
            self.journal.flush()
        if self.server is None or not self.cfg.snapshot_dir:
            return
        if self.journal is not None and self.journal.bytes_written > self.cfg.journal_max_bytes:
            self.snapshot_due = True
        if self.snapshot_due and self.journal is not None and self.journal.seq == self._snapshot_seq \
                and not self.delivery.outbox.pending:
            self.snapshot_due = False   # nothing happened since the last one
        # with the journal, only a snapshot between rounds lets the journal start over
        if self.snapshot_due and (self.journal is None or self.quiescent()):
            self.snapshot_due = False
            self.save_snapshot()

    # ------------------------------------------------------------------------------------------------------------
    # snapshots

    def quiescent(self) -> bool:
        """No dist_sync round is half-way: every push received so far is applied and answered."""
        return self.server is not None and self.server.quiescent()

    def save_snapshot(self, full: bool = False) -> None:
        """The state now into <dir>/rank<r>: the next delta of its snapshot chain, or (`full`, or as the chain
        decides) a new base; with the journal, a fresh journal continuing from it. Call it only when quiescent if
        the journal is on: pending round merges are not in a snapshot."""
        assert self.server is not None
        started = self.clock.monotonic()
        if self.chain is None:
            self.chain = checkpoint.SnapshotChain(self.cfg.snapshot_dir, self.server.rank, self.server.num_servers,
                                                  self.cfg.snapshot_deltas, writer=self._writer())
        delta = not full and self.chain.next_is_delta()
        meta, tables = self.server.snapshot(delta=delta, stream=True)     # (written below, before any request)
        new_journal = None
        if self.journal is not None:
            new_journal = journal_mod.Journal.create(
                journal_mod.journal_path(self.cfg.snapshot_dir, self.server.rank, self.journal.epoch,
                                         self.journal.seq),
                self.journal.epoch, self.journal.seq, self.delivery.newest_seen(), self.delivery.outbox.frames(),
                fsync=self.cfg.journal_fsync)
            meta["journal"] = {"epoch": self.journal.epoch, "seq": self.journal.seq}
            self._snapshot_seq = self.journal.seq
        if self.gate is not None and self.gate.active:
            meta["resume_gate"] = self.gate.state()
        path, size = self.chain.write(meta, tables, delta)
        self.server.snapshot_written()
        if new_journal is not None:
            assert self.journal is not None
            self.journal.close()
            self.journal = new_journal
            journal_mod.remove_others(self.cfg.snapshot_dir, self.server.rank, new_journal.path)
        rows = sum(len(t["row_ids"]) for k, t in tables.items() if t["meta"]["kind"] == "row_sparse")
        log.info("snapshot written to %s (%s): %d keys, %d rows, %d bytes, %.3fs", path, "delta" if delta else "base",
                 len(tables), rows, size, self.clock.monotonic() - started)
        if self.metrics is not None:
            self.metrics.snapshot_written("latest", self.clock.monotonic() - started)

    def save_tagged(self, tag: Any) -> None:
        """LAZY_SNAPSHOT: <dir>/tagged/rank<r>, with the worker's tag, before the command is answered."""
        assert self.server is not None
        started = self.clock.monotonic()
        meta, tables = self.server.snapshot(stream=True)
        meta["tag"] = tag
        meta["quiescent"] = self.quiescent()
        path = checkpoint.write_snapshot(Path(self.cfg.snapshot_dir) / TAGGED_DIR, self.server.rank,
                                         self.server.num_servers, tables, meta, writer=self._writer())
        log.info("tagged snapshot %s written to %s in %.3fs%s", json.dumps(tag), path,
                 self.clock.monotonic() - started,
                 "" if meta["quiescent"] else " (WARNING: a dist_sync round was half-way; its pushes are not in it)")
        if self.metrics is not None:
            self.metrics.snapshot_written("tagged", self.clock.monotonic() - started)

    def load_snapshot(self) -> None:
        """A fresh start: restore <dir>/tagged/rank<r> or <dir>/rank<r> (KVSTORE_LAZY_RESUME) and keep it against the
        new job's kv.init pushes and identical optimizer (ResumeGate)."""
        assert self.server is not None
        base, rank = Path(self.cfg.snapshot_dir), self.server.rank
        recovery.remove_leftovers(base, rank, self.cfg.lifecycle.disk_dir)
        choice = self.cfg.resume
        candidates = {"auto": [base / TAGGED_DIR, base], "tagged": [base / TAGGED_DIR], "latest": [base],
                      "none": []}[choice]
        for directory in candidates:
            self._check_owner(directory)
            loaded = checkpoint.load_snapshot(directory, rank, pieces=True)   # (rows read as the tables are built)
            if loaded is not None:
                break
        else:
            other = self.cfg.restore_from     # another job's snapshots, any server count (persist.reshard)
            if not other:
                log.info("no snapshot for rank %d in %s (KVSTORE_LAZY_RESUME=%s); starting empty", rank, base,
                         choice)
                return
            directory, loaded = Path(other), restore_from.load(other, rank, self.server.num_servers)
        manifest = loaded.manifest
        self._restore(directory, loaded)
        server_meta = manifest.get("server", {})
        self.gate = ResumeGate(self.server.key_ids(), self.server.optimizer_body)
        self.declarations = restore_from.DeclarationCheck(
            {spec.key: spec.to_json() for spec in self.server.specs.values()}, str(directory))
        log.info("restored snapshot of rank %d from %s%s: %d keys; this job's kv.init pushes of them will be dropped",
                 rank, directory, f" (tag {json.dumps(server_meta.get('tag'))})" if "tag" in server_meta else "",
                 len(manifest["keys"]))

    def _check_owner(self, directory: Path) -> None:
        """Never load another server's snapshot from a volume of its own (placement.check_snapshot_owner)."""
        assert self.server is not None
        try:
            placement.check_snapshot_owner(directory, self.server.rank, self.cfg.host, self.port,
                                           self.cfg.snapshot_scope)
        except placement.LifecycleError as exc:
            raise StartupError(str(exc)) from None

    def _restore(self, directory: Path, loaded: checkpoint.Loaded) -> None:
        assert self.server is not None
        manifest = loaded.manifest
        if manifest.get("num_servers") != self.server.num_servers:
            raise StartupError(f"snapshot in {directory} was written by {manifest.get('num_servers')} servers, "
                               f"this job has {self.server.num_servers}; reshard it (kvstore-lazy reshard, or "
                               f"KVSTORE_LAZY_RESTORE_FROM)")
        self.server.restore(manifest.get("server", {}), loaded.tables)

    def new_epoch(self) -> None:
        """A fresh start with the journal on: a new epoch whose base snapshot is the state now."""
        assert self.server is not None
        epoch = secrets.randbits(63)
        self.journal = journal_mod.Journal.create(
            journal_mod.journal_path(self.cfg.snapshot_dir, self.server.rank, epoch, 0), epoch, 0,
            fsync=self.cfg.journal_fsync)
        self.save_snapshot()

    # ------------------------------------------------------------------------------------------------------------
    # recovery

    def recover(self) -> Recovered:
        """Recovery: the last snapshot of <dir>/rank<r>, then every journaled request after it, in order. Returns the
        replies owed (sent by :meth:`finish_recovery` once the peers are connected)."""
        assert self.server is not None
        directory, rank = Path(self.cfg.snapshot_dir), self.server.rank
        recovery.remove_leftovers(directory, rank, self.cfg.lifecycle.disk_dir)
        self._check_owner(directory)
        loaded = checkpoint.load_snapshot(directory, rank, pieces=True)
        manifest = loaded.manifest if loaded is not None else None
        info = (manifest or {}).get("server", {}).get("journal")
        if loaded is None or manifest is None or info is None:
            raise StartupError(f"cannot recover rank {rank}: no journaled snapshot in {directory} (the server died "
                               f"before its first one, or ran without KVSTORE_LAZY_JOURNAL); restart the job")
        epoch, base = int(info["epoch"]), int(info["seq"])
        path = journal_mod.journal_path(directory, rank, epoch, base)
        contents = journal_mod.read(path)
        if contents is None:
            raise StartupError(f"cannot recover rank {rank}: the snapshot continues in {path}, which is missing")
        self._restore(directory, loaded)
        self.chain = checkpoint.SnapshotChain(directory, rank, self.server.num_servers, self.cfg.snapshot_deltas,
                                              writer=self._writer())
        self.chain.resume(loaded)      # the next periodic snapshot continues the chain it was loaded from
        gate_state = manifest["server"].get("resume_gate")
        if gate_state:
            self.gate = ResumeGate.from_state(gate_state, self.server.optimizer_body)
        recovered = Recovered(directory, base, contents)
        self._replay(recovered)
        self.journal = journal_mod.Journal.reopen(path, contents, fsync=self.cfg.journal_fsync)
        journal_mod.remove_others(directory, rank, path)   # older ones, or one of a snapshot that never committed
        return recovered

    def _replay(self, recovered: Recovered) -> None:
        """The journal's seen set and unACKed replies back into delivery, then its requests after the snapshot."""
        contents, delivery, my_id = recovered.contents, self.delivery, self.delivery.my_id
        assert self.server is not None and my_id is not None
        for sig in contents.seen:
            delivery.remember(sig)
        for recver, frames in contents.pending:
            reply = Message.from_frames([identity_of(my_id)] + frames)
            recovered.owed[delivery.signature_of_reply(recver, reply)] = (recver, reply)
        self._replaying = True
        try:
            for entry in contents.entries:
                if entry.seq <= recovered.base:
                    continue
                if entry.sender == CLOCK_SENDER:
                    self.server.lifecycle.set_clock(struct.unpack("<d", entry.frames[0])[0])
                    recovered.ticks += 1
                    continue
                msg = Message.from_frames([identity_of(entry.sender)] + entry.frames)
                delivery.replayed(msg)
                for recver, reply in self.process(msg):
                    recovered.owed[delivery.signature_of_reply(recver, reply)] = (recver, reply)
                recovered.replayed += 1
        finally:
            self._replaying = False

    def finish_recovery(self, recovered: Recovered, started: float) -> None:
        """The replies peers never ACKed go out again (the peers are connected by now)."""
        assert self.server is not None
        contents, resent = recovered.contents, 0
        for sig, (recver, reply) in recovered.owed.items():
            if sig not in contents.acked:
                self.delivery.reply(recver, reply)
                resent += 1
        log.info("recovered rank %d from %s: snapshot at request %d, %d journaled requests replayed%s%s, %d replies "
                 "re-sent; %.3fs", self.server.rank, recovered.directory, recovered.base, recovered.replayed,
                 f" (and {recovered.ticks} clock ticks)" if recovered.ticks else "",
                 f" ({contents.torn_bytes} bytes of a torn last record ignored)" if contents.torn_bytes else "",
                 resent, self.clock.monotonic() - started)

    def close(self) -> None:
        if self.journal is not None:
            self.journal.close()


def _tag_of(body: bytes) -> Any:
    if not body:
        return None
    text = body.decode("utf-8", errors="replace")
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text
