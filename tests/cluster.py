"""Start real ps-lite jobs on 127.0.0.1 for tests: the stock scheduler, stock or kvstore_lazy servers, stock workers.

Every process gets its own process group, a deadline, and is ended by its PID; a job that does not finish before
its deadline raises :class:`JobHung` (a hang is a failure, never a pass).
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from kvstore_lazy.launch import free_port  # noqa: F401 (tests take it from here: below the ephemeral range)

ROOT = Path(__file__).resolve().parents[1]
PYTHON = sys.executable
# Our servers' interpreter, when not this one (`make test-server-python`: CPython 3.13 + numpy 2 with the package
# installed from its wheel). Run isolated (-I): its own site-packages, not this source tree (PYTHONPATH, cwd).
SERVER_PYTHON = os.environ.get("KVSTORE_LAZY_SERVER_PYTHON")


class JobHung(AssertionError):
    pass


class JobFailed(AssertionError):
    pass


def netns_unavailable() -> str | None:
    """Why network-namespace hosts (scripts/netns_cluster.sh) cannot run here, or None if they can."""
    if sys.platform != "linux":
        return "network namespaces are Linux only"
    if os.geteuid() != 0:
        return "needs root (ip netns)"
    if shutil.which("ip") is None:
        return "needs iproute2 (ip): apt-get install iproute2"
    probe = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"ip netns does not work here: {probe.stderr.strip()}"
    return None


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen
    log: Path

    def output(self) -> str:
        try:
            return self.log.read_text(errors="replace")
        except FileNotFoundError:
            return ""


@dataclass
class Job:
    """One ps-lite job. `server` is "lazy" (kvstore_lazy) or "stock" (MXNet's C++ server)."""

    tmp: Path
    num_workers: int = 2
    num_servers: int = 1
    server: str = "lazy"
    mode_env: dict = field(default_factory=dict)
    procs: list[Proc] = field(default_factory=list)

    def env(self, role: str, extra: dict | None = None) -> dict:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("DMLC_", "PS_"))}
        env.update({
            "DMLC_ROLE": role,
            "DMLC_PS_ROOT_URI": "127.0.0.1",
            "DMLC_PS_ROOT_PORT": str(self.port),
            "DMLC_NUM_WORKER": str(self.num_workers),
            "DMLC_NUM_SERVER": str(self.num_servers),
            "DMLC_NODE_HOST": "127.0.0.1",
            "PYTHONPATH": str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""),
            "OMP_NUM_THREADS": "1",
            "MXNET_ENGINE_TYPE": env.get("MXNET_ENGINE_TYPE", "ThreadedEnginePerDevice"),
        })
        env.update(self.mode_env)
        if extra:
            env.update(extra)
        return env

    def _spawn(self, name: str, argv: list[str], env: dict) -> Proc:
        log = self.tmp / f"{name}.log"
        with open(log, "wb") as fh:
            popen = subprocess.Popen(argv, env=env, stdout=fh, stderr=subprocess.STDOUT, cwd=str(ROOT),
                                     start_new_session=True)
        proc = Proc(name, popen, log)
        self.procs.append(proc)
        return proc

    def start(self, server_env: dict | None = None) -> "Job":
        self.port = free_port()
        self._spawn("scheduler", [PYTHON, "-c", "import mxnet"], self.env("scheduler"))
        for rank in range(self.num_servers):
            env = self.env("server", server_env)
            if self.server == "stock":
                argv = [PYTHON, "-c", "import mxnet"]
            elif SERVER_PYTHON:
                argv = [SERVER_PYTHON, "-I", "-m", "kvstore_lazy.server"]
            else:
                argv = [PYTHON, "-m", "kvstore_lazy.server"]
            self._spawn(f"server{rank}", argv, env)
        return self

    def run_workers(self, script: str, args: list[str], timeout: float = 120.0,
                    worker_env: dict | None = None) -> list[Proc]:
        workers = self.spawn_workers(script, args, worker_env)
        self.wait(timeout)
        return workers

    def wait(self, timeout: float) -> None:
        """Wait for every process; on the deadline end them all and raise JobHung; on a non-zero exit raise."""
        deadline = time.monotonic() + timeout
        try:
            for proc in self.procs:
                remaining = deadline - time.monotonic()
                try:
                    proc.popen.wait(timeout=max(remaining, 0.01))
                except subprocess.TimeoutExpired:
                    raise JobHung(f"{proc.name} did not finish within {timeout:.0f}s\n" + self.report()) from None
        finally:
            self.kill()
        failed = [p for p in self.procs if p.popen.returncode != 0]
        if failed:
            raise JobFailed(", ".join(f"{p.name} exited {p.popen.returncode}" for p in failed) + "\n" + self.report())

    def wait_for(self, names: list[str], timeout: float) -> dict[str, int]:
        """Wait for the named processes only; return their exit codes; raise JobHung at the deadline."""
        deadline = time.monotonic() + timeout
        codes = {}
        for proc in self.procs:
            if proc.name in names:
                try:
                    codes[proc.name] = proc.popen.wait(timeout=max(deadline - time.monotonic(), 0.01))
                except subprocess.TimeoutExpired:
                    self.kill()
                    raise JobHung(f"{proc.name} did not finish within {timeout:.0f}s\n" + self.report()) from None
        return codes

    def spawn_workers(self, script: str, args: list[str], worker_env: dict | None = None) -> list[Proc]:
        workers = []
        for rank in range(self.num_workers):
            env = self.env("worker", worker_env)
            workers.append(self._spawn(f"worker{rank}", [PYTHON, str(ROOT / "tests" / "workers" / script)] + args,
                                       env))
        return workers

    def alive(self, name: str) -> bool:
        return next(p for p in self.procs if p.name == name).popen.poll() is None

    def kill(self) -> None:
        for proc in self.procs:
            if proc.popen.poll() is None:
                try:
                    os.killpg(proc.popen.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.popen.wait(timeout=10)

    def report(self, tail: int = 4000) -> str:
        parts = []
        for proc in self.procs:
            parts.append(f"----- {proc.name} (rc={proc.popen.poll()}) -----\n{proc.output()[-tail:]}")
        return "\n".join(parts)

    def log(self, name: str) -> str:
        return next(p for p in self.procs if p.name == name).output()
