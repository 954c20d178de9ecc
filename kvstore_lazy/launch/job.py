"""One ps-lite job: the stock scheduler, kvstore_lazy (or stock) servers, and the user's command as workers.

Owns: the :class:`Job` (what each node runs, starting every process in its own process group, streaming each node's
output with a prefix, restarting a server, stopping everything). Each node's output is streamed with a prefix, and
the launcher's own lines ("[launch +3.21s] ...") say what happened and when.
Does not own: where nodes run (``placement``), their environment (``environment``), their ranks (``ranks``), or
when the job has failed or finished (``supervise``).
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time

from kvstore_lazy.launch.preflight import describe as describe_job, overrides, worker_switch
from kvstore_lazy.launch.supervise import Supervision
from kvstore_lazy.launch.environment import node_env
from kvstore_lazy.launch.errors import LaunchError
from kvstore_lazy.launch.placement import LocalPlacer, Placement, Placer
from kvstore_lazy.launch.process import Node, killpg
from kvstore_lazy.launch.ranks import RankDiscovery

STOCK_NODE = [sys.executable, "-c", "import mxnet"]
LAZY_SERVER = [sys.executable, "-m", "kvstore_lazy.server"]


class Job:
    """Scheduler, servers and workers of one ps-lite job, wherever `placer` puts them (this machine by default).

    Servers are started first, then workers, as MXNet's launcher does; the scheduler before both. `restart_servers`
    allows that many restarts per server (kvstore_lazy servers only; they need a snapshot dir, see
    kvstore_lazy.launch.environment). `events` records (monotonic time, what, node name, detail) for what the
    launcher saw and did."""

    def __init__(self, command: list[str], num_workers: int, num_servers: int, server: str = "lazy",
                 host: str = "127.0.0.1", env: dict | None = None, server_env: dict | None = None,
                 worker_env: dict | None = None, out=sys.stdout, placer: Placer | None = None,
                 port: int | None = None,
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
        self.placer: Placer = placer or LocalPlacer(host)
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
        self.root_host = host                 # the scheduler's address: set by node_specs
        self._lock = threading.Lock()
        self.ranks = RankDiscovery(self.nodes, self._lock, self.say)
        self._fixed_server_ports = restart_servers > 0 or server_port_base is not None
        if restart_servers and server != "lazy":
            raise LaunchError("--restart-servers needs kvstore_lazy servers (a stock server cannot rejoin)")
        # what --server means, whatever KVSTORE_LAZY says (kvstore_lazy.launch.preflight)
        self.overrides = overrides(server, self.env, self.server_env, self.worker_env)
        self.worker_switch = worker_switch(self.env, self.worker_env)

    def describe(self) -> str:
        """What this job runs, in words (the launcher's banner)."""
        custom = self.server_command if self.server_command not in (LAZY_SERVER, STOCK_NODE) else None
        return describe_job(self.num_workers, self.num_servers, self.server, custom, self.worker_switch)

    # -- environment

    def _node_env(self, role: str, rank: int, placement: Placement, extra: dict | None = None) -> dict:
        return node_env(role, rank, self.root_host, self.port, self.num_workers, self.num_servers, placement.host,
                        self.placer.kind, self.env, extra)

    def node_specs(self) -> list[tuple[str, int, Placement, list[str], dict]]:
        """(role, rank, placement, argv, node environment) of every node, in start order: for tests and dry runs."""
        sched = self.placer.scheduler()
        self.root_host = sched.host
        if self.port is None:
            self.port = self.placer.scheduler_port()
        specs = [("scheduler", 0, sched, self.scheduler_command,
                  self._node_env("scheduler", 0, sched, self.overrides["scheduler"]))]
        for rank in range(self.num_servers):
            placement = self.placer.server(rank)
            extra = dict(self.server_env, **self.overrides["server"])
            if self._fixed_server_ports:
                extra["PORT"] = str(self.placer.server_port(rank, self.server_port_base))
            specs.append(("server", rank, placement, self.server_command,
                          self._node_env("server", rank, placement, extra)))
        for rank in range(self.num_workers):
            placement = self.placer.worker(rank)
            specs.append(("worker", rank, placement, self.command,
                          self._node_env("worker", rank, placement, dict(self.worker_env, **self.overrides["worker"]))))
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
        assert node.popen.stdout is not None, "a node's output is a pipe"
        for raw in iter(node.popen.stdout.readline, b""):
            line = raw.decode(errors="replace").replace("\r", "")
            self.ranks.from_line(node, line)
            with self._lock:
                prefix = f"[{node.label}] "
                self.out.write(prefix + line if line.endswith("\n") else prefix + line + "\n")
                self.out.flush()

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
        Every process is stopped on the way out (see kvstore_lazy.launch.supervise)."""
        return Supervision(self, timeout).run()

    def stop(self) -> None:
        """End every process this job started: SIGTERM to its process group, SIGKILL after `grace` seconds."""
        for node in self.history:
            if node.popen.poll() is None:
                killpg(node.popen.pid, signal.SIGTERM)
        grace = time.monotonic() + self.grace
        for node in self.history:
            try:
                node.popen.wait(timeout=max(grace - time.monotonic(), 0.01))
            except subprocess.TimeoutExpired:
                killpg(node.popen.pid, signal.SIGKILL)
                node.popen.wait()
        for node in self.history:
            # the group may hold children of a node that outlived it
            killpg(node.popen.pid, signal.SIGKILL)
            if node.thread is not None:
                node.thread.join(timeout=5)
            if node.popen.stdout is not None and (node.thread is None or not node.thread.is_alive()):
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

