"""The server process: wires the ZeroMQ transport, the membership messages and the KVServer together.

Owns: the configuration read from the DMLC_* environment (as a stock server reads it), the one receive loop (one
thread owns every socket), timers (heartbeat, stats log), and the exact start/stop sequence stock workers and the
stock scheduler need:
ADD_NODE -> reconnect with identity -> BARRIER(7) -> serve -> kStopServer answered -> BARRIER(7) -> close.
"""
from __future__ import annotations

import fcntl
import logging
import os
import socket
import struct
import time
from dataclasses import dataclass

from . import membership
from .protocol import ProtocolError
from .protocol.message import Message, identity_of
from .protocol.pbmeta import ACK, ADD_NODE, HEARTBEAT, TERMINATE
from . import checkpoint
from .server.core import KVServer, node_name, restore_state, snapshot_state
from .transport.zmq_van import ZmqVan

log = logging.getLogger("kvstore_lazy")


class StartupError(RuntimeError):
    pass


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
    """DMLC_NODE_HOST, else the IPv4 of DMLC_INTERFACE, else the first non-loopback IPv4 (ps-lite GetAvailableInterfaceAndIP)."""
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
    water_mark: int = 0
    verbose: int = 0
    materialize: str = "touch"
    stats_interval: float = 60.0
    is_recovery: bool = False
    snapshot_dir: str = ""
    snapshot_interval: float = 0.0

    @classmethod
    def from_env(cls, env=None) -> "Config":
        env = os.environ if env is None else env
        role = env.get("DMLC_ROLE", "server")
        if role != "server":
            raise StartupError(f"DMLC_ROLE={role!r}: kvstore_lazy only runs the server role")
        root_uri = env.get("DMLC_PS_ROOT_URI", "")
        if not root_uri:
            raise StartupError("DMLC_PS_ROOT_URI is not set")
        return cls(
            root_uri=root_uri,
            root_port=_env_int(env, "DMLC_PS_ROOT_PORT"),
            num_workers=_env_int(env, "DMLC_NUM_WORKER"),
            num_servers=_env_int(env, "DMLC_NUM_SERVER"),
            host=default_host() if env is os.environ else (env.get("DMLC_NODE_HOST") or default_host()),
            port=_env_int(env, "PORT", 0),
            local=env.get("DMLC_LOCAL", "0") not in ("", "0"),
            heartbeat_interval=float(env.get("PS_HEARTBEAT_INTERVAL", "0") or 0),
            resend=env.get("PS_RESEND", "0") not in ("", "0"),
            water_mark=_env_int(env, "DMLC_PS_WATER_MARK", 0),
            verbose=_env_int(env, "PS_VERBOSE", 0),
            materialize=env.get("KVSTORE_LAZY_MATERIALIZE", "touch"),
            stats_interval=float(env.get("KVSTORE_LAZY_STATS_INTERVAL", "60") or 60),
            is_recovery=env.get("KVSTORE_LAZY_RECOVERY", "0") not in ("", "0"),
            snapshot_dir=env.get("KVSTORE_LAZY_SNAPSHOT_DIR", ""),
            snapshot_interval=float(env.get("KVSTORE_LAZY_SNAPSHOT_INTERVAL", "0") or 0),
        )


class ServerNode:
    """One kvstore_lazy server in a ps-lite job."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.van = ZmqVan(local=config.local, water_mark=config.water_mark)
        self.my_id: int | None = None
        self.port = 0
        self.server: KVServer | None = None
        self.timestamp = 0          # the van's own counter for control messages
        self._barrier_released = False
        self._seen_signatures: set[int] = set()
        self._next_heartbeat = float("inf")
        self._next_stats = float("inf")
        self._next_snapshot = float("inf")

    # ------------------------------------------------------------------------------------------------------------

    def run(self) -> int:
        try:
            self.start()
            self.serve()
            self.stop()
        finally:
            self.van.close()
        return 0

    def start(self, timeout: float = 600.0) -> None:
        cfg = self.config
        self.port = self.van.bind(cfg.host, cfg.port)
        log.info("listening on %s:%d; registering with the scheduler at %s:%d", cfg.host, self.port,
                 cfg.root_uri, cfg.root_port)
        # The first socket to the scheduler has no identity: that is how it recognises a new registration.
        self.van.connect(membership.SCHEDULER_ID, cfg.root_uri, cfg.root_port, identity=None)
        self._send_control(membership.SCHEDULER_ID,
                           membership.add_node_request(cfg.host, self.port, self._tick(), cfg.is_recovery))
        deadline = time.monotonic() + timeout
        reply = None
        while reply is None:
            if time.monotonic() > deadline:
                raise StartupError(f"no reply to ADD_NODE from the scheduler at {cfg.root_uri}:{cfg.root_port}")
            msg = self._recv(1000)
            if msg is not None and msg.meta.control.cmd == ADD_NODE:
                reply = msg
        self.my_id, peers = membership.find_self(reply.meta, cfg.host, self.port)
        rank = membership.id_to_rank(self.my_id)
        global _node_label
        _node_label = f"server {rank}"
        for peer in peers:
            self.van.connect(peer.node_id, peer.hostname, peer.port, identity=identity_of(self.my_id))
        self.server = KVServer(rank, cfg.num_servers, cfg.num_workers, materialize=cfg.materialize)
        log.info("registered as server rank %d (node %d) of %d servers, %d workers", rank, self.my_id,
                 cfg.num_servers, cfg.num_workers)
        if cfg.heartbeat_interval > 0:
            self._next_heartbeat = time.monotonic() + cfg.heartbeat_interval
        self._next_stats = time.monotonic() + cfg.stats_interval
        if cfg.snapshot_dir:
            self.load_snapshot()
            if cfg.snapshot_interval > 0:
                self._next_snapshot = time.monotonic() + cfg.snapshot_interval
        self.barrier(membership.ALL_GROUP)

    def serve(self) -> None:
        assert self.server is not None
        while not self.server.stopped:
            msg = self._recv(self._poll_timeout())
            if msg is not None:
                self._dispatch(msg)
            self._timers()
        self.log_stats("at shutdown")
        if self.config.snapshot_dir:
            self.save_snapshot()

    def save_snapshot(self) -> None:
        assert self.server is not None
        started = time.monotonic()
        meta, tables = snapshot_state(self.server)
        path = checkpoint.write_snapshot(self.config.snapshot_dir, self.server.rank, self.server.num_servers,
                                         tables, meta)
        rows = sum(len(t["row_ids"]) for k, t in tables.items() if t["meta"]["kind"] == "row_sparse")
        log.info("snapshot written to %s: %d keys, %d rows, %.3fs", path, len(tables), rows,
                 time.monotonic() - started)

    def load_snapshot(self) -> None:
        assert self.server is not None
        directory, rank = self.config.snapshot_dir, self.server.rank
        manifest = checkpoint.read_manifest(directory, rank)
        if manifest is None:
            log.info("no snapshot for rank %d in %s; starting empty", rank, directory)
            return
        if manifest.get("num_servers") != self.server.num_servers:
            raise StartupError(f"snapshot in {directory} was written by {manifest.get('num_servers')} servers, "
                               f"this job has {self.server.num_servers}; restore through a worker checkpoint")
        tables = {int(k): dict(checkpoint.read_snapshot_key(directory, rank, int(k), info), meta=info)
                  for k, info in manifest["keys"].items()}
        restore_state(self.server, manifest.get("server", {}), tables)
        log.info("restored snapshot of rank %d from %s: %d keys", rank, directory, len(tables))

    def stop(self) -> None:
        # Without this final group-7 barrier every worker and the scheduler hang after training.
        self.barrier(membership.ALL_GROUP)
        log.info("stopped")

    def barrier(self, group: int) -> None:
        self._barrier_released = False
        self._send_control(membership.SCHEDULER_ID, membership.barrier_request(group, self._tick()))
        while not self._barrier_released:
            msg = self._recv(self._poll_timeout())
            if msg is not None:
                self._dispatch(msg)
            self._timers()

    # ------------------------------------------------------------------------------------------------------------

    def _tick(self) -> int:
        ts = self.timestamp
        self.timestamp += 1
        return ts

    def _poll_timeout(self) -> int:
        nearest = min(self._next_heartbeat, self._next_stats, self._next_snapshot)
        return max(0, min(1000, int((nearest - time.monotonic()) * 1000)))

    def _timers(self) -> None:
        now = time.monotonic()
        if now >= self._next_heartbeat and self.my_id is not None:
            self._send_control(membership.SCHEDULER_ID,
                               membership.heartbeat(self.my_id, self.config.host, self.port, self._tick()))
            self._next_heartbeat = now + self.config.heartbeat_interval
        if self.server is not None and (self.server.snapshot_requested or now >= self._next_snapshot) \
                and self.config.snapshot_dir:
            self.server.snapshot_requested = False
            self.save_snapshot()
            if self.config.snapshot_interval > 0:
                self._next_snapshot = now + self.config.snapshot_interval
        if now >= self._next_stats:
            self.log_stats("periodic")
            self._next_stats = now + self.config.stats_interval

    def log_stats(self, when: str) -> None:
        if self.server is None:
            return
        for key, s in self.server.stats()["sparse"].items():
            log.info("stats (%s): key %s rows %d bytes %d", when, key, s["rows"], s["bytes"])
        log.info("stats (%s): received %d bytes, sent %d bytes", when, self.van.bytes_received, self.van.bytes_sent)

    def _send_control(self, node_id: int, msg: Message) -> None:
        self.van.send(node_id, msg)

    def _recv(self, timeout_ms: int) -> Message | None:
        frames = self.van.recv(timeout_ms)
        if frames is None:
            return None
        try:
            msg = Message.from_frames(frames)
        except ProtocolError as exc:
            log.error("dropping a malformed message from identity %r: %s", bytes(frames[0])[:16], exc)
            return None
        if self.config.verbose >= 2:
            log.info("recv from %s: %s (%d data frames)", node_name(msg.sender), msg.meta, len(msg.data))
        return msg

    def _dispatch(self, msg: Message) -> None:
        cmd = msg.meta.control.cmd
        if self.config.resend and self.my_id is not None and cmd not in (ACK, TERMINATE):
            signature = membership.message_signature(msg.meta, msg.sender, self.my_id)
            self.van.send(msg.sender, membership.ack(signature))
            if signature in self._seen_signatures:
                return  # a resent duplicate: ACKed again, not processed again
            self._seen_signatures.add(signature)
        if cmd != 0:
            self._control(msg)
            return
        assert self.server is not None, "data before registration"
        for recver, reply in self.server.handle(msg):
            self.van.send(recver, reply)

    def _control(self, msg: Message) -> None:
        cmd = msg.meta.control.cmd
        if membership.is_barrier_release(msg.meta):
            self._barrier_released = True
        elif cmd == ADD_NODE and self.my_id is not None:
            # The scheduler announces a recovered node: reconnect to it under its (reused) id.
            for peer in membership.peers_update(msg.meta, self.my_id):
                if peer.node_id != self.my_id and peer.node_id != membership.SCHEDULER_ID:
                    self.van.connect(peer.node_id, peer.hostname, peer.port, identity=identity_of(self.my_id))
                    log.info("reconnected to %s at %s:%d", node_name(peer.node_id), peer.hostname, peer.port)
        elif cmd in (HEARTBEAT, ACK, TERMINATE):
            pass
