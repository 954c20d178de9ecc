"""Launch a distributed MXNet job: the stock scheduler, kvstore_lazy (or stock) servers, and the user's command as
workers. Options follow MXNet's tools/launch.py (-n, -s, --launcher, -H, --env), on Python 3.11.

Owns: process supervision. Every process it starts is in its own process group and is ended by PID when the job
ends: on success, on Ctrl-C, on a deadline, or as soon as any node exits with an error (stock ps-lite would leave
every other node hanging silently). Each role's output is streamed with a prefix ("[worker 1] ...").

Run: ``python -m kvstore_lazy.launch -n 2 -s 2 python train.py``.
"""
from __future__ import annotations

import argparse
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

STOCK_NODE = [sys.executable, "-c", "import mxnet"]
LAZY_SERVER = [sys.executable, "-m", "kvstore_lazy.server"]


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass
class Node:
    role: str
    rank: int
    popen: subprocess.Popen
    thread: threading.Thread | None = None

    @property
    def name(self) -> str:
        return self.role if self.role == "scheduler" else f"{self.role} {self.rank}"


@dataclass
class LocalJob:
    """Scheduler, servers and workers as local processes on `host` (127.0.0.1 by default)."""

    command: list[str]
    num_workers: int
    num_servers: int
    server: str = "lazy"              # lazy | stock
    host: str = "127.0.0.1"
    env: dict = field(default_factory=dict)
    server_env: dict = field(default_factory=dict)
    out: object = sys.stdout
    nodes: list[Node] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def _env(self, role: str, rank: int, extra: dict | None = None) -> dict:
        env = {k: v for k, v in os.environ.items() if not k.startswith("DMLC_")}
        env.update({"DMLC_ROLE": role, "DMLC_PS_ROOT_URI": self.host, "DMLC_PS_ROOT_PORT": str(self.port),
                    "DMLC_NUM_WORKER": str(self.num_workers), "DMLC_NUM_SERVER": str(self.num_servers),
                    "DMLC_NODE_HOST": self.host, "DMLC_TASK_ID": str(rank), "DMLC_JOB_CLUSTER": "local",
                    "PYTHONUNBUFFERED": "1"})
        env.update(self.env)
        if extra:
            env.update(extra)
        return env

    def _start(self, role: str, rank: int, argv: list[str], env: dict) -> Node:
        popen = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                 start_new_session=True)
        node = Node(role, rank, popen)
        node.thread = threading.Thread(target=self._pump, args=(node,), daemon=True)
        node.thread.start()
        self.nodes.append(node)
        return node

    def _pump(self, node: Node) -> None:
        prefix = f"[{node.name}] "
        for raw in iter(node.popen.stdout.readline, b""):
            with self._lock:
                self.out.write(prefix + raw.decode(errors="replace"))
                self.out.flush()

    def start(self) -> None:
        self.port = free_port(self.host)
        self._start("scheduler", 0, STOCK_NODE, self._env("scheduler", 0))
        server_argv = LAZY_SERVER if self.server == "lazy" else STOCK_NODE
        for rank in range(self.num_servers):
            self._start("server", rank, server_argv, self._env("server", rank, self.server_env))
        for rank in range(self.num_workers):
            self._start("worker", rank, self.command, self._env("worker", rank))

    def supervise(self, timeout: float | None = None) -> int:
        """Wait until every worker exits 0 (then let scheduler/servers finish), or any node fails.

        Returns the job's exit status: 0, the failing node's code, or 124 on the deadline."""
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            while True:
                for node in self.nodes:
                    code = node.popen.poll()
                    if code not in (None, 0):
                        self._say(f"{node.name} exited with status {code}; stopping the job")
                        return code if code > 0 else 128 - code
                if all(n.popen.poll() == 0 for n in self.nodes):
                    return 0
                if deadline is not None and time.monotonic() > deadline:
                    running = ", ".join(n.name for n in self.nodes if n.popen.poll() is None)
                    self._say(f"deadline of {timeout:.0f}s reached; still running: {running}; stopping the job")
                    return 124
                time.sleep(0.1)
        finally:
            self.stop()

    def stop(self) -> None:
        for node in self.nodes:
            if node.popen.poll() is None:
                try:
                    os.killpg(node.popen.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        grace = time.monotonic() + 5
        for node in self.nodes:
            try:
                node.popen.wait(timeout=max(grace - time.monotonic(), 0.01))
            except subprocess.TimeoutExpired:
                os.killpg(node.popen.pid, signal.SIGKILL)
                node.popen.wait()
        for node in self.nodes:
            if node.thread is not None:
                node.thread.join(timeout=5)

    def _say(self, text: str) -> None:
        with self._lock:
            self.out.write(f"[launch] {text}\n")
            self.out.flush()


def parse_env(items: list[str]) -> dict:
    env = {}
    for item in items:
        for part in item.split(","):
            if not part:
                continue
            name, sep, value = part.partition(":")
            if not sep:
                name, sep, value = part.partition("=")
            if not sep:
                raise SystemExit(f"--env expects NAME:VALUE (or NAME=VALUE), got {part!r}")
            env[name] = value
    return env


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvstore_lazy.launch",
                                     description="Launch a distributed MXNet job with kvstore_lazy servers.")
    parser.add_argument("-n", "--num-workers", type=int, required=True)
    parser.add_argument("-s", "--num-servers", type=int, default=None, help="default: as many as workers")
    parser.add_argument("--launcher", choices=["local"], default="local",
                        help="only 'local' so far (scheduler, servers and workers on this machine)")
    parser.add_argument("-H", "--hostfile", help="not supported with --launcher local")
    parser.add_argument("--env", action="append", default=[], help="NAME:VALUE[,NAME:VALUE] for every node")
    parser.add_argument("--server", choices=["lazy", "stock"], default="lazy",
                        help="kvstore_lazy servers (default) or MXNet's stock C++ servers")
    parser.add_argument("--host", default="127.0.0.1", help="address every node binds and advertises")
    parser.add_argument("--timeout", type=float, default=None, help="end the job after this many seconds")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    if not args.command:
        parser.error("give the worker command, e.g. python train.py")
    if args.hostfile:
        parser.error("-H/--hostfile needs an ssh launcher, which this version does not have")
    job = LocalJob(command=args.command, num_workers=args.num_workers,
                   num_servers=args.num_servers or args.num_workers, server=args.server, host=args.host,
                   env=parse_env(args.env))
    job._say(f"{job.num_workers} workers, {job.num_servers} {args.server} servers: {shlex.join(args.command)}")
    previous = signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    try:
        job.start()
        code = job.supervise(args.timeout)
    except KeyboardInterrupt:
        job._say("interrupted; stopping every process")
        job.stop()
        code = 130
    finally:
        signal.signal(signal.SIGTERM, previous)
    job._say(f"job finished with status {code}")
    return code


if __name__ == "__main__":
    raise SystemExit(main())
