"""The server process: wires the transport, the node's rooms and the KVServer together, and says how it ended.

Owns: the configuration read from the DMLC_* environment (as a stock server reads it; ``Config.from_env``), the
wiring of one server (``ServerNode``: a van, a clock, the rooms below, the KVServer), its timer table's entries,
and the exit status of each ending: 0 after the final barrier, 2 for a start that cannot be made
(``StartupError``), 3 for a lost scheduler (``SchedulerLost``), 4 for a failing disk under the disk tier.
Does not own (the rooms of ``kvstore_lazy.node``):
- ``node``: the van, the clock, the timer table and the receive loop (``Node``);
- ``session``: the exact start/stop sequence stock workers and the stock scheduler need, as ``states``:
  ADD_NODE -> reconnect with identity -> BARRIER(7) -> serve -> kStopServer answered -> BARRIER(7) -> close,
  and the rejoin of a restarted server;
- ``delivery``: PS_RESEND (the outbox, the seen set, ACKs, resends) and reply batches;
- ``durability``: snapshots, the journal's epochs, replay;
- ``recovery``: the membership record and the choice between a fresh start, a rejoin and ps-lite's recovery;
- ``guard`` and ``liveness``: who may send what (``trust.Admission``) and whether the scheduler is still there.

Durability and recovery (KVSTORE_LAZY_SNAPSHOT_DIR, KVSTORE_LAZY_JOURNAL, KVSTORE_LAZY_RECOVERY): see
``durability`` and ``session``. Requests that died with the old process (in its socket buffers, never ACKed) are
re-sent by the workers' PS_RESEND, and duplicates are recognised by signature. So no request a worker sent is lost,
acknowledged or not, provided every node runs with PS_RESEND=1 and the server is back within 10 x PS_RESEND_TIMEOUT
(ps-lite aborts a node after 10 unanswered resends).
KVSTORE_LAZY_RECOVERY=register tries stock ps-lite's own recovery instead (ADD_NODE with is_recovery, resent
until the scheduler's PS_HEARTBEAT_TIMEOUT has declared the old node dead; no startup barrier). It is kept for
experiments only. Measured with the stock scheduler of mxnet 1.9.1: with PS_RESEND the scheduler aborts as soon as
the node registers (it ACKs the anonymous registration to node kEmpty: zmq_van.h "Check failed: id !=
Meta::kEmpty"); without PS_RESEND the node is accepted but requests that died with the old process are never
re-sent and the job hangs. The scheduler also keeps its list of recovered nodes forever, so a second recovery
would fail its CHECK_EQ(size, 1).

Who may send what (issue 11): every received message passes ``trust.Admission`` (through ``guard``) before
anything reads it (strict identities, the scheduler's validated node list, announced source addresses, per-role
permissions); the scheduler's DEALER is watched (``Van.watch``) and heartbeated, and a lost scheduler ends the
process with one error line and status 3 in every phase. Sends never block (the van queues, and drops a peer that
stops reading).
"""
from __future__ import annotations

import ctypes
import gc
import logging
import os
import socket
import time
from dataclasses import dataclass
from typing import Any

from kvstore_lazy.config import (ConfigError, atoi_flag, boolean, choice, integer, number, read, summary,
                                 unknown_warnings)
from kvstore_lazy.node import membership, recovery, trust
from kvstore_lazy.node import placement as lifecycle
from kvstore_lazy.node.clock import Clock, SystemClock
from kvstore_lazy.node.delivery import Delivery, Outbox
from kvstore_lazy.node.durability import CLOCK_EVERY, Durability
from kvstore_lazy.node.errors import (EXIT_DISK, EXIT_OK, EXIT_SCHEDULER_LOST, EXIT_STARTUP, SchedulerLost,
                                      StartupError)
from kvstore_lazy.node.guard import Guard, interface_ip, local_addresses, resolve
from kvstore_lazy.node.liveness import SchedulerWatch
from kvstore_lazy.node.lognames import NodeLogFilter
from kvstore_lazy.node.node import Node
from kvstore_lazy.node.promexport import Exporter, address_from_env
from kvstore_lazy.node.recovery import find_membership, membership_path
from kvstore_lazy.node.session import Session
from kvstore_lazy.persist import checkpoint
from kvstore_lazy.protocol.message import Message
from kvstore_lazy.server.core import KVServer
from kvstore_lazy.server.lifecycle import Settings as LifecycleSettings
from kvstore_lazy.store.tier import MMAP_THRESHOLD, TRIM_THRESHOLD, DiskTierFailure
from kvstore_lazy.transport.van import BindError, Van
from kvstore_lazy.transport.zmq_van import QUEUE_BYTES, QUEUE_MESSAGES, ZmqVan

__all__ = ["Config", "NodeLogFilter", "Outbox", "SchedulerLost", "ServerNode", "StartupError", "default_host",
           "find_membership", "membership_path"]

log = logging.getLogger("kvstore_lazy")

# the collector's thresholds while serving (gen 0 allocations, gen 1 and gen 2 collections); CPython's are 700, 10, 10
GC_THRESHOLD = (50_000, 20, 100)


def _fix_malloc() -> None:
    """glibc's mmap and trim thresholds fixed at the disk tier's values (``store.tier``: 4 MiB, 16 MiB) for a
    serving process. ZeroMQ's I/O thread receives every message of 128 KiB or more (a row_sparse push or pull of
    1,024 rows of D=32 and up) into a buffer of its own from malloc, and the loop frees it; under glibc's default
    (dynamic) thresholds the I/O thread's heap is trimmed back after such frees and the next message's buffer is
    fresh pages again: measured at N=8 B=8192 (the saturation scenario), page faults and the kernel zeroing those
    pages took ~9% of the server's CPU. Fixed, those buffers and the replies' payloads are reused heap memory. The
    cost: up to 16 MiB of free heap kept per malloc arena (the disk tier measured the same settings). No glibc:
    nothing."""
    try:
        libc = ctypes.CDLL(None)
        libc.mallopt(-3, MMAP_THRESHOLD)       # M_MMAP_THRESHOLD
        libc.mallopt(-1, TRIM_THRESHOLD)       # M_TRIM_THRESHOLD
    except (OSError, AttributeError):
        pass


def default_host() -> str:
    """DMLC_NODE_HOST, else the IPv4 of DMLC_INTERFACE, else the first non-loopback IPv4
    (ps-lite GetAvailableInterfaceAndIP)."""
    host = os.environ.get("DMLC_NODE_HOST", "")
    if host:
        return host
    interface = os.environ.get("DMLC_INTERFACE", "")
    if interface:
        ip = interface_ip(interface)
        if ip:
            return ip
    for _, name in socket.if_nameindex():
        ip = interface_ip(name)
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


@dataclass(frozen=True)
class Config:
    """The server's settings, read once from the environment at start (:meth:`from_env`) and never changed after
    (a RECOVERY=auto start resolves to a new Config before anything uses it: ``recovery.decide``)."""
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
    status_file: str = ""           # KVSTORE_LAZY_STATUS_FILE: the phase, for `kvstore-lazy ready` probes
    profile: str = ""               # KVSTORE_LAZY_PROFILE: run under cProfile, write PREFIX.<pid>.prof
    restore_from: str = ""          # KVSTORE_LAZY_RESTORE_FROM: another job's snapshots to start from (any count)
    lazy_job: bool = False          # KVSTORE_LAZY: the job says it is lazy (an undeclared full init is then a warning)

    @classmethod
    def from_env(cls, env=None) -> "Config":
        """The configuration `env` (default: this process's environment) describes. Every ``KVSTORE_LAZY_*``
        variable is read through kvstore_lazy.config's strict readers and ps-lite's as a stock server reads them; a
        value that cannot be honoured is a StartupError of one line naming the variable, the value and what is
        accepted (the server exits 2 with it). Logs a warning per unknown ``KVSTORE_LAZY_*`` name (with the known
        one it most likely meant), then the settings the environment sets, in one line."""
        env = os.environ if env is None else env
        for line in unknown_warnings(env):
            log.warning("%s", line)
        try:
            config = cls._read(env)
        except ConfigError as exc:
            raise StartupError(str(exc)) from None
        log.info("settings: %s", summary(env))
        return config

    @classmethod
    def _read(cls, env) -> "Config":
        role = env.get("DMLC_ROLE", "server")
        if role != "server":
            raise StartupError(f"DMLC_ROLE={role!r}: kvstore_lazy only runs the server role")
        root_uri = env.get("DMLC_PS_ROOT_URI", "")
        if not root_uri:
            raise StartupError("DMLC_PS_ROOT_URI is not set")
        recovery, resume = _recovery_from_env(env)
        try:
            metrics = address_from_env(env, local=atoi_flag(env, "DMLC_LOCAL"))
        except ValueError as exc:
            raise StartupError(str(exc)) from None
        fields: dict[str, Any] = dict(
            root_uri=root_uri,
            root_port=_env_int(env, "DMLC_PS_ROOT_PORT"),
            num_workers=_env_int(env, "DMLC_NUM_WORKER"),
            num_servers=_env_int(env, "DMLC_NUM_SERVER"),
            host=default_host() if env is os.environ else (env.get("DMLC_NODE_HOST") or default_host()),
            port=_env_int(env, "PORT", 0),
            local=atoi_flag(env, "DMLC_LOCAL"),
            heartbeat_interval=number(env, "PS_HEARTBEAT_INTERVAL", 0.0, minimum=0.0),
            resend=atoi_flag(env, "PS_RESEND"),
            resend_timeout=_env_int(env, "PS_RESEND_TIMEOUT", 1000) / 1000.0,
            water_mark=_env_int(env, "DMLC_PS_WATER_MARK", 0),
            verbose=_env_int(env, "PS_VERBOSE", 0),
            materialize=choice(env, "KVSTORE_LAZY_MATERIALIZE"),
            stats_interval=number(env, "KVSTORE_LAZY_STATS_INTERVAL", 60.0, minimum=0.0),
            is_recovery=bool(recovery),
            recovery=recovery,
            recover_rank=integer(env, "KVSTORE_LAZY_RECOVER_RANK", -1, minimum=-1),
            snapshot_dir=read(env, "KVSTORE_LAZY_SNAPSHOT_DIR"),
            snapshot_interval=number(env, "KVSTORE_LAZY_SNAPSHOT_INTERVAL", 0.0, minimum=0.0),
            journal=boolean(env, "KVSTORE_LAZY_JOURNAL"),
            journal_fsync=boolean(env, "KVSTORE_LAZY_JOURNAL_FSYNC"),
            journal_max_bytes=integer(env, "KVSTORE_LAZY_JOURNAL_MAX_MB", 256, minimum=0) << 20,
            resume=resume,
            snapshot_deltas=integer(env, "KVSTORE_LAZY_SNAPSHOT_DELTAS", checkpoint.DEFAULT_MAX_DELTAS, minimum=0),
            metrics=metrics,
            status_file=read(env, "KVSTORE_LAZY_STATUS_FILE"),
            profile=read(env, "KVSTORE_LAZY_PROFILE"),
            restore_from=read(env, "KVSTORE_LAZY_RESTORE_FROM"),
            lazy_job=boolean(env, "KVSTORE_LAZY"),
        )
        if fields["restore_from"] and not fields["snapshot_dir"]:
            raise StartupError("KVSTORE_LAZY_RESTORE_FROM needs KVSTORE_LAZY_SNAPSHOT_DIR (where this job's own "
                               "snapshots go; the source directory is only read)")
        fields.update(_placement_from_env(env, fields["host"], fields["local"], fields["resend_timeout"]))
        if recovery == "auto" and not fields["resend"]:
            raise StartupError("KVSTORE_LAZY_RECOVERY=auto needs PS_RESEND=1 on every node (it is how workers "
                               "re-send what died with a server)")
        fields.update(_trust_from_env(env))
        fields["lifecycle"] = _lifecycle_from_env(env, fields["snapshot_dir"], fields["journal"], recovery)
        return cls(**fields)

def _lifecycle_from_env(env, snapshot_dir: str, journal: bool, recovery: str) -> LifecycleSettings:
    try:
        settings = LifecycleSettings.from_env(env, track_changes=bool(snapshot_dir))
    except ValueError as exc:
        raise StartupError(str(exc)) from None
    if (journal or recovery) and not snapshot_dir:
        raise StartupError("KVSTORE_LAZY_JOURNAL and KVSTORE_LAZY_RECOVERY need KVSTORE_LAZY_SNAPSHOT_DIR")
    if recovery and not journal:
        raise StartupError("KVSTORE_LAZY_RECOVERY needs KVSTORE_LAZY_JOURNAL=1 (the journal is what a restarted "
                           "server replays); restart the whole job from a snapshot instead")
    return settings


def _placement_from_env(env, host: str, local: bool, resend_timeout: float) -> dict[str, Any]:
    try:   # kvstore_lazy.node.placement: bind one address, advertise another (a DNS name on Kubernetes)
        bind = "" if local else lifecycle.bind_address(env, host)
        return {"bind": bind if lifecycle.BIND_ENV in env else "",
                "rejoin_window": lifecycle.rejoin_window(env, resend_timeout),
                "snapshot_scope": lifecycle.snapshot_scope(env)}
    except lifecycle.LifecycleError as exc:
        raise StartupError(str(exc)) from None


def _trust_from_env(env) -> dict[str, Any]:
    try:
        allow = trust.parse_allow(read(env, "KVSTORE_LAZY_ALLOW"))
    except trust.TrustError as exc:
        raise StartupError(str(exc)) from None
    return {"allow": allow, "check_address": boolean(env, "KVSTORE_LAZY_CHECK_ADDRESS", True),
            "scheduler_timeout": number(env, "KVSTORE_LAZY_SCHEDULER_TIMEOUT", 30.0, minimum=0.0),
            "queue_messages": integer(env, "KVSTORE_LAZY_PEER_QUEUE", QUEUE_MESSAGES, minimum=1),
            "queue_bytes": integer(env, "KVSTORE_LAZY_PEER_QUEUE_MB", QUEUE_BYTES >> 20, minimum=1) << 20}


_RECOVERY = {"0": "", "1": "rejoin", "rejoin": "rejoin", "register": "register", "auto": "auto"}


def _recovery_from_env(env) -> tuple[str, str]:
    """(KVSTORE_LAZY_RECOVERY, KVSTORE_LAZY_RESUME) as Config holds them: recovery "" (a fresh start), "rejoin",
    "register" or "auto"."""
    return _RECOVERY[choice(env, "KVSTORE_LAZY_RECOVERY")], choice(env, "KVSTORE_LAZY_RESUME")


def _rejoin_timestamp() -> int:
    """recovery.rejoin_timestamp at the wall clock now."""
    return recovery.rejoin_timestamp(time.time())


class ServerNode:
    """One kvstore_lazy server in a ps-lite job: the rooms of ``kvstore_lazy.node`` wired together. A test passes
    its own `van` (``transport.memory.MemoryVan``), `clock` (``clock.FakeClock``) and host facts (`resolve`,
    `local`: see ``guard``); `tune_gc` is the collector's setting for a server process (off in a test's)."""

    def __init__(self, config: Config, van: Van | None = None, clock: Clock | None = None,
                 resolve: Any = resolve, local: Any = local_addresses, tune_gc: bool = True) -> None:
        if config.recovery == recovery.AUTO:   # a pod restarted with the same environment: rejoin or register
            config = recovery.decide(config)
        self.config = cfg = config
        self.clock = clock if clock is not None else SystemClock()
        self.van: Van = van if van is not None else ZmqVan(local=cfg.local, water_mark=cfg.water_mark,
                                                           queue_messages=cfg.queue_messages,
                                                           queue_bytes=cfg.queue_bytes)
        self.tune_gc = tune_gc
        self.server: KVServer | None = None
        # Prometheus metrics (KVSTORE_LAZY_METRICS_PORT): fed by this loop, served by their own HTTP thread
        self.metrics = Exporter(*cfg.metrics) if cfg.metrics is not None else None
        self.delivery = Delivery(self.van.send, self.clock.monotonic, cfg.resend, cfg.resend_timeout)
        self.watch = SchedulerWatch(self.van, membership.SCHEDULER_ID, f"{cfg.root_uri}:{cfg.root_port}",
                                    cfg.scheduler_timeout)
        self.guard = Guard(cfg, self.watch.heard, self.clock.monotonic, resolve=resolve, local=local)
        self.node = Node(self.van, self.clock, self.delivery, self.guard.admit, keep_frames=cfg.journal,
                         malformed=self.metrics.malformed if self.metrics is not None else None)
        self.node.handler = self
        self.durability = Durability(cfg, self.clock, self.delivery, self.metrics)
        self.status = lifecycle.StatusFile(cfg.status_file or None)   # read by `kvstore-lazy ready` probes
        self.session = Session(cfg, self.node, self.guard, self.watch, self.durability, self.status,
                               self._open_server, self._start_timers)

    # ------------------------------------------------------------------------------------------------------------

    def run(self) -> int:
        try:
            try:
                if self.metrics is not None:
                    self.metrics.start()
                if self.config.recovery == recovery.REJOIN:
                    self.session.rejoin()
                else:
                    self.session.start()
            except (BindError, OSError, ValueError, checkpoint.SnapshotError) as exc:
                # a bind failure, a node list without us, an unreadable snapshot: one line for the operator
                log.debug("start failed", exc_info=True)
                raise StartupError(f"cannot start: {exc}") from exc
            self.serve()
            self.session.stop()
        except StartupError as exc:
            self.session.life.fail()
            log.error("%s", exc)
            return EXIT_STARTUP
        except SchedulerLost as exc:
            self.session.life.fail()
            log.error("%s; exiting", exc)
            return EXIT_SCHEDULER_LOST
        except DiskTierFailure as exc:     # a full or failing disk under the disk tier: stop, no snapshot
            self.session.life.fail()
            log.error("%s; stopping this server (no snapshot written: the last one stays good)", exc)
            return EXIT_DISK
        finally:
            self.durability.close()
            if self.metrics is not None:
                self.metrics.close()
            self.van.close()
        return EXIT_OK

    def _open_server(self, rank: int) -> None:
        cfg = self.config
        server = KVServer(rank, cfg.num_servers, cfg.num_workers, materialize=cfg.materialize, lifecycle=cfg.lifecycle,
                          lazy_job=cfg.lazy_job)
        server.lifecycle.defer = True      # a round end's budget pass after its replies: request
        self.server = server
        self.durability.attach(server, self.session.port)

    def _start_timers(self) -> None:
        """The node's timer table, in the order the entries run on a pass of the loop."""
        cfg, now, timers = self.config, self.clock.monotonic(), self.node.timers
        if cfg.snapshot_dir:
            timers.every("touch", lifecycle.TOUCH_EVERY, self._touch, first=0.0, wakes=False)   # last alive
        # heartbeats as PS_HEARTBEAT_INTERVAL asks, and at least 5 per KVSTORE_LAZY_SCHEDULER_TIMEOUT: the stock
        # scheduler answers each one (Van::ProcessHearbeat), which is how a hung scheduler is noticed
        every = [t for t in (cfg.heartbeat_interval, cfg.scheduler_timeout / 5) if t > 0]
        heartbeat_every = min(every) if every else 0.0
        if heartbeat_every > 0:
            timers.every("heartbeat", heartbeat_every, self.session.heartbeat, first=now + heartbeat_every)
        timers.every("scheduler", 0.0, self.watch.check, first=0.0, wakes=False)
        if cfg.resend:
            timers.every("resend", self.delivery.resend_period(), self.delivery.resend_due,
                         first=now + cfg.resend_timeout)
        timers.every("clock", CLOCK_EVERY, self.durability.clock_tick, first=0.0, wakes=False)
        if cfg.snapshot_dir and cfg.snapshot_interval > 0:
            timers.every("snapshot", cfg.snapshot_interval, self.durability.interval_passed,
                         first=now + cfg.snapshot_interval)
        timers.every("durability", 0.0, self.durability.upkeep, first=0.0, wakes=False)
        timers.every("stats", cfg.stats_interval, lambda now: self.log_stats("periodic"),
                     first=now + cfg.stats_interval)
        if self.metrics is not None:
            metrics = self.metrics
            timers.every("metrics", metrics.interval, lambda now: metrics.publish(self.server, self.van, now),
                         first=metrics.next_publish)

    def _touch(self, now: float) -> None:
        lifecycle.touch(membership_path(self.config.snapshot_dir, self.session.rank))

    # ------------------------------------------------------------------------------------------------------------
    # node.Handler: what the loop hands over

    def write_ahead(self, msg: Message) -> None:
        self.durability.write_ahead(msg)

    def control(self, msg: Message) -> None:
        self.session.control(msg)

    def request(self, msg: Message) -> None:
        server = self.server
        assert server is not None, "data before registration"
        started, bad = time.perf_counter(), server.bad_requests
        for recver, reply in self.durability.process(msg):
            self.delivery.reply(recver, reply)
        if server.lifecycle.due:
            # the round's replies go first, then its budget pass (a disk tier's demotions: tens of ms), which
            # the workers then do not wait for unless their next requests come sooner
            self.delivery.release()
            server.settle()
        if self.metrics is not None:
            self.metrics.request(msg.meta, time.perf_counter() - started, server.bad_requests - bad)

    def stopped(self) -> bool:
        return self.server is not None and self.server.stopped

    def pause(self) -> bool:
        return self.durability.snapshot_due

    # ------------------------------------------------------------------------------------------------------------

    def serve(self) -> None:
        assert self.server is not None
        if self.tune_gc:
            # Everything made before serving (modules, config, restored keys) is kept for the process's life: out
            # of the collector's sight, and young objects collected less often (a request allocates dozens, and
            # frees them by reference counting: its messages, arrays and lists hold no cycles); large messages'
            # buffers come from reused heap memory (_fix_malloc)
            gc.freeze()
            gc.set_threshold(*GC_THRESHOLD)
            _fix_malloc()
        self.node.serve()
        self.log_stats("at shutdown")
        if self.config.snapshot_dir:
            self.durability.save_snapshot(full=True)

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
