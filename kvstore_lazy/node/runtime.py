"""The server process: wires the ZeroMQ transport, the membership messages and the KVServer together.

Owns: the configuration read from the DMLC_* environment (as a stock server reads it), the one receive loop (one
thread owns every socket), timers (heartbeat, stats log, snapshots, resends), and the exact start/stop sequence stock
workers and the stock scheduler need:
ADD_NODE -> reconnect with identity -> BARRIER(7) -> serve -> kStopServer answered -> BARRIER(7) -> close.

Durability and recovery (KVSTORE_LAZY_SNAPSHOT_DIR, KVSTORE_LAZY_JOURNAL, KVSTORE_LAZY_RECOVERY):
- Snapshots (``checkpoint``) hold the applied state. The periodic one (KVSTORE_LAZY_SNAPSHOT_INTERVAL) is taken at
  the first moment no dist_sync round is half-way (nothing merged and unanswered), so it is exactly "the state after
  the rounds so far". A LAZY_SNAPSHOT command with a body (a tag, e.g. ``{"step": 40}``) writes ``tagged/rank<r>``
  before it is answered: a whole job restarted later resumes from it (see ``ResumeGate``).
- The periodic snapshots are a base plus deltas of what changed since the previous one (``checkpoint.SnapshotChain``;
  a new base after KVSTORE_LAZY_SNAPSHOT_DELTAS deltas or when their bytes pass the base's, and at shutdown).
- The journal (``journal``) has every request received since the last snapshot, written before the request is
  ACKed or handled, and which of our replies the peers ACKed (PS_RESEND); and, when a key expires rows by time, the
  server's clock ticks (records from "node 0"), so a replay sees the same times between the same requests.
- A server restarted with KVSTORE_LAZY_RECOVERY=1 *rejoins* its job: it binds the address it had (its
  ``node.rank<r>.json``), restores the snapshot, replays the journal (the same requests in the same order give the
  same state, half-done rounds included), re-sends the replies its peers never ACKed, and serves on. It does not
  register again: to the workers and the scheduler, whose ZeroMQ sockets reconnect to the same address on their
  own, it looks like a connection that dropped for a moment. Requests that died with the old process (in its
  socket buffers, never ACKed) are re-sent by the workers' PS_RESEND, and duplicates are recognised by signature.
  So no request a worker sent is lost, acknowledged or not, provided every node runs with PS_RESEND=1 and the
  server is back within 10 x PS_RESEND_TIMEOUT (ps-lite aborts a node after 10 unanswered resends).
- KVSTORE_LAZY_RECOVERY=register tries stock ps-lite's own recovery instead (ADD_NODE with is_recovery, resent
  until the scheduler's PS_HEARTBEAT_TIMEOUT has declared the old node dead; no startup barrier). It is kept for
  experiments only. Measured with the stock scheduler of mxnet 1.9.1: with PS_RESEND the scheduler aborts as soon as
  the node registers (it ACKs the anonymous registration to node kEmpty: zmq_van.h "Check failed: id !=
  Meta::kEmpty"); without PS_RESEND the node is accepted but requests that died with the old process are never
  re-sent and the job hangs. The scheduler also keeps its list of recovered nodes forever, so a second recovery
  would fail its CHECK_EQ(size, 1).

Who may send what (issue 11): every received message passes ``trust.Gate`` in ``_recv`` before anything reads it
(strict identities, the scheduler's validated node list, announced source addresses, per-role permissions); the
scheduler's DEALER is watched (``ZmqVan.watch``) and heartbeated, and a lost scheduler ends the process with one
error line and status 3 (``SchedulerLost``) in every phase. Sends never block (``ZmqVan`` queues, and drops a peer
that stops reading).

Stock ps-lite races under PS_RESEND that this server works around (see start and stop): the scheduler creates its
resender up to 100 ms after answering the registrations, so BARRIER requests that arrive first are counted, never
ACKed, resent and counted again; the extra counts release the final barrier before every node asked.
"""
from __future__ import annotations

import collections
import fcntl
import gc
import json
import logging
import os
import secrets
import socket
import struct
import time
from dataclasses import dataclass
from pathlib import Path

from kvstore_lazy.node import membership
from kvstore_lazy.persist import checkpoint
from kvstore_lazy.node import placement as lifecycle
from kvstore_lazy.persist import journal as journal_mod
from kvstore_lazy.node import trust
from kvstore_lazy.config import atoi_flag, flag
from kvstore_lazy.protocol import ProtocolError
from kvstore_lazy.protocol import mxnet as mx
from kvstore_lazy.protocol.message import Message, identity_of
from kvstore_lazy.protocol.pbmeta import ACK, ADD_NODE, EMPTY, TERMINATE, WORKER
from kvstore_lazy.node.promexport import Exporter, address_from_env
from kvstore_lazy.server.core import KVServer, node_name
from kvstore_lazy.server.lifecycle import Settings as LifecycleSettings
from kvstore_lazy.store.tier import DiskTierFailure
from kvstore_lazy.server.resume import ResumeGate
from kvstore_lazy.transport.zmq_van import QUEUE_BYTES, QUEUE_MESSAGES, BindError, ConnectError, ZmqVan

log = logging.getLogger("kvstore_lazy")

TAGGED_DIR = checkpoint.TAGGED_DIR   # <snapshot dir>/tagged/rank<r>: the last snapshot a worker asked for (its tag)
SEEN_KEEP = 200_000             # signatures of received requests remembered for duplicate detection (PS_RESEND)
SEEN_IN_JOURNAL = 65_536        # ... of which the newest are carried over into a rotated journal
CLOCK_SENDER = 0                # journal records from "node 0" are the server's own clock ticks (ttl_seconds)
CLOCK_EVERY = 1.0               # s between clock ticks, when a key expires rows by time
RESEND_STARTUP_DELAY = 0.5      # s; under PS_RESEND, ask for the startup barrier this late (see start)
SCHEDULER_GRACE = 1.0           # s a closed connection to the scheduler may stay down before this server exits
FINAL_BARRIER_STAGGER = 0.3     # s; under PS_RESEND, server rank r asks for the final barrier (r+1) x this late
# s a server waits for the final barrier's release (it comes within moments of the last node asking). The scheduler
# can lose it: its socket to a server re-created at a new IP may still be trying the old one when it exits. The
# server serves on meanwhile: the workers' sockets still trying the old IP deliver their last messages to it once
# the kernel gives up that connect (tcp_syn_retries 6: 127 s), and their exit waits for that (ZeroMQ linger).
FINAL_RELEASE_WAIT = 150.0
DRAIN_MAX = 64                  # queued messages served per loop iteration before the timers run
# Replies of a drain go out together, at most this many messages served apart: ZeroMQ wakes its I/O thread for a
# peer's pipe once per batch instead of once per reply (a step job's server CPU -8..-15%, steps/s +5..+15% measured
# with 8 and 64), and a reply waits at most REPLY_BATCH requests' work (a Trainer-like worker waits for all of them
# anyway).
REPLY_BATCH = 16
# the collector's thresholds while serving (gen 0 allocations, gen 1 and gen 2 collections); CPython's are 700, 10, 10
GC_THRESHOLD = (50_000, 20, 100)


class StartupError(RuntimeError):
    pass


class SchedulerLost(RuntimeError):
    """The scheduler is gone (its connection closed, or it stopped answering heartbeats): the job cannot go on."""


_node_label = "server ?"


class NodeLogFilter(logging.Filter):
    """Adds ``%(node)s`` ("server 1" once the rank is known) to log records."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.node = _node_label
        return True


def _interface_ip(name: str) -> str | None:
    SIOCGIFADDR = 0x8915
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), SIOCGIFADDR, struct.pack("256s", name[:15].encode()))
        except OSError:
            return None
    return socket.inet_ntoa(packed[20:24])


def default_host() -> str:
    """DMLC_NODE_HOST, else the IPv4 of DMLC_INTERFACE, else the first non-loopback IPv4
    (ps-lite GetAvailableInterfaceAndIP)."""
    host = os.environ.get("DMLC_NODE_HOST", "")
    if host:
        return host
    interface = os.environ.get("DMLC_INTERFACE", "")
    if interface:
        ip = _interface_ip(interface)
        if ip:
            return ip
    for _, name in socket.if_nameindex():
        ip = _interface_ip(name)
        if ip and not ip.startswith("127."):
            return ip
    return "127.0.0.1"


def _env_int(env, name: str, default: int | None = None) -> int:
    value = env.get(name)
    if value is None or value == "":
        if default is None:
            raise StartupError(f"{name} is not set (a kvstore_lazy server reads the same DMLC_* variables as a "
                               f"stock MXNet server)")
        return default
    try:
        return int(value)
    except ValueError:
        raise StartupError(f"{name}={value!r} is not an integer") from None


@dataclass
class Config:
    root_uri: str
    root_port: int
    num_workers: int
    num_servers: int
    host: str
    port: int = 0
    local: bool = False
    heartbeat_interval: float = 0.0
    resend: bool = False
    resend_timeout: float = 1.0
    water_mark: int = 0
    verbose: int = 0
    materialize: str = "push"
    stats_interval: float = 60.0
    is_recovery: bool = False
    recovery: str = ""              # "" (a fresh start), "rejoin" or "register"
    recover_rank: int = -1
    snapshot_dir: str = ""
    snapshot_interval: float = 0.0
    journal: bool = False
    journal_fsync: bool = False
    journal_max_bytes: int = 256 << 20
    resume: str = "auto"            # what a fresh start loads from snapshot_dir: auto | tagged | latest | none
    bind: str = ""                  # KVSTORE_LAZY_BIND: the address bound ("" = the advertised host, as ps-lite)
    rejoin_window: float = 30.0     # recovery "auto": rejoin only a job its previous process left this recently
    snapshot_scope: str = "job"     # KVSTORE_LAZY_SNAPSHOT_SCOPE: job (a directory all servers share) | server
    # who may send what (issue 11, kvstore_lazy.node.trust)
    allow: tuple = ()                 # KVSTORE_LAZY_ALLOW networks (empty: any)
    check_address: bool = True        # KVSTORE_LAZY_CHECK_ADDRESS: a node's messages come from its announced address
    scheduler_timeout: float = 30.0   # KVSTORE_LAZY_SCHEDULER_TIMEOUT: exit when the scheduler is silent this long
    queue_messages: int = QUEUE_MESSAGES   # KVSTORE_LAZY_PEER_QUEUE: per-peer unsent messages before it is dropped
    queue_bytes: int = QUEUE_BYTES         # KVSTORE_LAZY_PEER_QUEUE_MB, the same in bytes
    lifecycle: LifecycleSettings = LifecycleSettings()   # row admission/eviction defaults, memory budget
    snapshot_deltas: int = checkpoint.DEFAULT_MAX_DELTAS  # periodic snapshots: deltas between two bases
    metrics: tuple[str, int] | None = None   # Prometheus exporter (host, port): KVSTORE_LAZY_METRICS_PORT/_BIND

    @classmethod
    def from_env(cls, env=None) -> "Config":
        env = os.environ if env is None else env
        role = env.get("DMLC_ROLE", "server")
        if role != "server":
            raise StartupError(f"DMLC_ROLE={role!r}: kvstore_lazy only runs the server role")
        root_uri = env.get("DMLC_PS_ROOT_URI", "")
        if not root_uri:
            raise StartupError("DMLC_PS_ROOT_URI is not set")
        recovery = env.get("KVSTORE_LAZY_RECOVERY", "0").strip().lower()
        recovery = {"": "", "0": "", "1": "rejoin", "rejoin": "rejoin", "register": "register",
                    "auto": "auto"}.get(recovery)
        if recovery is None:
            raise StartupError(f"KVSTORE_LAZY_RECOVERY={env.get('KVSTORE_LAZY_RECOVERY')!r}: use 1 (rejoin), "
                               f"auto, register or 0")
        resume = env.get("KVSTORE_LAZY_RESUME", "auto").strip().lower() or "auto"
        if resume not in ("auto", "tagged", "latest", "none"):
            raise StartupError(f"KVSTORE_LAZY_RESUME={resume!r}: use auto, tagged, latest or none")
        try:
            metrics = address_from_env(env, local=atoi_flag(env, "DMLC_LOCAL"))
        except ValueError as exc:
            raise StartupError(str(exc)) from None
        config = cls(
            root_uri=root_uri,
            root_port=_env_int(env, "DMLC_PS_ROOT_PORT"),
            num_workers=_env_int(env, "DMLC_NUM_WORKER"),
            num_servers=_env_int(env, "DMLC_NUM_SERVER"),
            host=default_host() if env is os.environ else (env.get("DMLC_NODE_HOST") or default_host()),
            port=_env_int(env, "PORT", 0),
            local=atoi_flag(env, "DMLC_LOCAL"),
            heartbeat_interval=float(env.get("PS_HEARTBEAT_INTERVAL", "0") or 0),
            resend=atoi_flag(env, "PS_RESEND"),
            resend_timeout=_env_int(env, "PS_RESEND_TIMEOUT", 1000) / 1000.0,
            water_mark=_env_int(env, "DMLC_PS_WATER_MARK", 0),
            verbose=_env_int(env, "PS_VERBOSE", 0),
            materialize=env.get("KVSTORE_LAZY_MATERIALIZE", "push"),
            stats_interval=float(env.get("KVSTORE_LAZY_STATS_INTERVAL", "60") or 60),
            is_recovery=bool(recovery),
            recovery=recovery,
            recover_rank=_env_int(env, "KVSTORE_LAZY_RECOVER_RANK", -1),
            snapshot_dir=env.get("KVSTORE_LAZY_SNAPSHOT_DIR", ""),
            snapshot_interval=float(env.get("KVSTORE_LAZY_SNAPSHOT_INTERVAL", "0") or 0),
            journal=flag(env, "KVSTORE_LAZY_JOURNAL"),
            journal_fsync=flag(env, "KVSTORE_LAZY_JOURNAL_FSYNC"),
            journal_max_bytes=_env_int(env, "KVSTORE_LAZY_JOURNAL_MAX_MB", 256) << 20,
            resume=resume,
            snapshot_deltas=_env_int(env, "KVSTORE_LAZY_SNAPSHOT_DELTAS", checkpoint.DEFAULT_MAX_DELTAS),
            metrics=metrics,
        )
        try:   # kvstore_lazy.node.placement: bind one address, advertise another (a DNS name on Kubernetes)
            bind = "" if config.local else lifecycle.bind_address(env, config.host)
            config.bind = bind if lifecycle.BIND_ENV in env else ""
            config.rejoin_window = lifecycle.rejoin_window(env, config.resend_timeout)
            config.snapshot_scope = lifecycle.snapshot_scope(env)
        except lifecycle.LifecycleError as exc:
            raise StartupError(str(exc)) from None
        if config.recovery == "auto" and not config.resend:
            raise StartupError("KVSTORE_LAZY_RECOVERY=auto needs PS_RESEND=1 on every node (it is how workers "
                               "re-send what died with a server)")
        config._trust_from_env(env)
        try:
            config.lifecycle = LifecycleSettings.from_env(env, track_changes=bool(config.snapshot_dir))
        except ValueError as exc:
            raise StartupError(str(exc)) from None
        if (config.journal or config.recovery) and not config.snapshot_dir:
            raise StartupError("KVSTORE_LAZY_JOURNAL and KVSTORE_LAZY_RECOVERY need KVSTORE_LAZY_SNAPSHOT_DIR")
        if config.recovery and not config.journal:
            raise StartupError("KVSTORE_LAZY_RECOVERY needs KVSTORE_LAZY_JOURNAL=1 (the journal is what a restarted "
                               "server replays); restart the whole job from a snapshot instead")
        return config

    def _trust_from_env(self, env) -> None:
        try:
            self.allow = trust.parse_allow(env.get("KVSTORE_LAZY_ALLOW", ""))
        except trust.TrustError as exc:
            raise StartupError(str(exc)) from None
        self.check_address = env.get("KVSTORE_LAZY_CHECK_ADDRESS", "1").strip().lower() not in ("0", "false", "no",
                                                                                               "off")
        self.scheduler_timeout = _env_float(env, "KVSTORE_LAZY_SCHEDULER_TIMEOUT", 30.0)
        self.queue_messages = _env_int(env, "KVSTORE_LAZY_PEER_QUEUE", QUEUE_MESSAGES)
        self.queue_bytes = _env_int(env, "KVSTORE_LAZY_PEER_QUEUE_MB", QUEUE_BYTES >> 20) << 20
        if self.queue_messages < 1 or self.queue_bytes < 1:
            raise StartupError("KVSTORE_LAZY_PEER_QUEUE and KVSTORE_LAZY_PEER_QUEUE_MB must be at least 1")


def _env_float(env, name: str, default: float) -> float:
    """A non-negative finite number of seconds."""
    value = env.get(name, "")
    try:
        number = float(value) if value.strip() else default
    except ValueError:
        raise StartupError(f"{name}={value!r} is not a number") from None
    if not 0 <= number < float("inf"):
        raise StartupError(f"{name}={value!r} must be a finite number >= 0")
    return number


# ----------------------------------------------------------------------------------------------------------------
# membership records: what a rejoining server needs to know about the job it was in


def membership_path(directory: str | os.PathLike, rank: int) -> Path:
    return Path(directory) / f"node.rank{rank}.json"


def find_membership(directory: str | os.PathLike, host: str, port: int, rank: int = -1,
                    missing_ok: bool = False) -> dict | None:
    """The record of the server that ran at host:port (its requested or bound port), or of `rank` (None if there
    is none and `missing_ok`)."""
    records = []
    for path in sorted(Path(directory).glob("node.rank*.json")):
        try:
            records.append(json.loads(path.read_text()))
        except (OSError, json.JSONDecodeError) as exc:
            log.warning("ignoring %s: %s", path, exc)
    if rank >= 0:
        found = [r for r in records if r.get("rank") == rank]
    else:
        found = [r for r in records if r.get("host") == host and port and port in (r.get("port"),
                                                                                     r.get("requested_port"))]
    if not found and missing_ok:
        return None
    if len(found) != 1:
        known = ", ".join(f"rank {r.get('rank')} at {r.get('host')}:{r.get('port')}" for r in records) or "none"
        want = f"rank {rank}" if rank >= 0 else f"{host}:{port}"
        raise StartupError(f"cannot rejoin as {want}: {len(found)} matching records in {directory} (known: {known}). "
                           f"Restart the server with the DMLC_NODE_HOST and PORT it had, or set "
                           f"KVSTORE_LAZY_RECOVER_RANK")
    return found[0]


# ----------------------------------------------------------------------------------------------------------------


class Outbox:
    """Our messages that PS_RESEND peers have not ACKed yet, resent every `timeout` seconds (ps-lite's Resender,
    without its abort after 10 tries: a server keeps trying and says so in the log)."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self.pending: dict[int, list] = {}     # signature -> [recver, message, first sent, last sent, tries]

    def track(self, signature: int, recver: int, message: Message, now: float) -> None:
        self.pending.setdefault(signature, [recver, message, now, now, 0])

    def ack(self, signature: int) -> bool:
        return self.pending.pop(signature, None) is not None

    def due(self, now: float) -> list[list]:
        out = []
        for entry in self.pending.values():
            if now - entry[3] >= self.timeout:
                entry[3] = now
                entry[4] += 1
                out.append(entry)
        return out

    def frames(self) -> list[tuple[int, list[bytes]]]:
        return [(recver, [bytes(f) for f in message.to_frames()]) for recver, message, *_ in self.pending.values()]


class ServerNode:
    """One kvstore_lazy server in a ps-lite job."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.van = ZmqVan(local=config.local, water_mark=config.water_mark, queue_messages=config.queue_messages,
                          queue_bytes=config.queue_bytes)
        self.trust_gate = trust.Gate(allow=config.allow, check_address=config.check_address, resolve=_resolve)
        self.roster: membership.Roster | None = None
        self._refusals = trust.LogLimiter()
        self._heartbeat_every = 0.0
        self._asked_scheduler = None        # monotonic time of the first heartbeat the scheduler has not answered
        self.my_id: int | None = None
        self.port = 0
        self.server: KVServer | None = None
        self.timestamp = 0          # the van's own counter for control messages
        self._barrier_released = False
        self._seen: collections.OrderedDict[int, None] = collections.OrderedDict()
        self._next_heartbeat = float("inf")
        self._next_stats = float("inf")
        self._next_snapshot = float("inf")
        self._snapshot_due = False
        self._held: list | None = None   # replies waiting for the end of a batch (serve), or None: sent at once
        self._snapshot_seq = -1          # journal seq the last snapshot includes
        self._next_resend_check = float("inf")
        self._next_clock = 0.0
        self.outbox = Outbox(config.resend_timeout)
        self.journal: journal_mod.Journal | None = None
        self.chain: checkpoint.SnapshotChain | None = None   # where periodic snapshots go (base or delta)
        self.gate: ResumeGate | None = None
        self._replaying = False
        self._peers: list[membership.Peer] = []
        self.status = lifecycle.StatusFile.from_env()   # KVSTORE_LAZY_STATUS_FILE, read by --ready probes
        self._scheduler_grace = SCHEDULER_GRACE         # how long the scheduler's link may stay down (see rejoin)
        self._next_touch = 0.0
        # Prometheus metrics (KVSTORE_LAZY_METRICS_PORT): fed by this loop, served by their own HTTP thread
        self.metrics = Exporter(*config.metrics) if config.metrics is not None else None

    # ------------------------------------------------------------------------------------------------------------

    def run(self) -> int:
        try:
            try:
                if self.metrics is not None:
                    self.metrics.start()
                if self.config.recovery == "auto":
                    self._decide_recovery()
                if self.config.recovery == "rejoin":
                    self.rejoin()
                else:
                    self.start()
            except (BindError, OSError, ValueError, checkpoint.SnapshotError) as exc:
                # a bind failure, a node list without us, an unreadable snapshot: one line for the operator
                log.debug("start failed", exc_info=True)
                raise StartupError(f"cannot start: {exc}") from exc
            self.serve()
            self.stop()
        except StartupError as exc:
            log.error("%s", exc)
            return 2
        except SchedulerLost as exc:
            log.error("%s; exiting", exc)
            return 3
        except DiskTierFailure as exc:     # a full or failing disk under the disk tier: stop, no snapshot
            log.error("%s; stopping this server (no snapshot written: the last one stays good)", exc)
            return 4
        finally:
            if self.journal is not None:
                self.journal.close()
            if self.metrics is not None:
                self.metrics.close()
            self.van.close()
        return 0

    def start(self, timeout: float = 600.0) -> None:
        cfg = self.config
        self.port = self.van.bind(cfg.bind or cfg.host, cfg.port)
        self.status.write("starting", host=cfg.host, port=self.port)
        log.info("listening on %s:%d%s; registering with the scheduler at %s:%d%s", cfg.host, self.port,
                 f" (bound to {cfg.bind})" if cfg.bind else "", cfg.root_uri, cfg.root_port,
                 " as a recovered node" if cfg.recovery == "register" else "")
        if cfg.recovery == "register":
            self.timestamp = _rejoin_timestamp()
        self._expect_scheduler()
        # The first socket to the scheduler has no identity: that is how it recognises a new registration.
        self._connect(membership.Peer(membership.SCHEDULER_ID, membership.SCHEDULER, cfg.root_uri, cfg.root_port),
                      identity=None)
        request = membership.add_node_request(cfg.host, self.port, self._tick(), cfg.recovery == "register")
        self._send_control(membership.SCHEDULER_ID, request)
        deadline = time.monotonic() + timeout
        retry_every = 5.0 if cfg.recovery == "register" else float("inf")
        next_retry = time.monotonic() + retry_every
        reply = None
        while reply is None:
            now = time.monotonic()
            if now > deadline:
                raise StartupError(f"no reply to ADD_NODE from the scheduler at {cfg.root_uri}:{cfg.root_port}")
            if now > next_retry:
                # a stock scheduler ignores a recovering node until its heartbeat timeout declared the old one dead
                self._send_control(membership.SCHEDULER_ID, request)
                next_retry = now + retry_every
            msg = self._recv(1000)
            if msg is not None and msg.meta.control.cmd == ADD_NODE:
                reply = msg
            self._check_scheduler(time.monotonic())
        try:
            roster = membership.Roster.from_reply(reply.meta, cfg.num_servers, cfg.num_workers)
            self.my_id, peers = membership.find_self(reply.meta, cfg.host, self.port)
        except ValueError as exc:
            raise StartupError(f"cannot join the job: {exc}") from None
        recovered = any(n.id == self.my_id and n.is_recovery for n in reply.meta.control.nodes)
        rank = membership.id_to_rank(self.my_id)
        _set_label(rank)
        self._set_roster(roster)
        self._peers = peers
        self._connect_peers()
        self.server = self._new_server(rank)
        log.info("registered as server rank %d (node %d) of %d servers, %d workers%s", rank, self.my_id,
                 cfg.num_servers, cfg.num_workers, " (recovered node)" if recovered else "")
        self._start_timers()
        if cfg.snapshot_dir:
            self._write_membership()
            if cfg.recovery == "register":
                self._restore_and_replay()
            else:
                self.load_snapshot()
                if cfg.journal:
                    self._new_journal_epoch()
        self._status_serving()
        if recovered:
            # MXNet's servers and workers skip the startup barrier when ps-lite says is_recovery: the others are
            # long past it.
            log.info("recovered node: skipping the startup barrier")
            return
        if cfg.resend:
            # Stock ps-lite creates the scheduler's resender up to 100 ms after it has answered the registrations;
            # a BARRIER arriving before that is counted but never ACKed, so its sender resends it and the scheduler
            # counts it again (the extra count later releases the final barrier early). Ask a little later.
            self._pump_for(RESEND_STARTUP_DELAY)
        self.barrier(membership.ALL_GROUP)

    def rejoin(self) -> None:
        """KVSTORE_LAZY_RECOVERY=1: take over from a dead server of this job at the address it had (see the module
        docstring)."""
        cfg = self.config
        started = time.monotonic()
        record = find_membership(cfg.snapshot_dir, cfg.host, cfg.port, cfg.recover_rank)
        for name, mine in (("root_uri", cfg.root_uri), ("root_port", cfg.root_port),
                           ("num_servers", cfg.num_servers), ("num_workers", cfg.num_workers)):
            if record.get(name) != mine:
                raise StartupError(f"cannot rejoin: the record {membership_path(cfg.snapshot_dir, record['rank'])} "
                                   f"has {name}={record.get(name)!r}, this process {mine!r} (another job?)")
        self.my_id, rank = int(record["id"]), int(record["rank"])
        _set_label(rank)
        # Rejoined at a new address (a re-created pod), the scheduler's ROUTER may refuse our connection until its
        # stale one to the old address times out (ZeroMQ keeps the first connection under an identity): wait for the
        # scheduler as long as for the final barrier's release before calling it dead.
        self._scheduler_grace = FINAL_RELEASE_WAIT
        self.timestamp = _rejoin_timestamp()
        self.port = self._bind_again(cfg.bind or record["host"], int(record["port"]))
        log.info("rejoining as server rank %d (node %d) at %s:%d", rank, self.my_id, record["host"], self.port)
        self.server = self._new_server(rank)
        self._peers = [membership.Peer(int(i), int(role), h, int(p)) for i, role, h, p in record["peers"]]
        self._expect_scheduler()
        self._set_roster(membership.Roster({peer.node_id: peer for peer in self._peers}))
        self._restore_and_replay(started=started)
        if not lifecycle.is_ip_address(record["host"]):
            self._announce_address()
        self._start_timers()
        self._write_membership()
        self._status_serving()

    def _new_server(self, rank: int) -> KVServer:
        cfg = self.config
        server = KVServer(rank, cfg.num_servers, cfg.num_workers, materialize=cfg.materialize, lifecycle=cfg.lifecycle)
        server.lifecycle.defer = True      # a round end's budget pass after its replies: _dispatch
        return server

    def _announce_address(self) -> None:
        """Rejoined under a DNS name, perhaps at a new IP (a re-created pod): tell every worker where this server is
        now, so that a socket of theirs stuck on the old IP is replaced at once (lifecycle module docstring)."""
        cfg = self.config
        address = cfg.bind if cfg.bind not in ("", lifecycle.ALL_INTERFACES) else \
            lifecycle.routed_address(cfg.root_uri, cfg.root_port)
        if address is None:
            log.warning("cannot tell the workers this server's address (no route to %s); they reach it once their "
                        "sockets give up the old one", cfg.root_uri)
            return
        workers = [p for p in self._peers if p.role == WORKER]
        for peer in workers:
            self._send_control(peer.node_id, membership.address_update(self.my_id, address, self.port, self._tick()))
        log.info("told %d workers this server is at %s:%d (for %s)", len(workers), address, self.port, cfg.host)

    def _decide_recovery(self) -> None:
        """KVSTORE_LAZY_RECOVERY=auto (a pod or container restarted with the same environment): rejoin the job of
        this host:port's previous process if it died within the rejoin window, else register (lifecycle)."""
        cfg = self.config
        record = find_membership(cfg.snapshot_dir, cfg.host, cfg.port, cfg.recover_rank, missing_ok=True)
        path = membership_path(cfg.snapshot_dir, record["rank"]) if record is not None else None
        rejoin, why = lifecycle.rejoin_decision(record, path, cfg.rejoin_window)
        log.info("KVSTORE_LAZY_RECOVERY=auto: %s", why)
        cfg.recovery = "rejoin" if rejoin else ""
        cfg.is_recovery = rejoin

    def _status_serving(self) -> None:
        assert self.server is not None
        self.status.write("serving", rank=self.server.rank, node_id=self.my_id, host=self.config.host,
                          port=self.port)

    def _bind_again(self, host: str, port: int, wait: float = 15.0) -> int:
        deadline = time.monotonic() + wait
        while True:
            try:
                return self.van.bind(host, port, max_retry=0)
            except OSError as exc:
                if self.van.receiver is not None:
                    self.van.receiver.close(linger=0)
                    self.van.receiver = None
                if time.monotonic() > deadline:
                    raise StartupError(f"cannot rejoin: {host}:{port} stays busy ({exc}); is the old server still "
                                       f"running?") from None
                time.sleep(0.2)

    def _start_timers(self) -> None:
        now = time.monotonic()
        # heartbeats as PS_HEARTBEAT_INTERVAL asks, and at least 5 per KVSTORE_LAZY_SCHEDULER_TIMEOUT: the stock
        # scheduler answers each one (Van::ProcessHearbeat), which is how a hung scheduler is noticed
        every = [t for t in (self.config.heartbeat_interval, self.config.scheduler_timeout / 5) if t > 0]
        self._heartbeat_every = min(every) if every else 0.0
        if self._heartbeat_every > 0:
            self._next_heartbeat = now + self._heartbeat_every
        self._next_stats = now + self.config.stats_interval
        if self.config.snapshot_dir and self.config.snapshot_interval > 0:
            self._next_snapshot = now + self.config.snapshot_interval
        if self.config.resend:
            self._next_resend_check = now + self.config.resend_timeout

    def _write_membership(self, state: str = "running") -> None:
        assert self.server is not None and self.my_id is not None
        cfg = self.config
        record = {"rank": self.server.rank, "id": self.my_id, "host": cfg.host, "port": self.port, "state": state,
                  "requested_port": cfg.port, "root_uri": cfg.root_uri, "root_port": cfg.root_port,
                  "num_servers": cfg.num_servers, "num_workers": cfg.num_workers, "pid": os.getpid(),
                  "peers": [[p.node_id, p.role, p.hostname, p.port] for p in self._peers]}
        checkpoint.atomic_write(membership_path(cfg.snapshot_dir, self.server.rank),
                                lambda fh: fh.write(json.dumps(record, indent=1)), mode="w")

    def serve(self) -> None:
        assert self.server is not None
        # Everything made before serving (modules, config, restored keys) is kept for the process's life: out of
        # the collector's sight, and young objects collected less often (a request allocates dozens, and frees
        # them by reference counting: its messages, arrays and lists hold no cycles)
        gc.freeze()
        gc.set_threshold(*GC_THRESHOLD)
        while not self.server.stopped:
            msg = self._recv(self._poll_timeout())
            # every message already queued before the timers (at most DRAIN_MAX; a due snapshot still looks for
            # the first quiescent moment after each message)
            served = 0
            self._held = []   # replies of this drain (see REPLY_BATCH), sent in order by _release
            while msg is not None:
                self._dispatch(msg)
                served += 1
                if served == DRAIN_MAX or self.server.stopped or self._snapshot_due:
                    break
                if served % REPLY_BATCH == 0:
                    self._release()
                msg = self._recv(0)
            self._release()
            self._held = None
            self._timers()
        self.log_stats("at shutdown")
        if self.config.snapshot_dir:
            self.save_snapshot(full=True)

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
        started = time.monotonic()
        if self.chain is None:
            self.chain = checkpoint.SnapshotChain(self.config.snapshot_dir, self.server.rank, self.server.num_servers,
                                                  self.config.snapshot_deltas,
                                                  writer=lifecycle.writer_of(self.config.host, self.port))
        delta = not full and self.chain.next_is_delta()
        meta, tables = self.server.snapshot(delta=delta)
        new_journal = None
        if self.journal is not None:
            pending = self.outbox.frames()
            seen = list(self._seen)[-SEEN_IN_JOURNAL:]
            new_journal = journal_mod.Journal.create(
                journal_mod.journal_path(self.config.snapshot_dir, self.server.rank, self.journal.epoch,
                                         self.journal.seq),
                self.journal.epoch, self.journal.seq, seen, pending, fsync=self.config.journal_fsync)
            meta["journal"] = {"epoch": self.journal.epoch, "seq": self.journal.seq}
            self._snapshot_seq = self.journal.seq
        if self.gate is not None and self.gate.active:
            meta["resume_gate"] = self.gate.state()
        path, size = self.chain.write(meta, tables, delta)
        self.server.snapshot_written()
        if new_journal is not None:
            self.journal.close()
            self.journal = new_journal
            journal_mod.remove_others(self.config.snapshot_dir, self.server.rank, new_journal.path)
        rows = sum(len(t["row_ids"]) for k, t in tables.items() if t["meta"]["kind"] == "row_sparse")
        log.info("snapshot written to %s (%s): %d keys, %d rows, %d bytes, %.3fs", path, "delta" if delta else "base",
                 len(tables), rows, size, time.monotonic() - started)
        if self.metrics is not None:
            self.metrics.snapshot_written("latest", time.monotonic() - started)

    def save_tagged(self, tag) -> None:
        """LAZY_SNAPSHOT: <dir>/tagged/rank<r>, with the worker's tag, before the command is answered."""
        assert self.server is not None
        started = time.monotonic()
        meta, tables = self.server.snapshot()
        meta["tag"] = tag
        meta["quiescent"] = self.quiescent()
        path = checkpoint.write_snapshot(Path(self.config.snapshot_dir) / TAGGED_DIR, self.server.rank,
                                         self.server.num_servers, tables, meta,
                                         writer=lifecycle.writer_of(self.config.host, self.port))
        log.info("tagged snapshot %s written to %s in %.3fs%s", json.dumps(tag), path, time.monotonic() - started,
                 "" if meta["quiescent"] else " (WARNING: a dist_sync round was half-way; its pushes are not in it)")
        if self.metrics is not None:
            self.metrics.snapshot_written("tagged", time.monotonic() - started)

    def load_snapshot(self) -> None:
        """A fresh start: restore <dir>/tagged/rank<r> or <dir>/rank<r> (KVSTORE_LAZY_RESUME) and keep it against the
        new job's kv.init pushes and identical optimizer (ResumeGate)."""
        assert self.server is not None
        base, rank = Path(self.config.snapshot_dir), self.server.rank
        choice = self.config.resume
        candidates = {"auto": [base / TAGGED_DIR, base], "tagged": [base / TAGGED_DIR], "latest": [base],
                      "none": []}[choice]
        for directory in candidates:
            self._check_owner(directory)
            loaded = checkpoint.load_snapshot(directory, rank)
            if loaded is not None:
                break
        else:
            log.info("no snapshot for rank %d in %s (KVSTORE_LAZY_RESUME=%s); starting empty", rank, base, choice)
            return
        manifest = loaded.manifest
        self._restore(directory, loaded)
        server_meta = manifest.get("server", {})
        self.gate = ResumeGate(self.server.key_ids(), self.server.optimizer_body)
        log.info("restored snapshot of rank %d from %s%s: %d keys; this job's kv.init pushes of them will be dropped",
                 rank, directory, f" (tag {json.dumps(server_meta.get('tag'))})" if "tag" in server_meta else "",
                 len(manifest["keys"]))

    def _check_owner(self, directory: Path) -> None:
        """Never load another server's snapshot from a volume of its own (lifecycle.check_snapshot_owner)."""
        assert self.server is not None
        try:
            lifecycle.check_snapshot_owner(directory, self.server.rank, self.config.host, self.port,
                                           self.config.snapshot_scope)
        except lifecycle.LifecycleError as exc:
            raise StartupError(str(exc)) from None

    def _restore(self, directory: Path, loaded: checkpoint.Loaded) -> None:
        assert self.server is not None
        manifest = loaded.manifest
        if manifest.get("num_servers") != self.server.num_servers:
            raise StartupError(f"snapshot in {directory} was written by {manifest.get('num_servers')} servers, "
                               f"this job has {self.server.num_servers}; restore through a worker checkpoint")
        self.server.restore(manifest.get("server", {}), loaded.tables)

    def _new_journal_epoch(self) -> None:
        """A fresh start with the journal on: a new epoch whose base snapshot is the state now."""
        assert self.server is not None
        epoch = secrets.randbits(63)
        self.journal = journal_mod.Journal.create(
            journal_mod.journal_path(self.config.snapshot_dir, self.server.rank, epoch, 0), epoch, 0,
            fsync=self.config.journal_fsync)
        self.save_snapshot()

    def _restore_and_replay(self, started: float | None = None) -> None:
        """Recovery: the last snapshot of <dir>/rank<r>, then every journaled request after it, in order; the replies
        peers never ACKed go out again."""
        assert self.server is not None and self.my_id is not None
        started = time.monotonic() if started is None else started
        directory, rank = Path(self.config.snapshot_dir), self.server.rank
        self._check_owner(directory)
        loaded = checkpoint.load_snapshot(directory, rank)
        manifest = loaded.manifest if loaded is not None else None
        info = (manifest or {}).get("server", {}).get("journal")
        if manifest is None or info is None:
            raise StartupError(f"cannot recover rank {rank}: no journaled snapshot in {directory} (the server died "
                               f"before its first one, or ran without KVSTORE_LAZY_JOURNAL); restart the job")
        epoch, base = int(info["epoch"]), int(info["seq"])
        path = journal_mod.journal_path(directory, rank, epoch, base)
        contents = journal_mod.read(path)
        if contents is None:
            raise StartupError(f"cannot recover rank {rank}: the snapshot continues in {path}, which is missing")
        self._restore(directory, loaded)
        self.chain = checkpoint.SnapshotChain(directory, rank, self.server.num_servers, self.config.snapshot_deltas,
                                              writer=lifecycle.writer_of(self.config.host, self.port))
        self.chain.resume(loaded)      # the next periodic snapshot continues the chain it was loaded from
        gate_state = manifest["server"].get("resume_gate")
        if gate_state:
            self.gate = ResumeGate.from_state(gate_state, self.server.optimizer_body)
        for sig in contents.seen:
            self._remember(sig)
        owed: dict[int, tuple[int, Message]] = {}
        for recver, frames in contents.pending:
            reply = Message.from_frames([identity_of(self.my_id)] + frames)
            owed[membership.message_signature(reply.meta, self.my_id, recver)] = (recver, reply)
        replayed = ticks = 0
        self._replaying = True
        try:
            for entry in contents.entries:
                if entry.seq <= base:
                    continue
                if entry.sender == CLOCK_SENDER:
                    self.server.lifecycle.set_clock(struct.unpack("<d", entry.frames[0])[0])
                    ticks += 1
                    continue
                msg = Message.from_frames([identity_of(entry.sender)] + entry.frames)
                self._remember(membership.message_signature(msg.meta, msg.sender, self.my_id))
                for recver, reply in self._process(msg):
                    owed[membership.message_signature(reply.meta, self.my_id, recver)] = (recver, reply)
                replayed += 1
        finally:
            self._replaying = False
        self.journal = journal_mod.Journal.reopen(path, contents, fsync=self.config.journal_fsync)
        self._connect_peers()
        resent = 0
        for sig, (recver, reply) in owed.items():
            if sig not in contents.acked:
                self._send(recver, reply)
                resent += 1
        log.info("recovered rank %d from %s: snapshot at request %d, %d journaled requests replayed%s%s, %d replies "
                 "re-sent; %.3fs", rank, directory, base, replayed, f" (and {ticks} clock ticks)" if ticks else "",
                 f" ({contents.torn_bytes} bytes of a torn last record ignored)" if contents.torn_bytes else "",
                 resent, time.monotonic() - started)

    # ------------------------------------------------------------------------------------------------------------

    def stop(self) -> None:
        # Without this final group-7 barrier every worker and the scheduler hang after training.
        if self.config.resend and self.server is not None:
            # Under PS_RESEND the stock scheduler may carry extra counts from resent startup BARRIERs of workers (see
            # start), and then releases the final barrier before everyone asked; a node that asks after that release
            # waits forever. The servers ask last, one after another, and a server the release reached before it
            # asked does not ask: that absorbs up to one extra count per server.
            self._barrier_released = False
            self._pump_for(FINAL_BARRIER_STAGGER * (self.server.rank + 1), until=lambda: self._barrier_released)
            if self._barrier_released:
                log.info("the scheduler released the final barrier before this server asked (extra counts from "
                         "resent startup BARRIERs, a ps-lite PS_RESEND race); not asking")
                self._stopped()
                return
        if not self.barrier(membership.ALL_GROUP, timeout=FINAL_RELEASE_WAIT):
            log.warning("no release of the final barrier from the scheduler within %.0fs (its socket to this server "
                        "may still have been trying an old address of it); training is over, stopping",
                        FINAL_RELEASE_WAIT)
        self._stopped()

    def _stopped(self) -> None:
        """Past the final barrier: the job is over, so a later start with this record registers anew."""
        if self.config.snapshot_dir and self.server is not None:
            self._write_membership("finished")
        self.status.write("stopped")
        log.info("stopped")

    def barrier(self, group: int, timeout: float | None = None) -> bool:
        """Ask the scheduler for barrier `group` and serve until it is released (False: not within `timeout` s)."""
        self._barrier_released = False
        # not kept for resending: a resent BARRIER that the scheduler had processed but not ACKed counts twice
        self._send_control(membership.SCHEDULER_ID, membership.barrier_request(group, self._tick()))
        deadline = float("inf") if timeout is None else time.monotonic() + timeout
        while not self._barrier_released:
            if time.monotonic() > deadline:
                return False
            msg = self._recv(self._poll_timeout())
            if msg is not None:
                self._dispatch(msg)
            self._timers()
        return True

    def _pump_for(self, seconds: float, until=None) -> None:
        """Serve incoming messages and timers for `seconds` (or until `until()` is true)."""
        end = time.monotonic() + seconds
        while time.monotonic() < end and not (until is not None and until()):
            msg = self._recv(max(1, min(self._poll_timeout(), int((end - time.monotonic()) * 1000))))
            if msg is not None:
                self._dispatch(msg)
            self._timers()

    # ------------------------------------------------------------------------------------------------------------

    def _tick(self) -> int:
        ts = self.timestamp
        self.timestamp += 1
        return ts

    def _poll_timeout(self) -> int:
        nearest = min(self._next_heartbeat, self._next_stats, self._next_snapshot, self._next_resend_check,
                      self.metrics.next_publish if self.metrics is not None else float("inf"))
        return max(0, min(1000, int((nearest - time.monotonic()) * 1000)))

    def _timers(self) -> None:
        now = time.monotonic()
        if now >= self._next_touch and self.config.snapshot_dir and self.server is not None:
            lifecycle.touch(membership_path(self.config.snapshot_dir, self.server.rank))   # last alive
            self._next_touch = now + lifecycle.TOUCH_EVERY
        if now >= self._next_heartbeat and self.my_id is not None:
            self._send_control(membership.SCHEDULER_ID,
                               membership.heartbeat(self.my_id, self.config.host, self.port, self._tick()))
            self._next_heartbeat = now + self._heartbeat_every
            if self._asked_scheduler is None:
                self._asked_scheduler = now
        self._check_scheduler(now)
        if now >= self._next_resend_check:
            self._resend(now)
            self._next_resend_check = now + max(self.config.resend_timeout / 2, 0.05)
        if self.server is not None and self.server.lifecycle.wants_clock and now >= self._next_clock:
            self._clock_tick()
            self._next_clock = now + CLOCK_EVERY
        if self.journal is not None:
            self.journal.flush()
        if self.server is not None and self.config.snapshot_dir:
            if now >= self._next_snapshot:
                self._snapshot_due = True
                if self.config.snapshot_interval > 0:
                    self._next_snapshot = now + self.config.snapshot_interval
            if self.journal is not None and self.journal.bytes_written > self.config.journal_max_bytes:
                self._snapshot_due = True
            if self._snapshot_due and self.journal is not None and self.journal.seq == self._snapshot_seq \
                    and not self.outbox.pending:
                self._snapshot_due = False   # nothing happened since the last one
            # with the journal, only a snapshot between rounds lets the journal start over
            if self._snapshot_due and (self.journal is None or self.quiescent()):
                self._snapshot_due = False
                self.save_snapshot()
        if now >= self._next_stats:
            self.log_stats("periodic")
            self._next_stats = now + self.config.stats_interval
        if self.metrics is not None and now >= self.metrics.next_publish:
            self.metrics.publish(self.server, self.van, now)

    def _resend(self, now: float) -> None:
        for entry in self.outbox.due(now):
            recver, message, first, _, tries = entry
            self.van.send(recver, message)
            if tries in (1, 3, 10) or tries % 30 == 0:
                log.warning("no ACK from %s for %.0fs: resent a message to it (try %d)", node_name(recver),
                            now - first, tries)

    def _clock_tick(self) -> None:
        """The lifecycle's clock (ttl_seconds) moves only here, journaled like a request so a replay repeats it."""
        assert self.server is not None
        seconds = time.time()
        if self.journal is not None and not self._replaying:
            self.journal.append(CLOCK_SENDER, [struct.pack("<d", seconds)])
        self.server.lifecycle.set_clock(seconds)

    def log_stats(self, when: str) -> None:
        if self.server is None:
            return
        for key, s in self.server.stats()["sparse"].items():
            log.info("stats (%s): key %s rows %d bytes %d%s", when, key, s["rows"], s["bytes"],
                     "".join(f" {name} {s[name]}" for name in ("pending", "admitted", "dropped", "evicted")
                             if name in s)
                     + ("".join(f" {name} {s[name]}" for name in ("disk_rows", "disk_bytes", "disk_index_bytes",
                                                                  "promoted", "demoted"))
                        + f" hit_rate {s['hit_rate']:.4f}" if "disk_rows" in s else ""))
        log.info("stats (%s): received %d bytes, sent %d bytes", when, self.van.bytes_received, self.van.bytes_sent)

    def _send_control(self, node_id: int, msg: Message) -> None:
        self.van.send(node_id, msg)

    def _release(self) -> None:
        """Send the replies held since the last release, in order."""
        held = self._held
        if held:
            self._held = []
            for recver, msg in held:
                self.van.send(recver, msg)

    def _send(self, recver: int, msg: Message) -> None:
        """Send a reply, and with PS_RESEND keep it until the peer ACKs it (control messages go through
        _send_control and are never resent)."""
        if self._held is not None:
            self._held.append((recver, msg))
        else:
            self.van.send(recver, msg)
        if self.config.resend and self.my_id is not None:
            self.outbox.track(membership.message_signature(msg.meta, self.my_id, recver), recver, msg,
                              time.monotonic())

    def _remember(self, signature: int) -> None:
        self._seen[signature] = None
        if len(self._seen) > SEEN_KEEP:
            self._seen.popitem(last=False)

    def _recv(self, timeout_ms: int) -> Message | None:
        frames = self.van.recv(timeout_ms)
        if frames is None:
            return None
        try:
            msg = Message.from_frames(frames)
        except ProtocolError as exc:
            log.error("dropping a malformed message from identity %r: %s", bytes(frames[0])[:16], exc)
            if self.metrics is not None:
                self.metrics.malformed()
            return None
        if self.journal is not None:
            msg.frames = frames[1:]   # as received: what the journal keeps
        if not self._admit(msg, self.van.last_peer):
            return None
        if self.config.verbose >= 2:
            log.info("recv from %s: %s (%d data frames)", node_name(msg.sender), msg.meta, len(msg.data))
        return msg

    def _dispatch(self, msg: Message) -> None:
        cmd = msg.meta.control.cmd
        if cmd == ACK:
            signature = msg.meta.control.msg_sig
            if self.outbox.ack(signature) and self.journal is not None:
                self.journal.ack(signature)
            return
        signature = None
        if self.config.resend and self.my_id is not None and cmd != TERMINATE:
            signature = membership.message_signature(msg.meta, msg.sender, self.my_id)
            if signature in self._seen:
                self._send_control(msg.sender, membership.ack(signature))
                return  # a resent duplicate: ACKed again, not processed again
        if cmd == 0 and self.journal is not None and self.server is not None:
            # write-ahead: in the journal before it is ACKed or changes anything
            self.journal.append(msg.sender, getattr(msg, "frames", None) or msg.to_frames())
        if signature is not None:
            self._send_control(msg.sender, membership.ack(signature))
            self._remember(signature)
        if cmd != 0:
            self._control(msg)
            return
        assert self.server is not None, "data before registration"
        started, bad = time.perf_counter(), self.server.bad_requests
        for recver, reply in self._process(msg):
            self._send(recver, reply)
        if self.server.lifecycle.due:
            # the round's replies go first, then its budget pass (a disk tier's demotions: tens of ms), which
            # the workers then do not wait for unless their next requests come sooner
            self._release()
            self.server.settle()
        if self.metrics is not None:
            self.metrics.request(msg.meta, time.perf_counter() - started, self.server.bad_requests - bad)

    def _process(self, msg: Message) -> list[tuple[int, Message]]:
        """One request through the resume gate and the KVServer (also what journal replay runs)."""
        assert self.server is not None
        if self.gate is not None and self.gate.active:
            replies = self.gate.intercept(self.server.key_range, msg)
            if replies is not None:
                return replies
        replies = self.server.handle(msg)
        if msg.meta.simple_app and msg.meta.head == mx.LAZY_SNAPSHOT:
            if self.config.snapshot_dir and not self._replaying:
                self.save_tagged(_tag_of(bytes(msg.meta.body)))
                self._snapshot_due = True
        return replies

    def _control(self, msg: Message) -> None:
        # trust.Gate admitted it: BARRIER releases, ADD_NODE and HEARTBEAT replies come from the scheduler only
        cmd = msg.meta.control.cmd
        if membership.is_barrier_release(msg.meta):
            self._barrier_released = True
        elif cmd == ADD_NODE and self.my_id is not None:
            self._announced(msg)

    # ------------------------------------------------------------------------------------------------------------
    # who may send what (issue 11): trust.Gate decides, these wire it to the sockets and the log

    def _expect_scheduler(self) -> None:
        cfg = self.config
        self.trust_gate.local = _local_addresses()
        try:
            own = _resolve(cfg.host)
        except OSError:
            own = set()
        self.trust_gate.own = frozenset(ip for ip in map(trust.ip_of, own) if ip is not None)
        reason = self.trust_gate.expect_scheduler(cfg.root_uri)
        if reason is not None:
            raise StartupError(f"the scheduler at {cfg.root_uri}:{cfg.root_port} cannot be trusted: {reason}")

    def _set_roster(self, roster: membership.Roster) -> None:
        assert self.my_id is not None
        self.roster = roster
        for node_id, reason in self.trust_gate.set_roster(roster, self.my_id).items():
            if node_id == membership.SCHEDULER_ID:
                raise StartupError(f"the scheduler ({roster.nodes[node_id]}) cannot be trusted: {reason}")
            log.error("%s will not be served: %s", roster.nodes[node_id], reason)

    def _connect(self, peer: membership.Peer, identity: bytes | None) -> None:
        """Open the DEALER to an announced (validated) peer; the scheduler's is watched (a dead scheduler)."""
        try:
            self.van.connect(peer.node_id, peer.hostname, peer.port, identity=identity,
                             watch=peer.node_id == membership.SCHEDULER_ID)
        except ConnectError as exc:
            raise StartupError(str(exc)) from None

    def _connect_peers(self) -> None:
        assert self.my_id is not None
        for peer in self._peers:
            if peer.node_id not in self.trust_gate.refused_nodes:
                self._connect(peer, identity_of(self.my_id))

    def _announced(self, msg: Message) -> None:
        """A later ADD_NODE from the scheduler announces a recovered node: reconnect to it under its (reused) id."""
        assert self.roster is not None and self.my_id is not None
        try:
            workers = self.roster.update(msg.meta)
        except membership.MembershipError as exc:
            log.error("ignoring an ADD_NODE from the scheduler: %s", exc)
            return
        for peer in workers:
            reason = self.trust_gate.update_node(peer.node_id, peer.hostname)
            if reason is not None:
                self.van.disconnect(peer.node_id)
                log.error("%s will not be served: %s", peer, reason)
                continue
            try:
                self._connect(peer, identity_of(self.my_id))
            except StartupError as exc:
                log.error("%s", exc)
                continue
            log.info("reconnected to %s at %s:%d", node_name(peer.node_id), peer.hostname, peer.port)

    def _admit(self, msg: Message, peer: str | None) -> bool:
        """trust.Gate's verdict on a received message; a refused one is logged (rate-limited) and dropped."""
        dropped = self.van.dropped.get(msg.sender)
        if dropped:
            reason = f"this server dropped it ({dropped})"
        else:
            reason = self.trust_gate.refusal(msg.sender, peer, msg.meta)
        if reason is None:
            if msg.sender == membership.SCHEDULER_ID:
                self._asked_scheduler = None
            return True
        if self.roster is None and msg.sender == membership.SCHEDULER_ID and msg.meta.control.cmd == ADD_NODE \
                and reason.startswith("it comes from"):
            # The scheduler's node list from another address than DMLC_PS_ROOT_URI: a Service (ClusterIP) or NAT in
            # between, most likely. Only the first connection as ps1 gets through ZeroMQ, so waiting cannot help.
            raise StartupError(f"the scheduler's node list came from {peer}, but DMLC_PS_ROOT_URI="
                               f"{self.config.root_uri} is not that address (behind a Service address or NAT? then "
                               f"set KVSTORE_LAZY_CHECK_ADDRESS=0, or point DMLC_PS_ROOT_URI at the scheduler itself)")
        suffix = self._refusals.admit((msg.sender, peer, reason))
        if suffix is not None:
            who = node_name(msg.sender) if msg.sender == EMPTY or (
                self.roster is not None and msg.sender in self.roster.nodes) else f"node {msg.sender}"
            log.error("ignoring %s from %s%s: %s%s", trust.what(msg.meta), who, f" at {peer}" if peer else "",
                      reason, suffix)
        return False

    def _check_scheduler(self, now: float) -> None:
        """Raise SchedulerLost once the scheduler is gone: its connection closed and stayed closed for
        SCHEDULER_GRACE (a process that died), or KVSTORE_LAZY_SCHEDULER_TIMEOUT passed since a heartbeat it did not
        answer (a host or a process that hangs). Messages already received are read first (they may be the
        scheduler's last ones, e.g. the final barrier's release), unless that takes 5x longer still."""
        cfg = self.config
        where = f"the scheduler at {cfg.root_uri}:{cfg.root_port}"
        if membership.SCHEDULER_ID in self.van.dropped:
            raise SchedulerLost(f"{where} stopped reading: {self.van.dropped[membership.SCHEDULER_ID]}")
        grace = self._scheduler_grace
        link = self.van.link(membership.SCHEDULER_ID)
        if link is not None and link.ever_up and not link.up:
            down = now - link.changed
            if down > grace and (down > 5 * grace or not self.van.incoming()):
                raise SchedulerLost(f"lost {where}: its connection closed {down:.1f}s ago and did not come back")
        timeout, asked = cfg.scheduler_timeout, self._asked_scheduler
        if timeout > 0:
            timeout = max(timeout, grace)
        if timeout > 0 and asked is not None and now - asked > timeout and (
                now - asked > 5 * timeout or not self.van.incoming()):
            raise SchedulerLost(f"lost {where}: no answer to heartbeats for {now - asked:.1f}s "
                                f"(KVSTORE_LAZY_SCHEDULER_TIMEOUT={timeout:g})")


def _resolve(host: str) -> set[str]:
    """IPv4 addresses of a host name or literal (raises OSError if it does not resolve)."""
    return {info[4][0] for info in socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM)}


def _local_addresses() -> frozenset:
    """This machine's IPv4 addresses (one per interface), for trust.Gate's same-host rule."""
    found = set()
    for _, name in socket.if_nameindex():
        ip = trust.ip_of(_interface_ip(name))
        if ip is not None:
            found.add(ip)
    return frozenset(found)


def _set_label(rank: int) -> None:
    global _node_label
    _node_label = f"server {rank}"


def _rejoin_timestamp() -> int:
    """The first control-message timestamp of a restarted server. PS_RESEND peers drop a message whose signature
    (sender, timestamp, ...) they saw before, so a restarted server must not count from 0 again: it starts at
    2^29 + (wall-clock ms mod 2^28), far above what the first process used (one heartbeat a second) and apart from
    any other restart's range, and below 2^30 (ps-lite shifts the timestamp left once in an int)."""
    return (1 << 29) + int(time.time() * 1000) % (1 << 28)


def _tag_of(body: bytes):
    if not body:
        return None
    text = body.decode("utf-8", errors="replace")
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text
