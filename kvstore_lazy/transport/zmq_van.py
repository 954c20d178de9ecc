"""ZeroMQ transport as ps-lite's ZMQVan lays it out: one ROUTER to receive, one DEALER per peer to send.

Owns: the sockets and nothing else. One thread (the caller's) owns every socket (pyzmq sockets are not thread-safe).
Does not own: ids, barriers or message meaning (``membership``, ``server``).

Wire-compatibility notes:
- Replies never go back over the ROUTER: every message goes out on the DEALER connected to the peer's ROUTER.
- A DEALER's ZMQ_IDENTITY is ``ps<id>`` and is set before connect; the first socket to the scheduler has none, which
  is how the scheduler tells a new registration.
- ``DMLC_LOCAL=1`` uses ``ipc:///tmp/<port>`` instead of TCP.
"""
from __future__ import annotations

import logging
import random

import zmq

from ..protocol.message import Message

log = logging.getLogger(__name__)

ZERO_COPY_MIN = 65536   # frames at least this large are sent and received without a copy
_NOBLOCK = int(zmq.NOBLOCK)   # a plain int: flag enums cost a Python call per use


class BindError(OSError):
    pass


class ZmqVan:
    def __init__(self, local: bool = False, water_mark: int = 0) -> None:
        self.context = zmq.Context()
        self.context.set(zmq.MAX_SOCKETS, 65536)
        self.local = local
        self.water_mark = water_mark
        self.receiver: zmq.Socket | None = None
        self.senders: dict[int, zmq.Socket] = {}
        self.poller = zmq.Poller()
        self.bytes_received = 0
        self.bytes_sent = 0

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

    def connect(self, node_id: int, host: str, port: int, identity: bytes | None) -> None:
        """(Re)open the DEALER to `node_id`; options are set before connect, as ZeroMQ requires."""
        self.disconnect(node_id)
        sock = self.context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        if identity is not None:
            sock.setsockopt(zmq.IDENTITY, identity)
            if self.water_mark:
                sock.setsockopt(zmq.SNDHWM, self.water_mark)
        sock.connect(self._address(host, port))
        self.senders[node_id] = sock

    def disconnect(self, node_id: int) -> None:
        sock = self.senders.pop(node_id, None)
        if sock is not None:
            sock.close(linger=0)

    def send(self, node_id: int, message: Message) -> int:
        sock = self.senders.get(node_id)
        if sock is None:
            log.error("no connection to node %d; dropping a message (head %s)", node_id, message.meta.head)
            return 0
        frames = message.to_frames()
        sent = sum(len(f) for f in frames)
        # Zero-copy sends pay for a zmq.Frame per part; it only wins for large payloads (pyzmq's own advice).
        sock.send_multipart(frames, copy=sent < ZERO_COPY_MIN)
        self.bytes_sent += sent
        return sent

    def recv(self, timeout_ms: int) -> list[bytes | memoryview] | None:
        """One multipart message from the ROUTER (identity first), or None after `timeout_ms`.

        With `timeout_ms` 0 (the runtime taking what is already queued) the receive is tried at once, NOBLOCK;
        else the poller waits first (an empty NOBLOCK receive raises zmq.Again, which costs three polls). The parts
        are read with the backend's recv and ``Frame.more`` instead of ``recv_multipart``, whose per-part
        ``getsockopt(RCVMORE)`` and flag enums cost more than the receive itself for small messages."""
        recv = self.receiver.recv
        if timeout_ms and not self.poller.poll(timeout_ms):
            return None
        try:
            frame = recv(_NOBLOCK, copy=False)
        except zmq.Again:   # nothing queued (or readable, then not)
            return None
        # large frames stay in ZeroMQ's buffer (a memoryview keeps it alive): no copy of pushed values
        frames = [frame.bytes]
        size = len(frames[0])
        while frame.more:   # the parts of one message arrive together: NOBLOCK never waits here
            frame = recv(_NOBLOCK, copy=False)
            n = len(frame)
            size += n
            frames.append(frame.bytes if n < ZERO_COPY_MIN else memoryview(frame))
        self.bytes_received += size
        return frames

    def close(self) -> None:
        for node_id in list(self.senders):
            self.disconnect(node_id)
        if self.receiver is not None:
            self.receiver.close(linger=0)
            self.receiver = None
        self.context.term()
