"""Launch a distributed MXNet job: the stock scheduler, kvstore_lazy (or stock) servers, and the user's command as
workers. Options follow MXNet's tools/launch.py (-n, -s, --launcher local|ssh, -H hostfile, --env), on Python 3.11.

Owns: where each node runs (on this machine, in a network namespace, or over ssh), the DMLC_* environment each one
gets, and process supervision. Every process the launcher starts is in its own process group (and, where
``setpriv`` exists, dies with the launcher); it is ended by PID when the job ends: on success, on Ctrl-C or SIGTERM,
on a deadline, or as soon as any node fails (stock ps-lite would leave every other node hanging silently). Each
node's output is streamed with a prefix, and the launcher's own lines ("[launch +3.21s] ...") say what happened and
when.

Names and ranks. The launcher names nodes by start order ("worker 1": the second worker started, DMLC_TASK_ID=1),
but ps-lite's scheduler numbers them by address: it sorts the nodes by hostname (descending, bytewise) and port
(ascending) and gives ranks in that order, servers and workers separately (van.cc, ProcessAddNodeCommandAtScheduler;
the comparator ``(a.hostname.compare(b.hostname) | (a.port < b.port)) > 0``). So once a node's rank is known its
prefix carries both, "[worker 1, rank 0] ...", as do the launcher's lines about it. A kvstore_lazy server's rank
comes from its "registered as server rank N" line; on this machine and in network namespaces every node's rank is
also computed from the listening port of each node's process (/proc) once all nodes of a role have bound theirs.
Over ssh a stock server's or a worker's rank stays unknown (its prefix is then its start-order name only).

Failure detection: a node that exits (killed, crashed, non-zero status) is noticed within POLL seconds; the job then
ends with a line naming it, and every other process gets SIGTERM, then SIGKILL after --grace seconds. So a dead
node ends the job within POLL + grace (0.05 s + 5 s by default; measured ~0.15 s, as nodes die on SIGTERM). A node
that dies of SIGABRT (how MXNet/ps-lite CHECK failures end) is judged up to ABORT_JUDGE_WAIT (5 s) later: if by then
the scheduler or a server has exited 0, the final barrier was passed and the abort is a known ps-lite teardown race
under PS_RESEND (a warning, the job succeeded). Over ssh the local ssh client is what is watched: it exits when the
remote process does (ServerAliveInterval bounds a silent host to ~15 s). A node that hangs without dying is only
caught by --timeout (status 124).

Server recovery (--restart-servers N): a kvstore_lazy server that dies is restarted with KVSTORE_LAZY_RECOVERY=1 at
the same host and port; it rejoins the job from its snapshot and journal (see kvstore_lazy.node.runtime). This needs
--snapshot-dir, and turns on the journal for servers and PS_RESEND for every node.

Run: ``python -m kvstore_lazy.launch -n 2 -s 2 python train.py``.
"""
from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import signal
import random
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from kvstore_lazy.config import c_atoi

STOCK_NODE = [sys.executable, "-c", "import mxnet"]
LAZY_SERVER = [sys.executable, "-m", "kvstore_lazy.server"]
POLL = 0.05
ABORT_JUDGE_WAIT = 5.0          # s to wait, after a node aborts, for signs that the job had already finished
DEFAULT_PORT = 9091             # the scheduler's port where the launcher cannot probe for a free one
DEFAULT_SERVER_PORT_BASE = 9200
RESEND_TIMEOUT_MS = "3000"      # PS_RESEND_TIMEOUT with --restart-servers: ps-lite aborts after 10 tries = 30 s
# what MXNet's ssh launcher passes from the launching machine, plus the prefixes whose variables configure ps-lite,
# MXNet and kvstore_lazy
PASS_ENV = ["OMP_NUM_THREADS", "KMP_AFFINITY", "LD_LIBRARY_PATH", "DMLC_INTERFACE"]
PASS_PREFIXES = ("PS_", "MXNET_", "KVSTORE_LAZY_")
SSH_OPTIONS = ["-o", "StrictHostKeyChecking=no", "-o", "BatchMode=yes", "-o", "ServerAliveInterval=5",
               "-o", "ServerAliveCountMax=3", "-tt"]



def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


_PORTS = random.Random()


def free_port(host: str = "127.0.0.1") -> int:
    """A free port on `host` below the kernel's ephemeral range. A port the kernel hands out (bind to 0) is closed
    again before the node binds it, and in that gap any outgoing connection on the machine (a ZeroMQ connect of
    another job) may take it as its source port: the node's bind fails. Outgoing connections never take these."""
    high = min(_ephemeral_low(), 65536)
    for _ in range(200):
        port = _PORTS.randrange(max(1024, high - 12000), high)
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port on {host} in [{max(1024, high - 12000)}, {high})")


def outbound_ip(target: str) -> str:
    """This machine's address on the route to `target` (the UDP-connect trick dmlc's tracker uses)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((target, 9))
            return s.getsockname()[0]
        except OSError:
            return socket.gethostbyname(socket.gethostname())


# ----------------------------------------------------------------------------------------------------------------
# where a node runs


@dataclass
class Placement:
    """A node on this machine: `host` is the address it binds and advertises."""

    host: str = "127.0.0.1"

    @property
    def where(self) -> str:
        return self.host

    def command(self, argv: list[str], node_env: dict) -> tuple[list[str], dict]:
        """(argv, environment) to start locally for a node that should run `argv` with `node_env` set."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("DMLC_")}
        env.update(node_env)
        return list(argv), env


@dataclass
class NetnsPlacement(Placement):
    """A node inside network namespace `namespace` (``ip netns exec``), at that namespace's address."""

    namespace: str = ""

    @property
    def where(self) -> str:
        return f"{self.host} in netns {self.namespace}"

    def command(self, argv, node_env):
        argv, env = super().command(argv, node_env)
        return ["ip", "netns", "exec", self.namespace] + argv, env


@dataclass
class SshPlacement(Placement):
    """A node on another machine, started with ``ssh host 'cd DIR && exec env VAR=... COMMAND'``."""

    ssh_port: str = "22"
    ssh_command: list[str] = field(default_factory=lambda: ["ssh"])
    workdir: str = ""

    @property
    def where(self) -> str:
        return f"{self.host} via ssh"

    def remote_command(self, argv: list[str], node_env: dict) -> str:
        exports = dict(_passed_env())
        exports.update(node_env)
        parts = []
        if self.workdir:
            parts.append(f"cd {shlex.quote(self.workdir)} &&")
        parts.append("exec env")
        parts += [f"{name}={shlex.quote(str(value))}" for name, value in exports.items()]
        parts.append(shlex.join(argv))
        return " ".join(parts)

    def command(self, argv, node_env):
        env = dict(os.environ)
        ssh = list(self.ssh_command) + SSH_OPTIONS + ["-p", str(self.ssh_port), self.host,
                                                      self.remote_command(argv, node_env)]
        return ssh, env


def _passed_env() -> dict:
    env = {k: os.environ[k] for k in PASS_ENV if k in os.environ}
    env.update({k: v for k, v in os.environ.items() if k.startswith(PASS_PREFIXES)})
    return env


class LocalPlacer:
    kind = "local"

    def __init__(self, host: str = "127.0.0.1") -> None:
        self.host = host

    def scheduler(self) -> Placement:
        return Placement(self.host)

    def server(self, rank: int) -> Placement:
        return Placement(self.host)

    def worker(self, rank: int) -> Placement:
        return Placement(self.host)

    def scheduler_port(self) -> int:
        return free_port(self.host)

    def server_port(self, rank: int, base: int | None) -> int:
        return base + rank if base else free_port(self.host)


def namespace_address(namespace: str) -> str:
    """The first global IPv4 address inside `namespace`."""
    out = subprocess.run(["ip", "-n", namespace, "-4", "-o", "addr", "show", "scope", "global"],
                         capture_output=True, text=True, timeout=30)
    if out.returncode != 0:
        raise LaunchError(f"network namespace {namespace!r}: {out.stderr.strip() or 'ip failed'}")
    for line in out.stdout.splitlines():
        words = line.split()
        if "inet" in words:
            return words[words.index("inet") + 1].split("/")[0]
    raise LaunchError(f"network namespace {namespace!r} has no global IPv4 address")


def parse_netns_map(text: str) -> dict[str, str]:
    """``scheduler=NS,server=NS,server1=NS,worker=NS,worker0=NS``: a role's namespace, or one rank's (which wins).
    Each entry may give the address too: ``worker0=NS@10.1.2.3`` (else it is read from the namespace)."""
    mapping = {}
    for item in text.replace(";", ",").split(","):
        item = item.strip()
        if not item:
            continue
        name, sep, namespace = item.partition("=")
        name = name.strip()
        role = name.rstrip("0123456789")
        if not sep or not namespace.strip() or role not in ("scheduler", "server", "worker") \
                or (role == "scheduler" and name != "scheduler"):
            raise LaunchError(f"--netns-map entry {item!r}: expected scheduler=NS, server[RANK]=NS or "
                              f"worker[RANK]=NS (optionally NS@ADDRESS)")
        mapping[name] = namespace.strip()
    return mapping


class NetnsPlacer:
    """Nodes in network namespaces on this machine (tests: scripts/netns_cluster.sh makes them)."""

    kind = "netns"

    def __init__(self, mapping: dict[str, str], port: int = DEFAULT_PORT) -> None:
        self.mapping = dict(mapping)
        self.port = port
        self._addresses: dict[str, str] = {}

    def _placement(self, role: str, rank: int | None) -> NetnsPlacement:
        key = role if rank is None else f"{role}{rank}"
        spec = self.mapping.get(key) or self.mapping.get(role)
        if spec is None:
            raise LaunchError(f"--netns-map names no namespace for {key} (give {key}=NS or {role}=NS)")
        namespace, _, address = spec.partition("@")
        if not address:
            if namespace not in self._addresses:
                self._addresses[namespace] = namespace_address(namespace)
            address = self._addresses[namespace]
        return NetnsPlacement(address, namespace=namespace)

    def scheduler(self):
        return self._placement("scheduler", None)

    def server(self, rank):
        return self._placement("server", rank)

    def worker(self, rank):
        return self._placement("worker", rank)

    def scheduler_port(self) -> int:
        return self.port

    def server_port(self, rank: int, base: int | None) -> int:
        return (base or DEFAULT_SERVER_PORT_BASE) + rank


def parse_hostfile(text: str) -> list[tuple[str, str]]:
    """MXNet/dmlc hostfile: one host per line, ``host``, ``host:sshport`` or ``host slots=N``; blank lines and
    ``#`` comments are skipped. Returns (host, ssh port) pairs."""
    hosts = []
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        i = line.find("slots=")
        if i != -1:
            line = line[:i].strip()
        host, sep, port = line.partition(":")
        if sep and not port.isdigit():
            raise LaunchError(f"hostfile line {line!r}: the ssh port must be a number")
        hosts.append((host, port if sep else "22"))
    if not hosts:
        raise LaunchError("the hostfile lists no hosts")
    return hosts


class SshPlacer:
    """MXNet's ssh launcher placement: servers on hosts[0], hosts[1], ..., then the workers continue round-robin
    (node i of nserver+nworker runs on hosts[i % len(hosts)]). The scheduler runs on this machine (reachable at
    `scheduler_host`), or over ssh on `remote_scheduler`."""

    kind = "ssh"

    def __init__(self, hosts: list[tuple[str, str]], num_servers: int, ssh_command: list[str] | None = None,
                 workdir: str = "", scheduler_host: str | None = None, remote_scheduler: str | None = None,
                 port: int | None = None) -> None:
        self.hosts = hosts
        self.num_servers = num_servers
        self.ssh_command = ssh_command or ["ssh"]
        self.workdir = workdir or os.getcwd()
        self.remote_scheduler = remote_scheduler
        self.scheduler_host = remote_scheduler or scheduler_host or outbound_ip(hosts[0][0])
        self.port = port

    def _ssh(self, host: str, ssh_port: str) -> SshPlacement:
        return SshPlacement(host, ssh_port=ssh_port, ssh_command=self.ssh_command, workdir=self.workdir)

    def scheduler(self):
        if self.remote_scheduler:
            ports = dict(self.hosts)
            return self._ssh(self.remote_scheduler, ports.get(self.remote_scheduler, "22"))
        return Placement(self.scheduler_host)

    def server(self, rank):
        return self._ssh(*self.hosts[rank % len(self.hosts)])

    def worker(self, rank):
        return self._ssh(*self.hosts[(self.num_servers + rank) % len(self.hosts)])

    def scheduler_port(self) -> int:
        if self.port:
            return self.port
        return DEFAULT_PORT if self.remote_scheduler else free_port(self.scheduler_host)

    def server_port(self, rank: int, base: int | None) -> int:
        return (base or DEFAULT_SERVER_PORT_BASE) + rank

    def sync_commands(self, local_dir: str, remote_dir: str) -> list[list[str]]:
        """rsync of `local_dir` to every host (MXNet's --sync-dst-dir), one command per distinct host."""
        rsh = shlex.join(list(self.ssh_command) + ["-o", "StrictHostKeyChecking=no", "-o", "BatchMode=yes"])
        out, seen = [], set()
        for host, port in self.hosts:
            if (host, port) in seen:
                continue
            seen.add((host, port))
            out.append(["rsync", "-az", "--rsh", f"{rsh} -p {port}", local_dir.rstrip("/") + "/",
                        f"{host}:{remote_dir}"])
        return out


# ----------------------------------------------------------------------------------------------------------------
# the job


class LaunchError(RuntimeError):
    pass


@dataclass
class Node:
    role: str
    rank: int
    popen: subprocess.Popen
    placement: Placement
    argv: list[str]
    env: dict
    thread: threading.Thread | None = None
    started: float = 0.0
    restarts: int = 0
    ended: float | None = None
    incarnation: int = 0
    ps_rank: int | None = None    # the rank ps-lite's scheduler gives it, once known (see the module docstring)

    @property
    def name(self) -> str:
        """Start order: "worker 1" is the second worker started (DMLC_TASK_ID=1)."""
        return self.role if self.role == "scheduler" else f"{self.role} {self.rank}"

    @property
    def label(self) -> str:
        """The prefix of its output lines: the name, and ps-lite's rank once known."""
        return self.name if self.ps_rank is None else f"{self.name}, rank {self.ps_rank}"

    @property
    def pid(self) -> int:
        return self.popen.pid


REGISTERED = re.compile(r"registered as server rank (\d+)")   # kvstore_lazy.node.runtime's line once it has its rank
SERVER_PREFIX = r"\[server (\d+)(?:, rank \d+)?\]"             # a server's output prefix; group 1: its start index


def pslite_rank_order(addresses: list[tuple[str, int]]) -> list[int]:
    """Ranks ps-lite's scheduler gives nodes of one role at these (hostname, port): it sorts by
    ``(a.hostname.compare(b.hostname) | (a.port < b.port)) > 0``, i.e. hostname descending (bytewise), then port
    ascending (a negative compare() stays negative when or-ed with the bool)."""
    order = sorted(range(len(addresses)), key=lambda i: addresses[i][1])
    order.sort(key=lambda i: addresses[i][0].encode(), reverse=True)   # stable: ports stay ascending
    ranks = [0] * len(addresses)
    for rank, i in enumerate(order):
        ranks[i] = rank
    return ranks


def listening_ports(pid: int) -> set[int] | None:
    """TCP ports in LISTEN state held by process `pid` or its descendants (read from /proc, in the process's own
    network namespace); None if the process is gone or /proc cannot be read."""
    pids, ports = [pid], set()
    try:
        while pids:
            current = pids.pop()
            inodes = set()
            for fd in os.listdir(f"/proc/{current}/fd"):
                try:
                    link = os.readlink(f"/proc/{current}/fd/{fd}")
                except OSError:
                    continue
                if link.startswith("socket:["):
                    inodes.add(link[8:-1])
            for table in ("tcp", "tcp6"):
                with open(f"/proc/{current}/net/{table}") as fh:
                    for line in fh.readlines()[1:]:
                        fields = line.split()
                        if len(fields) > 9 and fields[3] == "0A" and fields[9] in inodes:
                            ports.add(int(fields[1].rsplit(":", 1)[1], 16))
            for task in os.listdir(f"/proc/{current}/task"):
                with open(f"/proc/{current}/task/{task}/children") as fh:
                    pids += [int(child) for child in fh.read().split()]
    except (OSError, ValueError):
        return None
    return ports


def describe_status(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"


class LineSink:
    """Base for a Job's ``out`` that wants whole lines: subclasses implement :meth:`on_line`. Thread-safe (every
    node's reader thread writes to it); text without a newline waits for the rest of its line, or for close()."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.buffer = ""

    def write(self, text: str) -> None:
        with self.lock:
            self.buffer += text
            while "\n" in self.buffer:
                line, self.buffer = self.buffer.split("\n", 1)
                self.on_line(line)

    def flush(self) -> None:
        pass

    def close(self) -> None:
        with self.lock:
            if self.buffer:
                self.on_line(self.buffer)
                self.buffer = ""

    def on_line(self, line: str) -> None:
        raise NotImplementedError


class Job:
    """Scheduler, servers and workers of one ps-lite job, wherever `placer` puts them (this machine by default).

    Servers are started first, then workers, as MXNet's launcher does; the scheduler before both. `restart_servers`
    allows that many restarts per server (kvstore_lazy servers only; they need a snapshot dir, see the module
    docstring). `events` records (monotonic time, what, node name, detail) for what the launcher saw and did."""

    def __init__(self, command: list[str], num_workers: int, num_servers: int, server: str = "lazy",
                 host: str = "127.0.0.1", env: dict | None = None, server_env: dict | None = None,
                 worker_env: dict | None = None, out=sys.stdout, placer=None, port: int | None = None,
                 server_command: list[str] | None = None, scheduler_command: list[str] | None = None,
                 restart_servers: int = 0, server_port_base: int | None = None, grace: float = 5.0,
                 finish_grace: float = 30.0) -> None:
        self.command = list(command)
        self.num_workers = num_workers
        self.num_servers = num_servers
        self.server = server
        self.host = host
        self.env = dict(env or {})
        self.server_env = dict(server_env or {})
        self.worker_env = dict(worker_env or {})
        self.out = out
        self.placer = placer or LocalPlacer(host)
        self.port = port
        self.server_command = list(server_command) if server_command else \
            (LAZY_SERVER if server == "lazy" else STOCK_NODE)
        self.scheduler_command = list(scheduler_command) if scheduler_command else STOCK_NODE
        self.restart_servers = restart_servers
        self.server_port_base = server_port_base
        self.grace = grace
        self.finish_grace = finish_grace
        self.nodes: list[Node] = []       # the current process of each node
        self.history: list[Node] = []     # every process started (restarted servers included)
        self.events: list[tuple[float, str, str, str]] = []
        self.t0 = time.monotonic()
        self._lock = threading.Lock()
        self._rank_lock = threading.Lock()
        self._rank_scan = 0.0                 # when _learn_ranks last looked at the nodes' ports
        self._ranks_unknowable: set[str] = set()
        self._fixed_server_ports = restart_servers > 0 or server_port_base is not None
        if restart_servers and server != "lazy":
            raise LaunchError("--restart-servers needs kvstore_lazy servers (a stock server cannot rejoin)")

    # -- environment

    def _node_env(self, role: str, rank: int, placement: Placement, extra: dict | None = None) -> dict:
        env = {"DMLC_ROLE": role, "DMLC_PS_ROOT_URI": self.root_host, "DMLC_PS_ROOT_PORT": str(self.port),
               "DMLC_NUM_WORKER": str(self.num_workers), "DMLC_NUM_SERVER": str(self.num_servers),
               "DMLC_NODE_HOST": placement.host, "DMLC_TASK_ID": str(rank),
               "DMLC_JOB_CLUSTER": self.placer.kind, "PYTHONUNBUFFERED": "1"}
        env.update(self.env)
        if extra:
            env.update(extra)
        return env

    def node_specs(self) -> list[tuple[str, int, Placement, list[str], dict]]:
        """(role, rank, placement, argv, node environment) of every node, in start order: for tests and dry runs."""
        sched = self.placer.scheduler()
        self.root_host = sched.host
        if self.port is None:
            self.port = self.placer.scheduler_port()
        specs = [("scheduler", 0, sched, self.scheduler_command, self._node_env("scheduler", 0, sched))]
        for rank in range(self.num_servers):
            placement = self.placer.server(rank)
            extra = dict(self.server_env)
            if self._fixed_server_ports:
                extra["PORT"] = str(self.placer.server_port(rank, self.server_port_base))
            specs.append(("server", rank, placement, self.server_command,
                          self._node_env("server", rank, placement, extra)))
        for rank in range(self.num_workers):
            placement = self.placer.worker(rank)
            specs.append(("worker", rank, placement, self.command,
                          self._node_env("worker", rank, placement, self.worker_env)))
        return specs

    # -- processes

    def _spawn(self, role: str, rank: int, placement: Placement, argv: list[str], node_env: dict,
               incarnation: int = 0) -> Node:
        local_argv, env = placement.command(argv, node_env)
        setpriv = shutil.which("setpriv")
        if setpriv:
            # die with the launcher, even if it is killed with SIGKILL: the parent-death signal is set first, then
            # the node checks that its parent is still the launcher (else it was orphaned before that), then execs
            local_argv = [setpriv, "--pdeathsig", "TERM", "--", "sh", "-c",
                          f'[ "$PPID" = {os.getpid()} ] || exit 125; exec "$@"', "node"] + local_argv
        popen = subprocess.Popen(local_argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, start_new_session=True)
        node = Node(role, rank, popen, placement, list(argv), dict(node_env), started=time.monotonic(),
                    incarnation=incarnation)
        node.thread = threading.Thread(target=self._pump, args=(node,), daemon=True)
        node.thread.start()
        self.history.append(node)
        self._event("started", node, f"pid {popen.pid} on {placement.where}")
        return node

    def _pump(self, node: Node) -> None:
        for raw in iter(node.popen.stdout.readline, b""):
            line = raw.decode(errors="replace").replace("\r", "")
            if node.role == "server" and node.ps_rank is None and (found := REGISTERED.search(line)):
                self._set_ranks([node], [int(found.group(1))], "its log")
            elif node.role in ("server", "worker") and node.ps_rank is None:
                self._learn_ranks()      # a node that prints after registering: every node of its role has a port
            with self._lock:
                prefix = f"[{node.label}] "
                self.out.write(prefix + line if line.endswith("\n") else prefix + line + "\n")
                self.out.flush()

    def _set_ranks(self, nodes: list[Node], ranks: list[int], source: str) -> None:
        """Record ps-lite ranks learnt from `source`; say so for those that differ from the start order."""
        with self._lock:
            fresh = [(n, r) for n, r in zip(nodes, ranks) if n.ps_rank is None]
            for node, rank in fresh:
                node.ps_rank = rank
        moved = [f"{n.name} is rank {r}" for n, r in fresh if r != n.rank]
        if moved:
            self.say(f"ps-lite numbers nodes by address, not start order ({source}): " + ", ".join(moved))

    def _learn_ranks(self, every: float = 0.0) -> None:
        """Ranks from the nodes' listening ports, once every node of a role on this machine has bound its own (at
        most one look every `every` seconds). Called from the supervising loop and from the output threads."""
        with self._rank_lock:
            now = time.monotonic()
            if now >= self._rank_scan + every:
                self._rank_scan = now
                self._scan_ports()

    def _scan_ports(self) -> None:
        for role in ("server", "worker"):
            nodes = [n for n in self.nodes if n.role == role]
            if role in self._ranks_unknowable or all(n.ps_rank is not None for n in nodes) or \
                    any(isinstance(n.placement, SshPlacement) or n.ended is not None for n in nodes):
                continue
            addresses = []
            for node in nodes:
                ports = listening_ports(node.pid)
                if ports is not None and len(ports) > 1:
                    self._ranks_unknowable.add(role)
                    self.say(f"{node.name} listens on {len(ports)} ports {sorted(ports)}: {role} ranks are not "
                             f"inferred from ports")
                if ports is None or len(ports) != 1:
                    break        # not bound yet, or ambiguous
                addresses.append((node.env.get("DMLC_NODE_HOST", node.placement.host), ports.pop()))
            else:
                self._set_ranks(nodes, pslite_rank_order(addresses), "ports")

    def start(self) -> None:
        self.t0 = time.monotonic()
        for role, rank, placement, argv, env in self.node_specs():
            self.nodes.append(self._spawn(role, rank, placement, argv, env))
        self.say(f"started {self.num_servers} servers and {self.num_workers} workers; scheduler at "
                 f"{self.root_host}:{self.port}; " + ", ".join(f"{n.name} pid {n.pid}" for n in self.nodes))

    def restart(self, node: Node) -> Node:
        """Start `node` (a dead server) again, to rejoin the job at its host and port."""
        env = dict(node.env)
        env["KVSTORE_LAZY_RECOVERY"] = "1"
        fresh = self._spawn(node.role, node.rank, node.placement, node.argv, env, node.incarnation + 1)
        fresh.restarts, fresh.ps_rank = node.restarts + 1, node.ps_rank   # same address, same rank
        self.nodes[self.nodes.index(node)] = fresh
        self._event("restarted", fresh, f"pid {fresh.pid}")
        return fresh

    def supervise(self, timeout: float | None = None) -> int:
        """Wait until every worker exits 0 (then let scheduler and servers finish), or a node fails.

        Returns the job's exit status: 0, the failing node's status (128+N for signal N), or 124 on the deadline.
        Every process is stopped on the way out."""
        deadline = None if timeout is None else self.t0 + timeout
        finish_by = None
        aborted: list[tuple[Node, str, float]] = []
        try:
            while True:
                now = time.monotonic()
                for node in list(self.nodes):
                    code = node.popen.poll()
                    if code is None or node.ended is not None:
                        continue
                    node.ended = now
                    self._event("exited", node, str(code))
                    if code == 0:
                        continue
                    rank = "" if node.ps_rank is None else f", rank {node.ps_rank}"
                    what = f"{node.name} (pid {node.pid} on {node.placement.where}{rank}) {describe_status(code)}"
                    if code == -signal.SIGABRT and node.role != "scheduler":
                        # judged below, once it is clear whether the final barrier was done
                        aborted.append((node, what, now + ABORT_JUDGE_WAIT))
                        continue
                    if node.role == "server" and node.restarts < self.restart_servers and finish_by is None:
                        self.say(f"{what}; restarting it (restart {node.restarts + 1} of {self.restart_servers}) to "
                                 f"rejoin the job from its snapshot and journal")
                        self.restart(node)
                        continue
                    self._event("failed", node, what)
                    self.say(f"ERROR: {what}; stopping the job")
                    return code if code > 0 else 128 - code
                for entry in list(aborted):
                    node, what, judge_by = entry
                    if self._final_barrier_done():
                        # The scheduler and the servers exit 0 only after the final barrier: training is over.
                        # Under PS_RESEND, ps-lite 34fd45c's Resender can abort a node while it tears down (its
                        # monitor thread wakes after ready_=false and CHECKs it, or resends a final BARRIER the
                        # departed scheduler never ACKed): not a failure of the job.
                        aborted.remove(entry)
                        self._event("shutdown-abort", node, what)
                        self.say(f"WARNING: {what} after the final barrier (a ps-lite shutdown race under "
                                 f"PS_RESEND); training had completed")
                    elif now > judge_by:
                        self._event("failed", node, what)
                        self.say(f"ERROR: {what}; stopping the job")
                        return 128 + signal.SIGABRT
                workers = [n for n in self.nodes if n.role == "worker"]
                if finish_by is None and not aborted and all(n.ended is not None for n in workers):
                    finish_by = now + self.finish_grace
                    self._event("workers-done", workers[0] if workers else self.nodes[0], "")
                if finish_by is not None:
                    if all(n.ended is not None for n in self.nodes):
                        return 0
                    if now > finish_by:
                        running = ", ".join(n.name for n in self.nodes if n.ended is None)
                        self.say(f"WARNING: every worker finished, but {running} did not exit within "
                                 f"{self.finish_grace:.0f}s; stopping them")
                        return 0
                if finish_by is None:
                    self._learn_ranks(every=0.5)
                if deadline is not None and now > deadline:
                    running = ", ".join(n.name for n in self.nodes if n.ended is None)
                    self._event("deadline", self.nodes[0], running)
                    self.say(f"ERROR: deadline of {timeout:.0f}s reached; still running: {running}; stopping the job")
                    return 124
                time.sleep(POLL)
        finally:
            self.stop()

    def _final_barrier_done(self) -> bool:
        """The scheduler and the servers exit 0 only once the final group barrier released everyone."""
        return any(n.role in ("scheduler", "server") and n.ended is not None and n.popen.returncode == 0
                   for n in self.nodes)

    def stop(self) -> None:
        """End every process this job started: SIGTERM to its process group, SIGKILL after `grace` seconds."""
        for node in self.history:
            if node.popen.poll() is None:
                _killpg(node.popen.pid, signal.SIGTERM)
        grace = time.monotonic() + self.grace
        for node in self.history:
            try:
                node.popen.wait(timeout=max(grace - time.monotonic(), 0.01))
            except subprocess.TimeoutExpired:
                _killpg(node.popen.pid, signal.SIGKILL)
                node.popen.wait()
        for node in self.history:
            # the group may hold children of a node that outlived it
            _killpg(node.popen.pid, signal.SIGKILL)
            if node.thread is not None:
                node.thread.join(timeout=5)
            if node.popen.stdout is not None and not node.thread.is_alive():
                node.popen.stdout.close()

    def pids(self) -> list[int]:
        return [n.pid for n in self.history]

    # -- messages

    def _event(self, what: str, node: Node, detail: str) -> None:
        self.events.append((time.monotonic(), what, node.name, detail))

    def say(self, text: str) -> None:
        with self._lock:
            self.out.write(f"[launch +{time.monotonic() - self.t0:.2f}s] {text}\n")
            self.out.flush()


def _killpg(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


# ----------------------------------------------------------------------------------------------------------------
# command line


def parse_env(items: list[str], source=None) -> dict:
    """``NAME:VALUE`` / ``NAME=VALUE`` (comma-separated lists too), or ``NAME`` alone for its value here (as
    MXNet's --env passes a variable of the launching machine)."""
    source = os.environ if source is None else source
    env = {}
    for item in items:
        for part in item.split(","):
            if not part:
                continue
            name, sep, value = part.partition(":")
            if not sep:
                name, sep, value = part.partition("=")
            if not sep:
                if part not in source:
                    raise LaunchError(f"--env {part}: not set here (give NAME:VALUE)")
                name, value = part, source[part]
            env[name.strip()] = value
    return env


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m kvstore_lazy.launch",
                                description="Launch a distributed MXNet job with kvstore_lazy servers.")
    p.add_argument("-n", "--num-workers", type=int, required=True)
    p.add_argument("-s", "--num-servers", type=int, default=None, help="default: as many as workers")
    p.add_argument("--launcher", choices=["local", "ssh", "netns"], default="local",
                   help="local: every node on this machine; ssh: nodes on the hosts of -H (servers first, as "
                        "MXNet's launcher), scheduler here; netns: nodes in network namespaces (--netns-map)")
    p.add_argument("-H", "--hostfile", help="ssh: one host per line (host, host:sshport, host slots=N)")
    p.add_argument("--env", action="append", default=[],
                   help="NAME:VALUE[,NAME:VALUE], or NAME to pass its value here, for every node")
    p.add_argument("--env-server", action="append", default=[], help="as --env, servers only")
    p.add_argument("--env-worker", action="append", default=[], help="as --env, workers only")
    p.add_argument("--server", choices=["lazy", "stock"], default="lazy",
                   help="kvstore_lazy servers (default) or MXNet's stock C++ servers")
    p.add_argument("--host", default=None,
                   help="local: the address every node binds (127.0.0.1); ssh: this machine's address the nodes "
                        "reach the scheduler at (default: the one on the route to the first host)")
    p.add_argument("--port", type=int, default=None,
                   help=f"the scheduler's port (default: a free one here; {DEFAULT_PORT} in a namespace or remote)")
    p.add_argument("--netns-map", default="",
                   help="netns: scheduler=NS,server=NS,server1=NS,worker0=NS,... (a rank's entry wins over its "
                        "role's; NS@ADDR gives the address, else it is read from the namespace)")
    p.add_argument("--ssh-command", default="ssh", help="ssh: the ssh client to use (a command line)")
    p.add_argument("--scheduler-host", default=None,
                   help="ssh: run the scheduler over ssh on this host instead of here")
    p.add_argument("--sync-dst-dir", default=None,
                   help="ssh: rsync the current directory to this directory on every host first, and run there")
    p.add_argument("--workdir", default=None, help="ssh: the directory to run in on the hosts (default: this one)")
    p.add_argument("--server-command", default=None,
                   help=f"command line of a server (default: {shlex.join(LAZY_SERVER)})")
    p.add_argument("--scheduler-command", default=None,
                   help=f"command line of the scheduler (default: {shlex.join(STOCK_NODE)})")
    p.add_argument("--snapshot-dir", default=None,
                   help="servers snapshot into this directory (KVSTORE_LAZY_SNAPSHOT_DIR; a path on each server host)")
    p.add_argument("--snapshot-interval", type=float, default=None,
                   help="seconds between periodic server snapshots (KVSTORE_LAZY_SNAPSHOT_INTERVAL)")
    p.add_argument("--restart-servers", type=int, default=0, metavar="N",
                   help="restart a dead kvstore_lazy server up to N times; it rejoins from its snapshot and journal "
                        "(needs --snapshot-dir; turns on KVSTORE_LAZY_JOURNAL and PS_RESEND)")
    p.add_argument("--server-port-base", type=int, default=None,
                   help=f"servers bind PORT=BASE+i (default with --restart-servers: a free port each locally, "
                        f"{DEFAULT_SERVER_PORT_BASE}+i elsewhere)")
    p.add_argument("--timeout", type=float, default=None, help="end the job after this many seconds (status 124)")
    p.add_argument("--grace", type=float, default=5.0, help="seconds between SIGTERM and SIGKILL when stopping")
    p.add_argument("--dry-run", action="store_true", help="print each node's command and environment, start nothing")
    p.add_argument("command", nargs=argparse.REMAINDER)
    return p


def job_from_args(args, out=sys.stdout) -> Job:
    """The Job an argument list describes (no process started)."""
    if not args.command:
        raise LaunchError("give the worker command, e.g. python train.py")
    num_servers = args.num_workers if args.num_servers is None else args.num_servers
    env = parse_env(args.env)
    server_env = parse_env(args.env_server)
    worker_env = parse_env(args.env_worker)
    if args.snapshot_dir:
        server_env["KVSTORE_LAZY_SNAPSHOT_DIR"] = args.snapshot_dir
    if args.snapshot_interval is not None:
        server_env["KVSTORE_LAZY_SNAPSHOT_INTERVAL"] = str(args.snapshot_interval)
    if args.restart_servers:
        if not (server_env.get("KVSTORE_LAZY_SNAPSHOT_DIR") or env.get("KVSTORE_LAZY_SNAPSHOT_DIR")
                or os.environ.get("KVSTORE_LAZY_SNAPSHOT_DIR")):
            raise LaunchError("--restart-servers needs --snapshot-dir (where a restarted server finds its state)")
        server_env["KVSTORE_LAZY_JOURNAL"] = "1"
        for name, value in (("PS_RESEND", "1"), ("PS_RESEND_TIMEOUT", RESEND_TIMEOUT_MS)):
            if name not in env and name not in os.environ:
                env[name] = value
        if c_atoi(env.get("PS_RESEND") or os.environ.get("PS_RESEND", "0")) == 0:
            raise LaunchError("--restart-servers needs PS_RESEND=1 on every node (it is how workers re-send what "
                              "died with a server)")
    if args.launcher == "local":
        if args.hostfile:
            raise LaunchError("-H/--hostfile is for --launcher ssh")
        placer = LocalPlacer(args.host or "127.0.0.1")
    elif args.launcher == "netns":
        if not args.netns_map:
            raise LaunchError("--launcher netns needs --netns-map (see scripts/netns_cluster.sh map)")
        placer = NetnsPlacer(parse_netns_map(args.netns_map), port=args.port or DEFAULT_PORT)
    else:
        if not args.hostfile:
            raise LaunchError("--launcher ssh needs -H/--hostfile")
        with open(args.hostfile) as fh:
            hosts = parse_hostfile(fh.read())
        placer = SshPlacer(hosts, num_servers, ssh_command=shlex.split(args.ssh_command),
                           workdir=args.sync_dst_dir or args.workdir or os.getcwd(), scheduler_host=args.host,
                           remote_scheduler=args.scheduler_host, port=args.port)
    return Job(command=args.command, num_workers=args.num_workers, num_servers=num_servers, server=args.server,
               host=args.host or "127.0.0.1", env=env, server_env=server_env, worker_env=worker_env, out=out,
               placer=placer, port=args.port,
               server_command=shlex.split(args.server_command) if args.server_command else None,
               scheduler_command=shlex.split(args.scheduler_command) if args.scheduler_command else None,
               restart_servers=args.restart_servers, server_port_base=args.server_port_base, grace=args.grace)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        job = job_from_args(args)
    except (LaunchError, OSError) as exc:
        parser.error(str(exc))
    if args.dry_run:
        for role, rank, placement, node_argv, env in job.node_specs():
            local_argv, _ = placement.command(node_argv, env)
            print(f"# {role} {rank} on {placement.where}")
            print(shlex.join(local_argv) if isinstance(placement, SshPlacement) else
                  " ".join(f"{k}={shlex.quote(str(v))}" for k, v in env.items()) + " " + shlex.join(local_argv))
        return 0
    if args.launcher == "ssh" and args.sync_dst_dir:
        for cmd in job.placer.sync_commands(os.getcwd(), args.sync_dst_dir):
            job.say(f"sync: {shlex.join(cmd)}")
            if subprocess.run(cmd).returncode != 0:
                job.say("ERROR: rsync failed")
                return 1
    job.say(f"{job.num_workers} workers, {job.num_servers} {args.server} servers ({args.launcher}): "
            f"{shlex.join(args.command)}")
    # SIGINT too: a launcher started in the background of a non-interactive shell inherits SIGINT ignored, and an
    # explicit `kill -INT` must still stop the job
    previous = {sig: signal.signal(sig, _interrupt) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        job.start()
        code = job.supervise(args.timeout)
    except KeyboardInterrupt:
        signum = _received[-1] if _received else signal.SIGINT
        job.say(f"interrupted ({signal.Signals(signum).name}); stopping every process")
        job.stop()
        code = 128 + signum
    except BaseException:
        job.stop()
        raise
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    job.say(f"job finished with status {code}")
    return code


_received: list[int] = []


def _interrupt(signum, frame):
    _received.append(signum)
    raise KeyboardInterrupt()

