"""ZeroMQ transport as ps-lite's ZMQVan lays it out: one ROUTER to receive, one DEALER per peer to send.

Owns: the sockets and nothing else. One thread (the caller's) owns every socket (pyzmq sockets are not thread-safe).
Does not own: ids, barriers, who may send what (``membership``, ``trust``) or message meaning (``server``).

Wire-compatibility notes:
- Replies never go back over the ROUTER: every message goes out on the DEALER connected to the peer's ROUTER.
- A DEALER's ZMQ_IDENTITY is ``ps<id>`` and is set before connect; the first socket to the scheduler has none, which
  is how the scheduler tells a new registration.
- ``DMLC_LOCAL=1`` uses ``ipc:///tmp/<port>`` instead of TCP.

Beyond ps-lite (issue 11):
- Sends never block. ps-lite's ``zmq_msg_send`` blocks once a peer's queue reaches ZMQ_SNDHWM (a peer that stops
  reading stalls the node; a DEALER whose peer never connected blocks at once). Here a send that ZeroMQ cannot take
  now waits in a per-peer queue, flushed by :meth:`recv` whenever that DEALER is writable again, in order. A peer
  whose queue passes its limit (messages or bytes) is *dropped*: logged once, its queue and socket discarded, and
  :attr:`dropped` names it; every other peer keeps being served.
- Every received message comes with the TCP address it came from (ZeroMQ's ``Peer-Address`` message property), so
  the caller can check it against the address the scheduler announced for the node the identity names.
- Messages are received and sent whole, one C call each (``transport/_zmqmsg.c`` ``recv_message``/``send_message``
  on the libzmq pyzmq loaded, see :func:`native_zmq`), where pyzmq costs a Python call and a Frame per part: a 256-row
  pull is received in 5.6 us of CPU instead of 16.1 (``scripts/bench_workers/van_recv.py``). Large parts are still
  received and sent without a copy; sent ones are released by the compiled calls themselves when ZeroMQ is done
  with them (no pyzmq Frame per part, nor its garbage collector thread and GIL hand-over per message: at N=8,
  B=8192 the Python glue of each reply's sends was ~5% of the server's busy time).
- :meth:`watch` follows a DEALER's connection with a socket monitor: :meth:`link` says whether it is up, and since
  when it is down (how a dead scheduler is noticed at once).
"""
from __future__ import annotations

import collections
import ctypes
import functools
import logging
import os
import random
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

import zmq
from zmq.utils.monitor import recv_monitor_message

from kvstore_lazy.protocol.fast import REBUILD, refuse_stale
from kvstore_lazy.protocol.message import Message

log = logging.getLogger(__name__)

ZERO_COPY_MIN = 65536   # frames at least this large are sent and received without a copy
POLL_EVERY = 16         # recv(0) polls (queued sends, link monitors) at least once per this many messages taken
# plain ints: flag enums cost a Python call per use (and `|` of two of them another)
_NOBLOCK, _SNDMORE = int(zmq.NOBLOCK), int(zmq.SNDMORE)
_NOBLOCK_MORE = _NOBLOCK | _SNDMORE
# the backend's send: pyzmq's Socket.send wrapper only adds routing_id/group handling (DRAFT sockets), a Python call
# per frame of every reply
_send_frame = zmq.backend.Socket.send
QUEUE_MESSAGES = 10_000          # default per-peer limits of messages waiting beyond ZeroMQ's own queue (SNDHWM)
QUEUE_BYTES = 1 << 30


ZMQMSG_SOURCES = (Path(__file__).with_name("_zmqmsg.c"),)   # as setup.py names them


class ZmqMsgLoadError(ImportError):
    """The compiled whole-message calls (_zmqmsg.so) are missing, cannot be imported, or were built from another
    _zmqmsg.c."""


def _load_zmqmsg() -> ModuleType:
    """The compiled whole-message calls, refused if built from other sources than the ones beside this file (the
    check of the protocol's fast path: ``protocol.fast.refuse_stale``)."""
    try:
        from kvstore_lazy.transport import _zmqmsg
    except ImportError as exc:
        raise ZmqMsgLoadError(f"kvstore_lazy's compiled ZeroMQ calls (kvstore_lazy/transport/_zmqmsg.so) cannot be "
                              f"imported ({exc}): {REBUILD}") from None
    refuse_stale(_zmqmsg, ZMQMSG_SOURCES, ZmqMsgLoadError)
    return _zmqmsg


zmqmsg = _load_zmqmsg()
_recv_message, _send_message = zmqmsg.recv_message, zmqmsg.send_message


_LIBZMQ_FUNCTIONS = ("zmq_msg_init", "zmq_msg_recv", "zmq_msg_close", "zmq_msg_data", "zmq_msg_size", "zmq_msg_more",
                     "zmq_msg_gets", "zmq_send", "zmq_msg_init_data", "zmq_msg_send")
@functools.cache      # once per process
def native_zmq() -> bool:
    """Whether messages can be received and sent whole by ``_zmqmsg.recv_message``/``send_message`` (one C call per
    message instead of pyzmq's calls per part): their functions must come from the very libzmq pyzmq loaded (its
    wheel's own copy; a socket of one copy must never meet the functions of another), found as the one libzmq this
    process maps, opened RTLD_NOLOAD (only if already loaded) and checked by its version. Anywhere that does not
    hold (no /proc, two copies, a static build), pyzmq's own calls are used."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libzmq" in line.rsplit("/", 1)[-1] and "/" in line}
        if len(paths) != 1:
            return False
        lib = ctypes.CDLL(paths.pop(), mode=os.RTLD_NOLOAD | os.RTLD_LOCAL)
        major, minor, patch = ctypes.c_int(), ctypes.c_int(), ctypes.c_int()
        lib.zmq_version(ctypes.byref(major), ctypes.byref(minor), ctypes.byref(patch))
        if (major.value, minor.value, patch.value) != zmq.zmq_version_info():
            return False
        zmqmsg.set_zmq(*(ctypes.cast(getattr(lib, name), ctypes.c_void_p).value for name in _LIBZMQ_FUNCTIONS))
    except (OSError, AttributeError, ValueError):
        return False
    return True


def _io_threads() -> list[int]:
    """The thread ids of this process's ZeroMQ I/O threads (libzmq names them ``ZMQbg/IO/<n>``; a server process has
    one context); [] where /proc does not say."""
    tids = []
    try:
        tasks = list(os.scandir("/proc/self/task"))
    except OSError:
        return []
    for task in tasks:
        try:
            with open(os.path.join(task.path, "comm")) as f:
                if f.read().startswith("ZMQbg/IO/"):
                    tids.append(int(task.name))
        except OSError:         # a thread that ended meanwhile
            continue
    return tids


@functools.cache      # once per process
def _batch_allowed() -> int | None:
    """SCHED_BATCH if this process may put a thread under it (probed on a short-lived thread of our own), else None."""
    batch = getattr(os, "SCHED_BATCH", None)
    if batch is None or not hasattr(zmq, "THREAD_SCHED_POLICY"):
        return None
    allowed: list[bool] = []

    def probe() -> None:
        try:
            os.sched_setscheduler(0, batch, os.sched_param(0))
            allowed.append(True)
        except OSError:
            pass
    thread = threading.Thread(target=probe, name="sched-probe")
    thread.start()
    thread.join()
    return batch if allowed else None


class BindError(OSError):
    pass


class ConnectError(ValueError):
    """An address ZeroMQ cannot connect to (the message names it); nothing was left open."""


@dataclass
class Link:
    """What a socket monitor saw of one DEALER's connection."""

    up: bool = False
    ever_up: bool = False
    changed: float = field(default_factory=time.monotonic)   # monotonic time of the last change


@dataclass
class _Queue:
    messages: collections.deque = field(default_factory=collections.deque)   # frame lists, oldest first
    nbytes: int = 0


class ZmqVan:
    def __init__(self, local: bool = False, water_mark: int = 0, queue_messages: int = QUEUE_MESSAGES,
                 queue_bytes: int = QUEUE_BYTES, whole: bool = True) -> None:
        self.context = zmq.Context()
        self.context.set(zmq.MAX_SOCKETS, 65536)
        self.io_busy = False                # see pace
        self._io_tids: list[int] = []
        self.whole = whole and native_zmq()     # messages received and sent in one C call each (native_zmq)
        self.local = local
        self.water_mark = water_mark
        self.queue_messages = queue_messages
        self.queue_bytes = queue_bytes
        self.receiver: zmq.Socket | None = None
        self.senders: dict[int, zmq.Socket] = {}
        self.poller = zmq.Poller()
        self.bytes_received = 0
        self.bytes_sent = 0
        self.last_peer: str | None = None          # TCP address of the last message recv returned (None: ipc)
        self.queues: dict[int, _Queue] = {}          # peers with messages ZeroMQ could not take yet
        self._waiting: dict[zmq.Socket, int] = {}    # their DEALERs (polled for POLLOUT) -> node id
        self.dropped: dict[int, str] = {}            # node id -> why it was dropped
        self._monitors: dict[zmq.Socket, int] = {}   # monitor socket -> node id
        self._unpolled = 0                            # messages taken since the last poll
        self.links: dict[int, Link] = {}

    def _address(self, host: str, port: int) -> str:
        return f"ipc:///tmp/{port}" if self.local else f"tcp://{host}:{port}"

    def bind(self, host: str, port: int, max_retry: int = 40) -> int:
        """Bind the ROUTER on `port`, else (like ps-lite) on up to `max_retry` random ports in 10000..49999."""
        self.receiver = self.context.socket(zmq.ROUTER)
        self.receiver.setsockopt(zmq.LINGER, 0)
        candidates = [port] if port else []
        candidates += [10000 + random.randrange(40000) for _ in range(max_retry)]
        for candidate in candidates:
            try:
                self.receiver.bind(self._address(host or "*", candidate))
            except zmq.ZMQError:
                continue
            self.poller.register(self.receiver, zmq.POLLIN)
            return candidate
        raise BindError(f"could not bind {host}: tried {candidates[:3]}... ({len(candidates)} ports)")

    def connect(self, node_id: int, host: str, port: int, identity: bytes | None, watch: bool = False) -> None:
        """(Re)open the DEALER to `node_id`; options are set before connect, as ZeroMQ requires. With `watch`, a
        socket monitor follows the connection (:meth:`link`). Raises ConnectError (leaving nothing open) for an
        address ZeroMQ refuses."""
        self.disconnect(node_id)
        self.dropped.pop(node_id, None)
        sock = self.context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        if identity is not None:
            sock.setsockopt(zmq.IDENTITY, identity)
            if self.water_mark:
                sock.setsockopt(zmq.SNDHWM, self.water_mark)
        monitor = sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED) if watch else None
        try:
            sock.connect(self._address(host, port))
        except zmq.ZMQError as exc:
            if monitor is not None:
                sock.disable_monitor()
                monitor.close(linger=0)
            sock.close(linger=0)
            raise ConnectError(f"cannot connect to node {node_id} at {host}:{port}: {exc}") from None
        self.senders[node_id] = sock
        if monitor is not None:
            self._monitors[monitor] = node_id
            self.links[node_id] = Link()
            self.poller.register(monitor, zmq.POLLIN)

    def disconnect(self, node_id: int) -> None:
        sock = self.senders.pop(node_id, None)
        self._forget_queue(node_id, sock)
        for monitor, watched in list(self._monitors.items()):
            if watched == node_id:
                del self._monitors[monitor]
                self.poller.unregister(monitor)
                if sock is not None:
                    sock.disable_monitor()
                monitor.close(linger=0)
        self.links.pop(node_id, None)
        if sock is not None:
            sock.close(linger=0)

    def link(self, node_id: int) -> Link | None:
        """The connection state of a watched DEALER (None if not watched)."""
        return self.links.get(node_id)

    # ------------------------------------------------------------------------------------------------------------
    # sending

    def send(self, node_id: int, message: Message) -> int:
        """Send now, or queue behind what ZeroMQ could not take yet; never blocks. Returns the bytes sent or queued
        (0 if there is no connection to the node, or it was dropped)."""
        sock = self.senders.get(node_id)
        if sock is None:
            if node_id not in self.dropped:
                log.error("no connection to node %d; dropping a message (head %s)", node_id, message.meta.head)
            return 0
        frames = message.to_frames()
        size = sum(map(len, frames))
        queue = self.queues.get(node_id)
        if queue is None and self._try_send(sock, frames, size, self.whole):
            self.bytes_sent += size
            return size
        if queue is None:
            queue = self.queues[node_id] = _Queue()
            self._waiting[sock] = node_id
            self.poller.register(sock, zmq.POLLOUT)
        queue.messages.append(frames)
        queue.nbytes += size
        if len(queue.messages) > self.queue_messages or queue.nbytes > self.queue_bytes:
            self._drop(node_id, f"it stopped reading: {len(queue.messages)} messages ({queue.nbytes} bytes) "
                                f"wait beyond ZeroMQ's own queue (limits {self.queue_messages} messages, "
                                f"{self.queue_bytes} bytes)")
        return size

    @staticmethod
    def _try_send(sock: zmq.Socket, frames: list, size: int, whole: bool) -> bool:
        """One message without blocking, or False (nothing sent) if ZeroMQ's queue to the peer is full. ZeroMQ
        takes a multipart message whole once it took the first part, so only that one can fail. Parts of
        ZERO_COPY_MIN bytes or more go without a copy: nothing changes them after (a message's own buffers)."""
        if whole:
            try:
                return _send_message(sock.underlying, frames, ZERO_COPY_MIN)
            except OSError as exc:
                raise zmq.ZMQError(exc.errno) from None
        # pyzmq: zero-copy sends pay for a zmq.Frame per part; it only wins for large payloads (pyzmq's own advice)
        copy = size < ZERO_COPY_MIN
        last = len(frames) - 1
        try:
            _send_frame(sock, frames[0], _NOBLOCK_MORE if last else _NOBLOCK, copy)
        except zmq.Again:
            return False
        for i in range(1, last):
            _send_frame(sock, frames[i], _SNDMORE, copy)
        if last:
            _send_frame(sock, frames[last], 0, copy)
        return True

    def _flush(self, node_id: int) -> None:
        sock, queue = self.senders.get(node_id), self.queues.get(node_id)
        if sock is None or queue is None:
            return
        while queue.messages:
            frames = queue.messages[0]
            size = sum(map(len, frames))
            if not self._try_send(sock, frames, size, self.whole):
                return
            queue.messages.popleft()
            queue.nbytes -= size
            self.bytes_sent += size
        self._forget_queue(node_id, sock)

    def _forget_queue(self, node_id: int, sock: zmq.Socket | None) -> None:
        if self.queues.pop(node_id, None) is not None and sock is not None:
            del self._waiting[sock]
            self.poller.unregister(sock)

    def _drop(self, node_id: int, reason: str) -> None:
        log.error("dropping node %d: %s; no more messages go to it", node_id, reason)
        self.disconnect(node_id)
        self.dropped[node_id] = reason

    def pending(self, node_id: int) -> int:
        """Messages waiting for `node_id` beyond ZeroMQ's queue."""
        queue = self.queues.get(node_id)
        return len(queue.messages) if queue is not None else 0

    # ------------------------------------------------------------------------------------------------------------
    # receiving

    def recv(self, timeout_ms: int) -> list[bytes | memoryview] | None:
        """One multipart message from the ROUTER (identity first), or None after `timeout_ms` or when only queued
        sends or connection events were handled. :attr:`last_peer` is the TCP address it came from.

        Queued sends and the link monitors are serviced in the poll. It polls whenever a wait is asked for; with
        none (the runtime taking what is already queued, then waiting with a timeout again) the receive is tried at
        once, NOBLOCK, and it polls only every POLL_EVERY messages taken, if there are queued sends or monitors at
        all: a poll per message cost about as much as the receive, and most of a server's messages are taken
        without a wait. The parts are read with the backend's recv and ``Frame.more`` instead of
        ``recv_multipart``, whose per-part ``getsockopt(RCVMORE)`` and flag enums cost more than the receive itself
        for small messages."""
        if timeout_ms or ((self._waiting or self._monitors) and self._unpolled >= POLL_EVERY):
            if not self._poll(timeout_ms):
                return None
        return self._take()

    def _poll(self, timeout_ms: int) -> bool:
        """Wait up to `timeout_ms` for anything; flush writable queues, read link events; whether the ROUTER has
        a message."""
        self._unpolled = 0
        events = dict(self.poller.poll(timeout_ms))
        for sock, event in events.items():
            if sock is self.receiver:
                continue
            node_id = self._monitors.get(sock)
            if node_id is not None:
                self._link_event(node_id, sock)
            elif event & zmq.POLLOUT and sock in self._waiting:
                self._flush(self._waiting[sock])
        return self.receiver in events

    def _take(self) -> list[bytes | memoryview] | None:
        """The next message if one is queued, without waiting."""
        if self.whole:
            try:
                got = _recv_message(self.receiver.underlying, ZERO_COPY_MIN, not self.local)  # type: ignore[union-attr]
            except OSError as exc:
                raise zmq.ZMQError(exc.errno) from None
            if got is None:
                return None
            frames, self.last_peer, size = got
            self._unpolled += 1
            self.bytes_received += size
            return frames
        recv = self.receiver.recv  # type: ignore[union-attr]   # bound: recv is called after bind
        try:
            frame = recv(_NOBLOCK, copy=False)
        except zmq.Again:   # nothing queued (or readable, then not)
            return None
        self._unpolled += 1
        # large frames stay in ZeroMQ's buffer (a memoryview keeps it alive): no copy of pushed values
        frames = [frame.bytes]
        size = len(frames[0])
        while frame.more:   # the parts of one message arrive together: NOBLOCK never waits here
            frame = recv(_NOBLOCK, copy=False)
            n = len(frame)  # type: ignore[arg-type]   # pyzmq's stubs give Frame no __len__
            size += n
            frames.append(frame.bytes if n < ZERO_COPY_MIN else memoryview(frame))  # type: ignore[arg-type]
        self.bytes_received += size
        self.last_peer = None if self.local else _peer_address(frame)
        return frames

    def incoming(self) -> bool:
        """Whether a received message is waiting to be read."""
        return self.receiver is not None and bool(self.receiver.poll(0, zmq.POLLIN))

    def _link_event(self, node_id: int, monitor: zmq.Socket) -> None:
        link = self.links.get(node_id)
        while monitor.poll(0):
            event = recv_monitor_message(monitor)["event"]
            if link is None:
                continue
            up = event == zmq.EVENT_CONNECTED
            if up != link.up:
                link.up, link.changed = up, time.monotonic()
            link.ever_up |= up

    def pace(self, busy: bool) -> None:
        """How ZeroMQ's I/O thread is scheduled: under SCHED_BATCH while the serving loop is `busy`, as a normal
        thread when it mostly waits (where the kernel allows the policy: ``_batch_allowed``). Every reply's last
        part wakes that thread; as a normal thread it preempts the server's own thread at once on a busy machine (a
        context switch per reply), while a batch thread is not favoured on wake-up, so the replies of a drain go
        out together: on the step job (1 server, dist_sync) server CPU per step -6%, steps/s +12%. At light load
        there is no drain to batch, and a batch thread's late wake-up is a reply's latency: 8 workers' dense 2x3
        push+pull at 100 steps/s, p50 2.55 ms under SCHED_BATCH, 2.14 ms without (the stock server: 2.34)."""
        if busy == self.io_busy:
            return
        batch = _batch_allowed()
        if batch is None:
            return
        if not self._io_tids:       # (looked for again while none is found: a new thread names itself once it runs)
            self._io_tids = _io_threads()
        for tid in self._io_tids:
            try:
                os.sched_setscheduler(tid, batch if busy else os.SCHED_OTHER, os.sched_param(0))
            except OSError:
                pass
        self.io_busy = busy

    def close(self) -> None:
        for node_id in list(self.senders):
            self.disconnect(node_id)
        if self.receiver is not None:
            self.receiver.close(linger=0)
            self.receiver = None
        self.context.destroy(linger=0)   # term() would wait forever for a socket someone forgot
        if self.whole:
            zmqmsg.release_sent()            # the parts ZeroMQ dropped with its sockets


def _peer_address(frame: zmq.Frame) -> str | None:
    try:
        return frame.get("Peer-Address")  # type: ignore[arg-type, return-value]   # a property by name (stubs: int)
    except (zmq.ZMQError, AttributeError):   # not a TCP connection
        return None
