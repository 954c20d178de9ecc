"""Where each node of a job runs: on this machine, in a network namespace, or on another machine over ssh.

Owns: a node's *placement* (the address it binds and advertises, and the command line that starts it there) and the
*placers* that give each role and rank one (``--launcher local|netns|ssh``), with their input formats: MXNet's
hostfile, the ``--netns-map`` of scripts/netns_cluster.sh; free ports on this machine.
Does not own: the node's environment (``environment``), or starting and watching processes (``job``).

Over ssh the local ssh client is what is watched: it exits when the remote process does (ServerAliveInterval bounds
a silent host to ~15 s).
"""
from __future__ import annotations

import os
import random
import shlex
import socket
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from kvstore_lazy.launch.environment import passed_env
from kvstore_lazy.launch.errors import LaunchError

DEFAULT_PORT = 9091             # the scheduler's port where the launcher cannot probe for a free one
DEFAULT_SERVER_PORT_BASE = 9200
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
        exports = dict(passed_env())
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


class Placer(Protocol):
    """What a Job asks of a placer: a placement per node, the scheduler's port and each server's."""

    kind: str

    def scheduler(self) -> Placement: ...

    def server(self, rank: int) -> Placement: ...

    def worker(self, rank: int) -> Placement: ...

    def scheduler_port(self) -> int: ...

    def server_port(self, rank: int, base: int | None) -> int: ...


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

