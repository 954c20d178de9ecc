"""The server process driven whole, in memory: ``runtime.ServerNode`` over ``transport.memory`` vans and a
``node.clock.FakeClock``, with a scripted scheduler and worker. No socket, no thread, no real waiting: a whole life
(registration, startup barrier, requests, kStopServer, final barrier) or a death and a rejoin runs in milliseconds,
and the timers (heartbeats, a silent scheduler's timeout) run on the fake clock.

The peers are *turns* of the MemoryNetwork: whenever the server waits for a message, they read what it sent them
and answer (see transport/memory.py). Messages are the real wire bytes (``fakepeer.Requests``, ``membership``).
"""
from __future__ import annotations

import collections
import logging
import time

import numpy as np
import pytest

from fakepeer import WORKER0, Requests, check_reply, reply_kv
from kvstore_lazy.node import membership, states, timers
from kvstore_lazy.node.clock import FakeClock
from kvstore_lazy.node.delivery import Outbox
from kvstore_lazy.node.runtime import Config, ServerNode
from kvstore_lazy.node.trust import ip_of
from kvstore_lazy.protocol import mxnet as mx
from kvstore_lazy.protocol.message import Message, identity_of
from kvstore_lazy.protocol.pbmeta import (ACK, ADD_NODE, BARRIER, HEARTBEAT, SCHEDULER, SERVER, WORKER, Control, Meta,
                                          Node)
from kvstore_lazy.transport.memory import MemoryNetwork

HOST = "127.0.0.1"
SCHEDULER_PORT, WORKER_PORT = 9000, 9100
SERVER_ID = 8
FAKE_LIMIT = 600.0        # s of fake time a test may take before it is stopped (a step that never comes)


class TimeUp(AssertionError):
    pass


def f32(*values: float) -> np.ndarray:
    return np.array(values, np.float32)


class World:
    """A MemoryNetwork on a fake clock, with a scheduler and a worker, and the servers made in it."""

    def __init__(self) -> None:
        self.clock = FakeClock()
        self.start = self.clock.monotonic()
        self.net = MemoryNetwork(now=self.clock.monotonic, wait=self._wait)
        self.scheduler = Scheduler(self)
        self.worker = Worker(self)

    def _wait(self, seconds: float) -> None:
        self.clock.advance(seconds)
        if self.elapsed() > FAKE_LIMIT:
            raise TimeUp(f"nothing happened for {FAKE_LIMIT:.0f}s of fake time")

    def elapsed(self) -> float:
        return self.clock.monotonic() - self.start

    def server(self, **settings) -> ServerNode:
        cfg = Config(root_uri=HOST, root_port=SCHEDULER_PORT, num_workers=1, num_servers=1, host=HOST,
                     stats_interval=3600.0, **settings)
        return ServerNode(cfg, van=self.net.van(HOST), clock=self.clock, resolve=lambda host: {HOST},
                          local=lambda: frozenset({ip_of(HOST)}), tune_gc=False)


class Scheduler:
    """ps-lite's scheduler for one server and one worker (Van::ProcessAddNodeCommand, barriers, heartbeats)."""

    def __init__(self, world: World) -> None:
        self.world = world
        self.van = world.net.van(HOST)
        self.van.bind(HOST, SCHEDULER_PORT)
        self.ts = 0
        self.server: Node | None = None
        self.barriers: list[int] = []       # groups asked, in order
        self.release = True                 # answer barriers
        self.released = 0
        self.heartbeats: list[float] = []   # fake times they came
        self.answer_heartbeats = True
        world.net.turns.append(self.turn)

    def turn(self) -> bool:
        did = False
        while (frames := self.van.recv(0)) is not None:
            did = True
            msg = Message.from_frames(frames)
            cmd = msg.meta.control.cmd
            if cmd == ADD_NODE:
                self._register(bytes(frames[0]), msg.meta)
            elif cmd == BARRIER:
                self.barriers.append(msg.meta.control.barrier_group)
                if not self.release:
                    continue
                self.released += 1
                self.send(Meta(request=False, app_id=0, timestamp=self._tick(),
                               control=Control(cmd=BARRIER, barrier_group=-1668298112)))
            elif cmd == HEARTBEAT:
                self.heartbeats.append(self.world.elapsed())
                if self.answer_heartbeats:
                    self.send(Meta(control=Control(cmd=HEARTBEAT, nodes=[self.node()]), timestamp=self._tick()))
        return did

    def node(self) -> Node:
        return Node(role=SCHEDULER, id=membership.SCHEDULER_ID, hostname=HOST, port=SCHEDULER_PORT)

    def _register(self, identity: bytes, meta: Meta) -> None:
        assert not identity.startswith(b"ps"), "the first ADD_NODE comes without identity"
        (node,) = meta.control.nodes
        self.server = node
        self.van.connect(SERVER_ID, node.hostname, node.port, identity_of(membership.SCHEDULER_ID))
        nodes = [Node(role=SERVER, id=SERVER_ID, hostname=node.hostname, port=node.port),
                 Node(role=WORKER, id=WORKER0, hostname=HOST, port=WORKER_PORT), self.node()]
        self.send(Meta(control=Control(cmd=ADD_NODE, nodes=nodes), timestamp=self._tick()))
        self.world.worker.connect(node.hostname, node.port)

    def send(self, meta: Meta) -> None:
        self.van.send(SERVER_ID, Message(meta))

    def _tick(self) -> int:
        ts, self.ts = self.ts, self.ts + 1
        return ts


class Worker:
    """Worker rank 0: sends its script one request at a time once the startup barrier is released (each step may
    wait for a fake time: `at`), ACKs replies (PS_RESEND), and records replies and ACKs."""

    def __init__(self, world: World) -> None:
        self.world = world
        self.van = world.net.van(HOST)
        self.van.bind(HOST, WORKER_PORT)
        self.req = Requests(WORKER0)
        self.script: collections.deque = collections.deque()   # (at, message or callable)
        self.waiting: Message | None = None
        self.replies: list[Message] = []
        self.acks: list[int] = []
        world.net.turns.append(self.turn)

    def connect(self, host: str, port: int) -> None:
        self.van.connect(SERVER_ID, host, port, identity_of(WORKER0))

    def then(self, msg, at: float = 0.0, answered: bool = True) -> None:
        """Send `msg` (or call it) once the fake clock is past `at`; wait for its reply if it is `answered`."""
        self.script.append((at, msg, answered))

    def turn(self) -> bool:
        did = False
        while (frames := self.van.recv(0)) is not None:
            did = True
            msg = Message.from_frames(frames)
            if msg.meta.control.cmd == ACK:
                self.acks.append(msg.meta.control.msg_sig)
                continue
            self.replies.append(msg)
            self.van.send(SERVER_ID, membership.ack(membership.message_signature(msg.meta, SERVER_ID, WORKER0)))
            if self.waiting is not None and msg.meta.timestamp == self.waiting.meta.timestamp:
                self.waiting = None
        if self.waiting is None and self.script and self.world.scheduler.released \
                and self.world.elapsed() >= self.script[0][0]:
            _, step, answered = self.script.popleft()
            if callable(step):
                step()
            else:
                self.van.send(SERVER_ID, step)
                self.waiting = step if answered else None
            did = True
        return did

    def reply_to(self, request: Message) -> Message:
        (reply,) = [r for r in self.replies if r.meta.timestamp == request.meta.timestamp]
        check_reply(reply, request)
        return reply


def values(reply: Message) -> list[float]:
    return np.frombuffer(reply_kv(reply).vals, np.float32).tolist()


class Died(Exception):
    """Raised from a peer's turn: the server under test is gone mid-serve (its process killed)."""


def die() -> None:
    raise Died()


# ----------------------------------------------------------------------------------------------------------------
# a whole life


def test_a_whole_life_register_barrier_serve_stop(caplog):
    caplog.set_level(logging.INFO, logger="kvstore_lazy")
    world = World()
    w = world.worker
    sync, init, push, pull = (w.req.command(mx.SYNC_MODE), w.req.push(3, f32(1, 2, 3, 4)),
                              w.req.push(3, f32(0.5, 0, -1, 2)), w.req.pull(3))
    stop = w.req.command(mx.STOP_SERVER)
    for msg in (sync, init, push, pull, stop):
        w.then(msg)
    node = world.server()
    started = time.monotonic()
    assert node.run() == 0
    assert time.monotonic() - started < 1.0
    assert world.scheduler.server is not None and world.scheduler.server.port == node.session.port
    assert world.scheduler.barriers == [membership.ALL_GROUP, membership.ALL_GROUP]   # startup, final
    assert node.session.life.history == [states.NEW, states.REGISTERING, states.STARTUP_BARRIER, states.SERVING,
                                         states.FINAL_BARRIER, states.STOPPED]
    for msg in (sync, init, push, pull, stop):
        w.reply_to(msg)
    assert values(w.reply_to(pull)) == [0.5, 0, -1, 2]
    text = caplog.text
    assert "registered as server rank 0 (node 8) of 1 servers, 1 workers" in text
    assert text.index("registered as server rank") < text.index("stopped")


def test_no_startup_barrier_release_means_no_serving():
    """A scheduler that never releases the startup barrier leaves the server waiting in that phase (heartbeating:
    the scheduler is alive), never serving."""
    world = World()
    world.scheduler.release = False
    node = world.server()
    with pytest.raises(TimeUp):
        node.run()
    assert node.session.life.history == [states.NEW, states.REGISTERING, states.STARTUP_BARRIER]
    assert world.scheduler.barriers == [membership.ALL_GROUP] and len(world.scheduler.heartbeats) > 50


# ----------------------------------------------------------------------------------------------------------------
# timers on the fake clock


def test_heartbeats_at_their_period_and_a_silent_scheduler_ends_the_server_with_3(caplog):
    world = World()
    world.scheduler.answer_heartbeats = False
    node = world.server(scheduler_timeout=30.0)      # heartbeats every 30 / 5 = 6 s
    started = time.monotonic()
    assert node.run() == 3
    assert time.monotonic() - started < 1.0
    beats = world.scheduler.heartbeats
    assert len(beats) >= 5
    gaps = np.diff(beats)
    assert np.all(np.abs(gaps - 6.0) < 1.01), gaps
    assert 30.0 < world.elapsed() < 40.0
    assert "no answer to heartbeats" in caplog.text and "KVSTORE_LAZY_SCHEDULER_TIMEOUT=30" in caplog.text
    assert node.session.life.state == states.FAILED


def test_an_answering_scheduler_keeps_the_server_up():
    world = World()
    world.worker.then(die, at=120.0)     # two minutes of fake time, then the test ends the server
    node = world.server(scheduler_timeout=30.0)
    with pytest.raises(Died):
        node.run()
    assert world.elapsed() >= 120.0
    assert len(world.scheduler.heartbeats) >= 120 // 6 - 1


def test_a_scheduler_whose_connection_closes_ends_the_server_with_3(caplog):
    world = World()
    world.worker.then(lambda: world.scheduler.van.close(), at=5.0)
    node = world.server()
    assert node.run() == 3
    assert "its connection closed" in caplog.text


def test_the_timer_table_runs_due_entries_in_order_and_bounds_the_wait():
    table, ran = timers.Timers(), []
    table.every("a", 2.0, lambda now: ran.append(("a", now)), first=10.0)
    table.every("b", 0.0, lambda now: ran.append(("b", now)), first=0.0, wakes=False)
    table.every("c", 1.0, lambda now: False, first=0.0, wakes=False)      # never done: stays due
    assert table.poll_timeout(9.5) == 500 and table.poll_timeout(0.0) == 1000
    table.run(9.0)
    table.run(10.0)
    table.run(11.0)
    table.run(12.0)
    assert ran == [("b", 9.0), ("a", 10.0), ("b", 10.0), ("b", 11.0), ("a", 12.0), ("b", 12.0)]
    assert table.due("c") == 0.0 and table.due("none") == float("inf")


# ----------------------------------------------------------------------------------------------------------------
# death and rejoin, PS_RESEND


def test_a_rejoined_server_restores_replays_and_ends_with_the_same_state(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="kvstore_lazy")
    world = World()
    w = world.worker
    durable = dict(snapshot_dir=str(tmp_path), journal=True, resend=True, snapshot_interval=5.0)
    sync, init, push1 = w.req.command(mx.SYNC_MODE), w.req.push(3, f32(1, 2, 3, 4)), w.req.push(3, f32(2, 2, 2, 2))
    push2, pull1 = w.req.push(3, f32(-1, 0.25, 8, 3)), w.req.pull(3)
    for msg in (sync, init, push1):
        w.then(msg)
    w.then(push2, at=20.0)               # after a periodic snapshot (every 5 s, at a quiescent moment)
    w.then(pull1)
    w.then(die)
    first = world.server(**durable)
    with pytest.raises(Died):
        first.run()
    assert values(w.reply_to(pull1)) == [-1, 0.25, 8, 3]
    port = world.scheduler.server.port
    assert caplog.text.count("snapshot written") >= 2          # the epoch's base, then a periodic one
    caplog.clear()

    # the worker resends its last push (PS_RESEND: no ACK seen), then pulls and stops the server
    pull2, stop = w.req.pull(3), w.req.command(mx.STOP_SERVER)
    w.replies.clear()
    w.then(push2, answered=False)
    w.then(pull2)
    w.then(stop)
    second = world.server(recovery="rejoin", port=port, **durable)
    assert second.run() == 0
    assert second.session.life.history[:3] == [states.NEW, states.REJOINING, states.SERVING]
    assert "rejoining as server rank 0 (node 8)" in caplog.text
    assert "journaled requests replayed" in caplog.text and ", 0 journaled requests replayed" not in caplog.text
    assert values(w.reply_to(pull2)) == [-1, 0.25, 8, 3]
    # the resent push was recognised: ACKed again, not answered again
    assert [r for r in w.replies if r.meta.timestamp == push2.meta.timestamp] == []
    assert membership.message_signature(push2.meta, WORKER0, SERVER_ID) in w.acks


def test_a_duplicate_request_is_acked_and_not_processed_again():
    world = World()
    w = world.worker
    sync, init = w.req.command(mx.SYNC_MODE), w.req.push(3, f32(1, 1, 1, 1))
    push, pull, stop = w.req.push(3, f32(5, 5, 5, 5)), w.req.pull(3), w.req.command(mx.STOP_SERVER)
    for msg in (sync, init, push):
        w.then(msg)
    w.then(push, answered=False)               # the same bytes again: a resend
    for msg in (pull, stop):
        w.then(msg)
    node = world.server(resend=True)
    assert node.run() == 0
    signature = membership.message_signature(push.meta, WORKER0, SERVER_ID)
    assert w.acks.count(signature) == 2
    assert len([r for r in w.replies if r.meta.timestamp == push.meta.timestamp]) == 1
    assert values(w.reply_to(pull)) == [5, 5, 5, 5]


def test_unacked_replies_are_resent_after_the_timeout():
    outbox = Outbox(timeout=1.0)
    msg = Message(Meta(head=0, timestamp=3))
    outbox.track(42, WORKER0, msg, now=10.0)
    assert outbox.due(10.5) == []
    (entry,) = outbox.due(11.0)
    assert entry[0] == WORKER0 and entry[4] == 1
    assert outbox.ack(42) and not outbox.pending and outbox.due(20.0) == []


def test_the_state_machine_refuses_a_transition_it_does_not_list():
    life = states.Life()
    with pytest.raises(states.StateError):
        life.to(states.SERVING)
    life.to(states.REGISTERING)
    life.to(states.STARTUP_BARRIER)
    life.fail()
    assert life.state == states.FAILED and life.history[-1] == states.FAILED


def test_the_loop_is_paced_busy_from_its_busy_share_with_a_band_between():
    """node.Pace: busy once a window's share of time not spent waiting reaches BUSY_SHARE, idle again only below
    IDLE_SHARE (a share in between keeps the verdict), one call at each change."""
    from kvstore_lazy.node.node import BUSY_SHARE, IDLE_SHARE, PACE_WINDOW, Pace
    calls: list[bool] = []
    pace = Pace(calls.append, 0.0)
    now = 0.0

    def window(share: float) -> None:
        nonlocal now
        for _ in range(8):                        # eight waits a window, each after its work
            work = PACE_WINDOW / 8 * share
            pace.waited(now + work, now + PACE_WINDOW / 8)
            now += PACE_WINDOW / 8
    window(0.01)
    assert calls == []
    window(BUSY_SHARE + 0.02)
    assert calls == [True] and pace.busy
    window((BUSY_SHARE + IDLE_SHARE) / 2)
    window(IDLE_SHARE + 0.01)
    assert calls == [True]
    window(IDLE_SHARE - 0.02)
    assert calls == [True, False] and not pace.busy
    window((BUSY_SHARE + IDLE_SHARE) / 2)
    assert calls == [True, False]
