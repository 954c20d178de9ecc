"""Where a server is and what it may take over, across restarts and pod re-creations (Kubernetes and elsewhere).

Owns four decisions, each a pure function of the environment and the files in the snapshot directory:

- **Bind vs advertise.** ps-lite servers bind the host they advertise (``DMLC_NODE_HOST``), and ZeroMQ can only bind
  an IP address or an interface, never a DNS name (libzmq resolves bind addresses with DNS off). On Kubernetes a
  server wants to *advertise* a stable name (``<pod>.<headless service>``) that survives the pod being re-created
  with a new IP, and to *bind* all interfaces: ``KVSTORE_LAZY_BIND`` is that bind address (see :func:`bind_address`).
- **Readiness.** The server writes ``KVSTORE_LAZY_STATUS_FILE`` (JSON: phase, pid, process start time, rank) as it
  goes ``starting`` -> ``serving`` -> ``stopping``; ``python -m kvstore_lazy.server --ready`` (a Kubernetes exec
  readiness probe) exits 0 only while that process is alive and serving (:func:`check_ready`).
- **Rejoin or register** (``KVSTORE_LAZY_RECOVERY=auto``): a container or pod that starts with the same environment
  every time must tell "my previous process died mid-job" (rejoin it) from "a new job" (register). The membership
  record ``node.rank<r>.json`` of the previous process, matched by the advertised host and port, answers it: rejoin
  if it was not ``finished`` and was alive within the rejoin window; past the window the stock workers have given
  up (ps-lite's Resender aborts a node after 10 unanswered resends, i.e. ~10 x PS_RESEND_TIMEOUT after the first
  message the dead server did not ACK), so rejoining is pointless (:func:`rejoin_decision`).
- **Whose snapshot.** The scheduler gives ranks by sorting the registered nodes by host (descending) and port
  (ascending), not by pod ordinal (ps-lite van.cc ProcessAddNodeCommandAtScheduler). A snapshot directory on a
  volume of one server (a StatefulSet's volumeClaimTemplates) holds the ranks *that* server had; if the sort now
  gives it another rank, loading by rank would start it empty, or load a stale or foreign shard. Snapshots record
  their writer (advertised host and port); in a directory declared a server's own (KVSTORE_LAZY_SNAPSHOT_SCOPE=
  server) :func:`check_snapshot_owner` refuses one that is not this server's. In a directory all servers of the job
  share (the default) a rank may legitimately move between hosts, and rank<r>/ is rank r's wherever it came from.
- **Where the workers dial after a rejoin.** Peers reach a server advertised by name at ``tcp://name:port``, and
  ZeroMQ re-resolves the name on every reconnect; but a reconnect stuck on the *old* address of a deleted pod (a SYN
  nobody answers: ARP fails on the same node, some CNIs drop silently) is only given up after the kernel's timeouts,
  3 s to ~2 min, while the workers' resend budget runs. A server that rejoins under a DNS name therefore sends each
  worker a ps-lite ADD_NODE with its node at its current IP (``membership.address_update``): a stock worker closes
  its socket to that node and dials the new address at once, as it does for a node ps-lite itself recovered.

Does not own: sockets, messages or the snapshot format itself (``runtime``, ``checkpoint``). Imports nothing of the
project, and neither numpy nor zmq (the readiness probe must start fast).
"""
from __future__ import annotations

import ipaddress
import json
import os
import socket
import time
from pathlib import Path

from kvstore_lazy import config

STATUS_ENV = "KVSTORE_LAZY_STATUS_FILE"
BIND_ENV = "KVSTORE_LAZY_BIND"
ALL_INTERFACES = "0.0.0.0"
RESEND_ABORT_TRIES = 10          # ps-lite resender.h: CHECK_LT(num_retry, max_num_retry_ = 10)
TOUCH_EVERY = 1.0                # s between refreshes of a live server's membership record (its "alive" time)


class LifecycleError(ValueError):
    """A setting or an on-disk record that would make this server bind, rejoin or load the wrong thing."""


# ----------------------------------------------------------------------------------------------------------------
# bind vs advertise


def is_ip_address(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def bind_address(env, advertised: str) -> str:
    """The address the server's ROUTER binds: ``KVSTORE_LAZY_BIND`` if set (empty, ``*`` or ``0.0.0.0``: every
    interface; else an IP address or an interface name of this host), otherwise the advertised host itself, as a
    stock ps-lite server does. An advertised DNS name cannot be bound, so it needs KVSTORE_LAZY_BIND."""
    value = env.get(BIND_ENV)
    if value is None:
        if not advertised or is_ip_address(advertised):
            return advertised
        raise LifecycleError(
            f"DMLC_NODE_HOST={advertised!r} is a DNS name, which ZeroMQ cannot bind. Set {BIND_ENV}=0.0.0.0 to "
            f"bind every interface (or one of this host's addresses) and keep advertising the name; peers reach "
            f"this server by the name, re-resolved on every reconnect")
    value = value.strip()
    if value in ("", "*", ALL_INTERFACES):
        return ALL_INTERFACES
    if is_ip_address(value) or value in {name for _, name in socket.if_nameindex()}:
        return value
    raise LifecycleError(f"{BIND_ENV}={value!r} is neither an IP address nor a network interface of this host "
                         f"(use 0.0.0.0 for every interface)")


def routed_address(target: str, port: int) -> str | None:
    """This host's IPv4 address on the route to `target` (a UDP connect sends nothing), or None."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((target, port))
            return s.getsockname()[0]
    except OSError:
        return None


# ----------------------------------------------------------------------------------------------------------------
# status file and the readiness probe


def _start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (/proc/<pid>/stat field 22): with the pid, it tells this
    process from a later one that got the same pid (a restarted container numbers its processes from 1 again)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])


class StatusFile:
    """What this server process is doing, for probes: rewritten atomically at each phase change."""

    def __init__(self, path: str | None) -> None:
        self.path = Path(path) if path else None
        self.pid = os.getpid()
        self.started = _start_time(self.pid)

    @classmethod
    def from_env(cls, env=None) -> "StatusFile":
        env = os.environ if env is None else env
        return cls(config.read(env, STATUS_ENV) or None)

    def write(self, phase: str, **info) -> None:
        if self.path is None:
            return
        record = dict(phase=phase, pid=self.pid, start_time=self.started, time=time.time(), **info)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{self.path.name}.{self.pid}.tmp")
        tmp.write_text(json.dumps(record))
        os.replace(tmp, self.path)


def check_ready(path: str | None) -> tuple[bool, str]:
    """(ready, why): ready while the process that wrote `path` is alive and serving."""
    if not path:
        return False, f"{STATUS_ENV} is not set: the server writes no status file to probe"
    try:
        record = json.loads(Path(path).read_text())
    except FileNotFoundError:
        return False, f"{path} does not exist yet (the server has not started)"
    except (OSError, json.JSONDecodeError) as exc:
        return False, f"{path}: unreadable ({exc})"
    pid = record.get("pid")
    if not isinstance(pid, int) or _start_time(pid) is None or _start_time(pid) != record.get("start_time"):
        return False, f"{path} was written by process {pid}, which is no longer running"
    if record.get("phase") != "serving":
        return False, f"server process {pid} is {record.get('phase')}, not serving yet"
    return True, (f"server rank {record.get('rank')} (node {record.get('node_id')}) serving as "
                  f"{record.get('host')}:{record.get('port')}, pid {pid}")


# ----------------------------------------------------------------------------------------------------------------
# rejoin or register


def rejoin_window(env, resend_timeout: float) -> float:
    """Seconds a dead server's job keeps waiting for it: KVSTORE_LAZY_REJOIN_WINDOW, else 10 x PS_RESEND_TIMEOUT."""
    try:
        return config.number(env, "KVSTORE_LAZY_REJOIN_WINDOW", RESEND_ABORT_TRIES * resend_timeout, minimum=0.0)
    except config.ConfigError as exc:
        raise LifecycleError(str(exc)) from None


def rejoin_decision(record: dict | None, record_path: Path | None, window: float,
                    now: float | None = None) -> tuple[bool, str]:
    """KVSTORE_LAZY_RECOVERY=auto: (rejoin?, why) from the previous process's membership record (None: none)."""
    if record is None or record_path is None:
        return False, "no membership record of this host and port: a new server of the job; registering"
    if record.get("state") == "finished":
        return False, (f"{record_path}: the previous server passed its job's final barrier; a new job, "
                       f"registering")
    try:
        age = (time.time() if now is None else now) - record_path.stat().st_mtime
    except FileNotFoundError:
        return False, f"{record_path} vanished; registering"
    if age > window:
        return False, (f"{record_path}: the previous server (rank {record.get('rank')}) was last alive {age:.0f}s "
                       f"ago, past the {window:.0f}s its job's workers wait (10 x PS_RESEND_TIMEOUT or "
                       f"KVSTORE_LAZY_REJOIN_WINDOW); registering as a new server")
    return True, (f"{record_path}: the previous server (rank {record.get('rank')}) died {age:.1f}s ago, within "
                  f"the {window:.0f}s rejoin window; rejoining its job")


def touch(path: Path) -> None:
    """Mark a live server's record as fresh (its mtime is the server's last-alive time)."""
    try:
        os.utime(path)
    except FileNotFoundError:
        pass


# ----------------------------------------------------------------------------------------------------------------
# whose snapshot


def writer_of(host: str, port: int) -> dict:
    return {"host": host, "port": int(port)}


def _snapshot_ranks(directory: Path) -> dict[int, dict]:
    """rank -> manifest of every rank<r>/ snapshot in `directory`."""
    found = {}
    for path in directory.glob("rank*/manifest.json"):
        suffix = path.parent.name[len("rank"):]
        if not suffix.isdigit():
            continue
        try:
            found[int(suffix)] = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
    return found


SCOPE_ENV = "KVSTORE_LAZY_SNAPSHOT_SCOPE"


def snapshot_scope(env) -> str:
    """``job`` (default): every server of the job writes to this directory, a rank's snapshot is right whichever host
    wrote it. ``server``: the directory is this server's own volume (a StatefulSet's volumeClaimTemplates)."""
    try:
        return config.choice(env, SCOPE_ENV)
    except config.ConfigError as exc:
        raise LifecycleError(str(exc)) from None


def check_snapshot_owner(directory: str | os.PathLike, rank: int, host: str, port: int, scope: str) -> None:
    """Raise LifecycleError if this server (advertised `host`:`port`, now rank `rank`) must not load
    `directory`/rank<rank>. In a ``server``-scoped directory (this server's own volume) every snapshot must be its
    own: one another server wrote means the volume moved or this server's name or port changed, and a directory
    that holds only other ranks means the scheduler's sort gave this server a new rank. Snapshots written before
    writers were recorded pass."""
    if scope != "server":
        return
    directory = Path(directory)
    ranks = _snapshot_ranks(directory)
    hint = ("The scheduler assigns ranks by sorting host and port (not by pod ordinal): restart this server with "
            "the DMLC_NODE_HOST and PORT it had, put every server's snapshots in one shared directory "
            f"({SCOPE_ENV}=job), or set KVSTORE_LAZY_RESUME=none to start it empty")
    mine = ranks.get(rank)
    if mine is None:
        if ranks:
            held = ", ".join(f"rank {r} (written by {_who(m.get('writer'))})" for r, m in sorted(ranks.items()))
            raise LifecycleError(
                f"the scheduler made {host}:{port} server rank {rank}, but its own volume {directory} holds the "
                f"snapshot of {held} and none of rank {rank}: loading by rank would start this server empty and "
                f"lose that state. {hint}")
        return
    writer = mine.get("writer")
    if writer is None or (writer.get("host"), writer.get("port")) == (host, int(port)):
        return
    raise LifecycleError(
        f"{directory / f'rank{rank}'} was written by {_who(writer)}, not by this server ({host}:{port}, now rank "
        f"{rank}), and {directory} is this server's own volume ({SCOPE_ENV}=server). {hint}")


def _who(writer: dict | None) -> str:
    return "an unrecorded server" if not writer else f"{writer.get('host')}:{writer.get('port')}"
