"""The node: one thread, one van, one clock, one table of timers, and the receive loop.

Owns: the transport (any ``transport.van.Van``: ZeroMQ in a process, in-memory in tests) and the clock
(``clock.Clock``), the one table of timers (``timers.Timers``), turning received frames into admitted messages
(malformed ones dropped with one line, every message through ``guard`` before anything reads it), the order in
which a message is handled (an ACK; a PS_RESEND duplicate; the journal before the ACK; control or request), the
serving loop with its drains and reply batches (replies held for a batch only while the loop is busy: ``Pace``,
which also tells the van, ``Van.pace``), and waiting for a condition while serving (barriers, the final
stagger).
Does not own: what a control message or a request means (the ``Handler``: ``runtime.ServerNode``), reliable
delivery (``delivery``), who may send what (``guard``), or the node's phases (``session``).

One thread owns every socket (pyzmq sockets are not thread-safe); sends never block (the van queues, and drops a
peer that stops reading).
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Protocol

from kvstore_lazy.node.clock import Clock
from kvstore_lazy.node.delivery import DUPLICATE, Delivery
from kvstore_lazy.node.errors import StartupError
from kvstore_lazy.node.timers import Timers
from kvstore_lazy.protocol import ProtocolError
from kvstore_lazy.protocol.message import Message
from kvstore_lazy.protocol.pbmeta import ACK
from kvstore_lazy.transport.van import ConnectError, Van

log = logging.getLogger("kvstore_lazy")

DRAIN_MAX = 64                  # queued messages served per loop iteration before the timers run
# Replies of a drain go out together, at most this many messages served apart: ZeroMQ wakes its I/O thread for a
# peer's pipe once per batch instead of once per reply (a step job's server CPU -8..-15%, steps/s +5..+15% measured
# with 8 and 64), and a reply waits at most REPLY_BATCH requests' work (a Trainer-like worker waits for all of them
# anyway).
REPLY_BATCH = 16
BIND_RETRY_EVERY = 0.2          # s between two tries to bind an address that is still busy (rejoin)
# The loop's busy share (of wall time not spent waiting for a message), measured over PACE_WINDOW s, tells the van
# how to schedule its own threads (Van.pace): busy from BUSY_SHARE on, idle again below IDLE_SHARE (apart, so that a
# load near one threshold does not switch it back and forth)
PACE_WINDOW = 0.25
BUSY_SHARE, IDLE_SHARE = 0.2, 0.05


class Handler(Protocol):
    """What a node serves: the meaning of messages, given to it in the order ``Node.dispatch`` fixes."""

    def write_ahead(self, msg: Message) -> None: ...

    def control(self, msg: Message) -> None: ...

    def request(self, msg: Message) -> None: ...

    def stopped(self) -> bool: ...

    def pause(self) -> bool:
        """Whether a drain should stop early (a snapshot waits for the first quiescent moment)."""
        ...


class Pace:
    """Whether the serving loop is busy, from the time it spends waiting for messages (see PACE_WINDOW): told each
    wait, it calls `pace(busy)` when the verdict changes."""

    def __init__(self, pace: Callable[[bool], None], now: float) -> None:
        self.pace, self.busy = pace, False
        self.start, self.idle = now, 0.0

    def waited(self, since: float, now: float) -> None:
        self.idle += now - since
        span = now - self.start
        if span < PACE_WINDOW:
            return
        share = 1.0 - self.idle / span
        changed = share < IDLE_SHARE if self.busy else share >= BUSY_SHARE
        if changed:
            self.busy = not self.busy
            self.pace(self.busy)
        self.start, self.idle = now, 0.0


class Node:
    """The loop of one server. `admit(msg, peer, dropped)` is guard's verdict (and its log line); `malformed()` is
    told of every message dropped before it was one (the metrics); `keep_frames`: keep the frames as received on
    each message (what the journal writes)."""

    def __init__(self, van: Van, clock: Clock, delivery: Delivery,
                 admit: Callable[[Message, str | None, str | None], bool],
                 keep_frames: bool = False, malformed: Callable[[], None] | None = None) -> None:
        self.van = van
        self.clock = clock
        self.delivery = delivery
        self.timers = Timers()
        self.admit = admit
        self.keep_frames = keep_frames
        self.malformed = malformed
        self.handler: Handler | None = None

    # ------------------------------------------------------------------------------------------------------------
    # the transport

    def bind(self, host: str, port: int) -> int:
        return self.van.bind(host, port)

    def bind_again(self, host: str, port: int, wait: float = 15.0) -> int:
        """Bind exactly `host:port`, the address of a server that died moments ago (rejoin), waiting up to `wait`
        seconds for the kernel to let it go."""
        deadline = self.clock.monotonic() + wait
        while True:
            try:
                return self.van.bind(host, port, max_retry=0)
            except OSError as exc:
                _discard_receiver(self.van)
                if self.clock.monotonic() > deadline:
                    raise StartupError(f"cannot rejoin: {host}:{port} stays busy ({exc}); is the old server still "
                                       f"running?") from None
                self.clock.sleep(BIND_RETRY_EVERY)

    def connect(self, node_id: int, host: str, port: int, identity: bytes | None, watch: bool = False) -> None:
        try:
            self.van.connect(node_id, host, port, identity=identity, watch=watch)
        except ConnectError as exc:
            raise StartupError(str(exc)) from None

    def recv(self, timeout_ms: int) -> Message | None:
        frames = self.van.recv(timeout_ms)
        if frames is None:
            return None
        try:
            msg = Message.from_frames(frames)
        except ProtocolError as exc:
            log.error("dropping a malformed message from identity %r: %s", bytes(frames[0])[:16], exc)
            if self.malformed is not None:
                self.malformed()
            return None
        if self.keep_frames:
            msg.frames = frames[1:]   # type: ignore[attr-defined]  # as received: what the journal keeps
        if not self.admit(msg, self.van.last_peer, self.van.dropped.get(msg.sender)):
            return None
        return msg

    # ------------------------------------------------------------------------------------------------------------
    # one message

    def dispatch(self, msg: Message) -> None:
        assert self.handler is not None
        cmd = msg.meta.control.cmd
        if cmd == ACK:
            self.delivery.take_ack(msg.meta.control.msg_sig)
            return
        signature = self.delivery.check_in(msg)
        if signature == DUPLICATE:
            return
        if cmd == 0:
            # write-ahead: in the journal before it is ACKed or changes anything
            self.handler.write_ahead(msg)
        if signature is not None:
            self.delivery.confirm(msg.sender, signature)
        if cmd != 0:
            self.handler.control(msg)
            return
        self.handler.request(msg)

    # ------------------------------------------------------------------------------------------------------------
    # loops

    def serve(self) -> None:
        """Serve until the handler says it stopped."""
        assert self.handler is not None
        handler = self.handler
        clock = self.clock
        pace = Pace(self.van.pace, clock.monotonic())
        while not handler.stopped():
            waited = clock.monotonic()
            msg = self.recv(self.poll_timeout())
            pace.waited(waited, clock.monotonic())
            # every message already queued before the timers (at most DRAIN_MAX; a due snapshot still looks for
            # the first quiescent moment after each message)
            served = 0
            if pace.busy:          # replies of this drain (see REPLY_BATCH), sent in order by release; a loop
                self.delivery.hold()   # that mostly waits has no drain to batch: each reply goes out at once
            while msg is not None:
                self.dispatch(msg)
                served += 1
                if served == DRAIN_MAX or handler.stopped() or handler.pause():
                    break
                if served % REPLY_BATCH == 0:
                    self.delivery.release()
                msg = self.recv(0)
            self.delivery.release(hold=False)
            self.run_timers()

    def serve_until(self, done: Callable[[], bool], timeout: float | None = None) -> bool:
        """Serve messages and timers until `done()` (False: not within `timeout` s)."""
        deadline = float("inf") if timeout is None else self.clock.monotonic() + timeout
        while not done():
            if self.clock.monotonic() > deadline:
                return False
            msg = self.recv(self.poll_timeout())
            if msg is not None:
                self.dispatch(msg)
            self.run_timers()
        return True

    def pump_for(self, seconds: float, until: Callable[[], bool] | None = None) -> None:
        """Serve incoming messages and timers for `seconds` (or until `until()` is true)."""
        end = self.clock.monotonic() + seconds
        while self.clock.monotonic() < end and not (until is not None and until()):
            msg = self.recv(max(1, min(self.poll_timeout(), int((end - self.clock.monotonic()) * 1000))))
            if msg is not None:
                self.dispatch(msg)
            self.run_timers()

    def poll_timeout(self) -> int:
        return self.timers.poll_timeout(self.clock.monotonic())

    def run_timers(self) -> None:
        self.timers.run(self.clock.monotonic())


def _discard_receiver(van: Van) -> None:
    """ZmqVan.bind leaves the ROUTER it could not bind open (and makes a new one at the next try): close it. Not
    part of the Van interface: a van that binds nothing on failure has no such attribute."""
    receiver = getattr(van, "receiver", None)
    if receiver is not None:
        receiver.close(linger=0)
        van.receiver = None   # type: ignore[attr-defined]
