"""N simulated ps-lite workers in one process, and the pacing of their steps: the saturation load generator.

Owns: :class:`SimWorkers` (per simulated worker a ROUTER of its own on its own port, a DEALER to the scheduler and
one to the server, each with the worker's ``ps<id>`` identity; registration through the stock scheduler, barriers,
requests and their replies) and :func:`run_steps` (steps paced closed-loop or open-loop, timed, replies checked).
Does not own: the bytes of a request (``loadgen_wire``), the row ids (``common.ZipfRows``), the job's plan and its
records (``loadgen_job``), or the tables (``saturation_report``).

Why one process, and why pyzmq: on a 2-core machine, N MXNet worker processes measure the machine, not the
server. Here every request's frames are built once (``loadgen_wire.Request``: a send stamps one varint into a
pre-encoded meta); a send is one ``send_multipart`` (frames over 64 KiB go zero-copy), a receive is a
``recv_multipart(copy=False)`` plus a 2 us meta decode and a size check, and the loop sleeps in ``zmq.Poller``
whenever nothing is due. The process's own CPU per phase is recorded (``loadgen_cores``) so a run shows what the
generator took from the machine.

Each simulated worker is a ps-lite node as the scheduler sees it (pslite-wire.md (b)): its ADD_NODE comes on a
socket without identity from its own host:port, so the scheduler gives it its own id (9, 11, ...; ranks in port
order); it then reconnects with identity ``ps<id>``; the server connects a DEALER to its ROUTER, where its replies
arrive. Every worker must join every group-7 barrier, as the scheduler counts requests.

A step is what bench's throughput worker times: a row_sparse pull of B rows, then (after its reply) the push of
their gradients, until the push's reply (in dist_sync the server holds it until the round's N pushes are in).
Closed-loop: each worker starts its next step when the last one completed. Open-loop: step k of a worker starts
at t0 + offset + k / rate (dist_sync: every worker at the same instants, as a synchronous job's workers; dist_async:
staggered), whatever the replies do, with at most `cap` steps in flight per worker. A step's latency runs from its
start (its pull's send) to its push's reply; a step held back by the cap counts from when it was due, so an
overloaded server's queueing shows in the latency. The poller's timeout has millisecond resolution, so an
open-loop start can be up to ~1 ms late; the mean lateness is recorded (``start_lag_ms``).
"""
from __future__ import annotations

import importlib.util
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import zmq


def _bench_common():
    """This folder's common.py, by its path: tests/workers has a module named common too, and the test suite puts
    that folder on sys.path first (loading it also puts the repository on sys.path)."""
    name = "bench_workers_common"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().parent / "common.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


bench_common = _bench_common()
cpu_seconds = bench_common.cpu_seconds

import loadgen_wire as wire  # noqa: E402
from kvstore_lazy.protocol.message import identity_of  # noqa: E402
from kvstore_lazy.protocol.pbmeta import ADD_NODE, BARRIER, SERVER, WORKER, Meta, decode_meta  # noqa: E402

HELD = 0.002      # s: an open-loop start later than this was held back (the poller's resolution is 1 ms)


class LoadgenError(RuntimeError):
    """A deadline passed, the scheduler's node list was not what a worker expects, or a reply was wrong."""


@dataclass
class Reply:
    worker: int
    meta: Meta
    sizes: list[int]                  # byte sizes of the data frames
    frames: list = field(repr=False)  # the zmq.Frames (identity, meta, data...): kept only when asked for


class SimWorkers:
    """`n` simulated workers of one ps-lite job with one server. Use: ``register()``, ``barrier(7)``, requests
    (``send``/``call``/``call_all``), ..., ``barrier(7)`` after kStopServer, ``close()``."""

    def __init__(self, n: int, root_uri: str, root_port: int, host: str = "127.0.0.1",
                 timeout: float = 60.0) -> None:
        self.n, self.host, self.timeout = n, host, timeout
        self.scheduler = f"tcp://{root_uri}:{root_port}"
        self.ctx = zmq.Context()
        self.sockets: list[zmq.Socket] = []      # every socket made, so close() can end the context
        self.routers: list[zmq.Socket] = []
        self.ports: list[int] = []
        self.poller = zmq.Poller()
        self.index: dict[zmq.Socket, int] = {}
        for i in range(n):
            router = self._socket(zmq.ROUTER)
            router.setsockopt(zmq.RCVHWM, 0)
            self.ports.append(router.bind_to_random_port(f"tcp://{host}"))
            self.routers.append(router)
            self.poller.register(router, zmq.POLLIN)
            self.index[router] = i
        self.ids: list[int] = []
        self.to_scheduler: list[zmq.Socket] = []
        self.to_server: list[zmq.Socket] = []
        self.customer_ts = [0] * n     # one customer per worker: requests and commands share its counter
        self.van_ts = [0] * n          # control messages (ADD_NODE, BARRIER) use the van's counter
        self.keep_frames = False       # Reply.frames for tests that read the values
        self.stash: list[Reply] = []   # replies that arrived while waiting for others

    def _socket(self, kind: int, identity: bytes | None = None, connect: str | None = None) -> zmq.Socket:
        sock = self.ctx.socket(kind)
        self.sockets.append(sock)
        sock.setsockopt(zmq.LINGER, 0)
        if kind == zmq.DEALER:
            sock.setsockopt(zmq.SNDHWM, 0)
        if identity is not None:
            sock.setsockopt(zmq.IDENTITY, identity)
        if connect is not None:
            sock.connect(connect)
        return sock

    # -- membership

    def register(self) -> list[int]:
        """ADD_NODE from every worker at once (the scheduler answers when all nodes of the job registered), then
        the reconnection with identities. Returns the workers' node ids."""
        first = [self._socket(zmq.DEALER, connect=self.scheduler) for _ in range(self.n)]
        for i, sock in enumerate(first):
            sock.send_multipart(wire.add_node(self.host, self.ports[i], self._van(i)))
        nodes = self._await_control(ADD_NODE)
        for sock in first:
            sock.close(linger=0)
        for i in range(self.n):
            mine = [nd.id for nd in nodes[i] if nd.role == WORKER and nd.hostname == self.host
                    and nd.port == self.ports[i]]
            servers = [nd for nd in nodes[i] if nd.role == SERVER]
            if len(mine) != 1 or len(servers) != 1:
                raise LoadgenError(f"worker {i}: the scheduler's list has {len(mine)} entries for "
                                   f"{self.host}:{self.ports[i]} and {len(servers)} servers (one expected)")
            self.ids.append(mine[0])
            identity = identity_of(mine[0])
            self.to_scheduler.append(self._socket(zmq.DEALER, identity, self.scheduler))
            self.to_server.append(self._socket(zmq.DEALER, identity,
                                               f"tcp://{servers[0].hostname}:{servers[0].port}"))
        return self.ids

    def barrier(self, group: int = wire.ALL_GROUP) -> None:
        """Every worker sends BARRIER(group) and waits for its release (a group of one node sends nothing, as
        ps-lite's Postoffice::Barrier)."""
        if group == wire.WORKER_GROUP and self.n == 1:
            return
        for i in range(self.n):
            self.to_scheduler[i].send_multipart(wire.barrier(group, self._van(i)))
        self._await_control(BARRIER)

    def _van(self, i: int) -> int:
        ts, self.van_ts[i] = self.van_ts[i], self.van_ts[i] + 1
        return ts

    def _await_control(self, cmd: int) -> list:
        """Wait (deadline: timeout) until every worker received a control message `cmd` that is not a request;
        returns each one's node list."""
        got: dict[int, list] = {}
        deadline = time.monotonic() + self.timeout
        while len(got) < self.n:
            left = deadline - time.monotonic()
            if left <= 0:
                raise LoadgenError(f"control {cmd}: {len(got)} of {self.n} workers answered within "
                                   f"{self.timeout:.0f}s")
            for sock, _ in self.poller.poll(int(left * 1000) + 1):
                frames = sock.recv_multipart()
                meta = decode_meta(frames[1])
                if meta.control.cmd == cmd and not meta.request:
                    got[self.index[sock]] = meta.control.nodes
        return [got[i] for i in range(self.n)]

    # -- requests

    def send(self, i: int, request: wire.Request) -> int:
        """Send `request` from worker i; returns its timestamp."""
        ts = self.customer_ts[i]
        self.customer_ts[i] = ts + 1
        self.to_server[i].send_multipart(request.frames(ts))
        return ts

    def receive(self, timeout_ms: int) -> list[Reply]:
        """The replies that arrive within `timeout_ms` (all that are queued once one is; [] on the timeout)."""
        out = self.stash
        self.stash = []
        if out:
            timeout_ms = 0
        for sock, _ in self.poller.poll(timeout_ms):
            i = self.index[sock]
            while True:
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                meta = decode_meta(frames[1].buffer)
                if meta.request or meta.control.cmd:
                    continue           # nothing but replies is expected while serving
                out.append(Reply(i, meta, [len(f) for f in frames[2:]], frames if self.keep_frames else []))
        return out

    def call_all(self, requests: dict[int, wire.Request]) -> dict[int, Reply]:
        """Send each worker's request, wait (deadline: timeout) for every reply, check each one."""
        sent = {i: (self.send(i, req), req) for i, req in requests.items()}
        got: dict[int, Reply] = {}
        deadline = time.monotonic() + self.timeout
        while len(got) < len(sent):
            left = deadline - time.monotonic()
            if left <= 0:
                raise LoadgenError(f"{len(got)} of {len(sent)} replies within {self.timeout:.0f}s")
            for reply in self.receive(int(left * 1000) + 1):
                ts, req = sent.get(reply.worker, (None, None))
                if req is None or reply.meta.timestamp != ts:
                    self.stash.append(reply)
                    continue
                error = wire.reply_error(req, reply.sizes)
                if error:
                    raise LoadgenError(f"worker {reply.worker}: {error}")
                got[reply.worker] = reply
        return got

    def call(self, i: int, request: wire.Request) -> Reply:
        return self.call_all({i: request})[i]

    def close(self) -> None:
        """Close every socket (also those of a registration that failed half-way), then the context."""
        for sock in self.sockets:
            sock.close(linger=0)
        self.ctx.term()


# ----------------------------------------------------------------------------------------------------------------
# pacing

@dataclass
class Plan:
    """The steps of a phase: per worker a cycle of (pull, push) request pairs; ``rate`` in steps per second over
    all workers (None: closed-loop)."""
    steps: list[list[tuple[wire.Request, wire.Request]]]
    seconds: float
    rate: float | None = None
    synchronous: bool = True         # open-loop: every worker starts at the same instants
    cap: int = 1                     # open-loop: steps in flight per worker (see the module docstring)
    drain_timeout: float = 30.0


@dataclass
class _Step:
    start: float
    in_window: bool
    pull: wire.Request
    push: wire.Request
    pull_sent: float = 0.0
    pull_ms: float = 0.0


class _Pacer:
    """The state of one phase: what each worker has in flight and when its next step is due."""

    def __init__(self, workers: SimWorkers, plan: Plan) -> None:
        self.w, self.plan, self.n = workers, plan, workers.n
        self.issued = [0] * self.n
        self.in_flight: dict[tuple[int, int], tuple[_Step, str]] = {}
        self.steps_in_flight = [0] * self.n
        self.target: int | None = None            # after the window: every worker issues this many steps
        self.step_ms: list[float] = []
        self.pull_ms: list[float] = []
        self.push_ms: list[float] = []
        self.done_in_window = 0
        self.lag: list[float] = []
        self.held = 0
        self.errors: list[str] = []
        self.t0 = self.t_end = 0.0
        period = self.n / plan.rate if plan.rate else 0.0
        self.period = period
        self.offset = [0.0 if plan.synchronous else i * period / self.n for i in range(self.n)]

    def due(self, i: int) -> float:
        return self.t0 + self.offset[i] + self.issued[i] * self.period

    def start_step(self, i: int, now: float, start: float, in_window: bool) -> None:
        pull, push = self.plan.steps[i][self.issued[i] % len(self.plan.steps[i])]
        self.issued[i] += 1
        self.steps_in_flight[i] += 1
        step = _Step(start, in_window, pull, push, pull_sent=now)
        self.in_flight[(i, self.w.send(i, pull))] = (step, "pull")

    def on_reply(self, reply: Reply, now: float) -> None:
        entry = self.in_flight.pop((reply.worker, reply.meta.timestamp), None)
        if entry is None:
            self.errors.append(f"worker {reply.worker}: a reply with timestamp {reply.meta.timestamp} to nothing")
            return
        step, kind = entry
        error = wire.reply_error(step.pull if kind == "pull" else step.push, reply.sizes)
        if error and len(self.errors) < 10:
            self.errors.append(f"worker {reply.worker}: {error}")
        if kind == "pull":
            step.pull_ms = (now - step.pull_sent) * 1e3
            self.in_flight[(reply.worker, self.w.send(reply.worker, step.push))] = (step, "push")
            step.pull_sent = now       # the push's send
            return
        self.steps_in_flight[reply.worker] -= 1
        if step.in_window:
            self.step_ms.append((now - step.start) * 1e3)
            self.pull_ms.append(step.pull_ms)
            self.push_ms.append((now - step.pull_sent) * 1e3)
            if now <= self.t_end:
                self.done_in_window += 1
        if self.plan.rate is None:
            self.maybe_next(reply.worker, now)

    def maybe_next(self, i: int, now: float) -> None:
        """Closed-loop: the next step of worker i, unless the window is over and it has issued its share."""
        if self.target is None or self.issued[i] < self.target:
            self.start_step(i, now, now, self.target is None)

    def start_due(self, now: float) -> float:
        """Open-loop: start every step that is due (within the caps); returns when the next one is due."""
        next_due = math.inf
        for i in range(self.n):
            while self.target is None or self.issued[i] < self.target:
                due = self.due(i)
                if self.target is None and due > now:
                    next_due = min(next_due, due)
                    break
                if self.steps_in_flight[i] >= self.plan.cap:
                    break
                late = now - due
                if late > HELD:        # held back by the cap (or a busy loop): its latency counts from `due`
                    self.held += 1
                else:
                    self.lag.append(max(late, 0.0))
                self.start_step(i, now, due if late > HELD else now, self.target is None)
        return next_due

    def finished(self) -> bool:
        return self.target is not None and not self.in_flight and all(k >= self.target for k in self.issued)


def run_steps(workers: SimWorkers, plan: Plan, server_pid: int | None = None) -> dict:
    """Run one phase; returns its figures (rows/s over the window, latencies of the steps started in it, the
    server's and this process's CPU per wall second). Raises LoadgenError if the drain misses its deadline."""
    pacer = _Pacer(workers, plan)
    server_cpu0 = cpu_seconds(server_pid) if server_pid else None
    own_cpu0 = time.process_time()
    pacer.t0 = now = time.perf_counter()
    pacer.t_end = pacer.t0 + plan.seconds
    if plan.rate is None:
        for i in range(workers.n):
            pacer.start_step(i, now, now, True)
    server_cpu1 = own_cpu1 = None
    hard = pacer.t_end + plan.drain_timeout
    while not pacer.finished():
        next_due = pacer.start_due(now) if plan.rate else math.inf
        if pacer.target is None:
            next_due = min(next_due, pacer.t_end)
        wait_ms = 0 if next_due <= now else max(1, math.ceil((min(next_due, now + 0.05) - now) * 1e3))
        for reply in workers.receive(wait_ms):
            pacer.on_reply(reply, time.perf_counter())
        now = time.perf_counter()
        if pacer.target is None and now >= pacer.t_end:
            server_cpu1 = cpu_seconds(server_pid) if server_pid else None
            own_cpu1 = time.process_time()
            pacer.target = max(pacer.issued)
            for i in range(workers.n):      # closed-loop workers that are idle finish their share now
                if plan.rate is None and pacer.steps_in_flight[i] == 0:
                    pacer.maybe_next(i, now)
        if now > hard:
            raise LoadgenError(f"{len(pacer.in_flight)} requests unanswered {plan.drain_timeout:.0f}s after the "
                               f"phase ended (issued per worker: {pacer.issued})")
    return _figures(pacer, plan, server_cpu0, server_cpu1, own_cpu1 - own_cpu0 if own_cpu1 is not None else None)


def _pct(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def _figures(pacer: _Pacer, plan: Plan, cpu0, cpu1, own_cpu) -> dict:
    window = pacer.t_end - pacer.t0
    batch = plan.steps[0][0][0].rows
    return {"pacing": "open" if plan.rate else "closed", "workers": pacer.n, "batch": batch,
            "seconds": window, "offered_rows_per_s": plan.rate * batch if plan.rate else None,
            "steps": pacer.done_in_window, "rows_per_s": pacer.done_in_window * batch / window,
            "server_cores": (cpu1 - cpu0) / window if cpu0 is not None and cpu1 is not None else None,
            "loadgen_cores": own_cpu / window if own_cpu is not None else None,
            "p50_ms": _pct(pacer.step_ms, 50), "p99_ms": _pct(pacer.step_ms, 99),
            "pull_p50_ms": _pct(pacer.pull_ms, 50), "push_p50_ms": _pct(pacer.push_ms, 50),
            "latency_samples": len(pacer.step_ms),
            "start_lag_ms": float(np.mean(pacer.lag)) * 1e3 if pacer.lag else None, "held_starts": pacer.held,
            "errors": pacer.errors}
