"""Hand-built ps-lite requests as a stock MXNet 1.9.1 worker sends them, and fake peers for tests.

- :class:`Requests` builds the messages one worker customer sends (KVWorker::Send, SimpleApp::Request), with that
  customer's timestamps, keys already offset by the server's key range begin, data frames laid out as KVPairs.
- :func:`check_reply` checks a server reply against its request (KVServer::Response / SimpleApp::Response).
- :class:`FakeScheduler` and :class:`FakeWorker` are real ZeroMQ peers (pyzmq, 127.0.0.1) for a real server process:
  the scheduler's ADD_NODE reply and BARRIER answers, a worker's DEALER ``ps<id>`` and its ROUTER for replies.
  Every receive has a timeout.
"""
from __future__ import annotations

import time

import numpy as np
import zmq

from kvstore_lazy.protocol import mxnet as mx
from kvstore_lazy.protocol.message import KVPairs, Message, identity_of
from kvstore_lazy.protocol.pbmeta import (ADD_NODE, BARRIER, EMPTY, HEARTBEAT, SCHEDULER, SERVER, WORKER, Control, Meta,
                                          Node, decode_meta, encode_meta)

F32, F64, F16 = 0, 1, 2          # mshadow dtype flags
WORKER0, WORKER1 = 9, 11         # node ids of worker ranks 0 and 1
SCHEDULER_ID = 1


def dtype_of(flag: int) -> np.dtype:
    return mx.MSHADOW_DTYPES[flag]


class Requests:
    """The requests of one worker customer (KVWorker<char> + SimpleApp of a KVStoreDist), for one server."""

    def __init__(self, node_id: int = WORKER0, customer_id: int = 0, rank: int = 0, num_servers: int = 1) -> None:
        self.node_id = node_id
        self.customer_id = customer_id
        self.begin = mx.server_key_begin(rank, num_servers)
        self.ts = 0

    def _meta(self, head: int, *, push=False, pull=False, simple_app=False, body=b"") -> Meta:
        ts, self.ts = self.ts, self.ts + 1   # Customer::NewRequest: one counter for KV requests and commands
        return Meta(head=head, body=body, request=True, push=push, pull=pull, simple_app=simple_app, app_id=0,
                    timestamp=ts, customer_id=self.customer_id)

    # --- raw
    def kv(self, head: int, keys, vals: bytes, lens=None, *, push: bool, pull: bool = False) -> Message:
        """A KV request whose keys are given raw (already offset by the key range begin)."""
        pairs = KVPairs(np.array([int(k) for k in keys], np.uint64), bytes(vals),
                        np.array([] if lens is None else list(lens), np.int32))
        meta = self._meta(head, push=push, pull=pull)
        data, meta.data_type = pairs.frames()   # a pull (ZPull) has no lens: keys plus an empty vals
        return Message(meta, data, sender=self.node_id)

    def frames(self, head: int, frames: list[bytes], *, push: bool = True, pull: bool = False) -> Message:
        """A KV request with arbitrary data frames (data_type: uint64, other, int32, other...)."""
        meta = self._meta(head, push=push, pull=pull)
        meta.data_type = [8, 11, 3, 11, 11, 11][:len(frames)] + [11] * max(0, len(frames) - 6)
        return Message(meta, list(frames), sender=self.node_id)

    def command(self, head: int, body: bytes | str = b"") -> Message:
        body = body.encode() if isinstance(body, str) else body
        return Message(self._meta(head, simple_app=True, body=body), sender=self.node_id)

    # --- dense (EncodeDefaultKey, unpartitioned)
    def push(self, key: int, value, flag: int = F32, *, pull: bool = False) -> Message:
        vals = np.ascontiguousarray(value, dtype_of(flag)).tobytes()
        return self.kv(mx.command_code(mx.DEFAULT, flag), [self.begin + key], vals, [len(vals)], push=True,
                       pull=pull)

    def pushpull(self, key: int, value, flag: int = F32) -> Message:
        return self.push(key, value, flag, pull=True)

    def pull(self, key: int, flag: int = F32) -> Message:
        return self.kv(mx.command_code(mx.DEFAULT, flag), [self.begin + key], b"", push=False, pull=True)

    # --- row_sparse (EncodeRowSparseKey): master key, then master + local row id
    def rsp_keys(self, key: int, rows) -> list[int]:
        return [self.begin + key] + [self.begin + key + int(r) for r in rows]

    def rsp_push(self, key: int, rows, values, flag: int = F32) -> Message:
        rows = list(rows)
        values = np.ascontiguousarray(values, dtype_of(flag))
        row_bytes = values.size // len(rows) * values.itemsize if rows else 0
        return self.kv(mx.command_code(mx.ROW_SPARSE, flag), self.rsp_keys(key, rows), values.tobytes(),
                       [0] + [row_bytes] * len(rows), push=True)

    def rsp_pull(self, key: int, rows, flag: int = F32) -> Message:
        return self.kv(mx.command_code(mx.ROW_SPARSE, flag), self.rsp_keys(key, rows), b"", push=False, pull=True)

    # --- 2-bit compressed (EncodeCompressedKey, unpartitioned)
    def compressed_push(self, key: int, signs) -> Message:
        """Push a gradient of +threshold / -threshold / 0 per element (signs +1 / -1 / 0), quantized like MXNet."""
        payload = quantize_2bit(signs)
        return self.kv(mx.command_code(mx.COMPRESSED, F32), [self.begin + len(signs), self.begin + key], payload,
                       [0, len(payload)], push=True)

    def compressed_pull(self, key: int) -> Message:
        return self.kv(mx.command_code(mx.COMPRESSED, F32), [self.begin + key], b"", push=False, pull=True)


def quantize_2bit(signs) -> bytes:
    """Reference 2-bit packing (gradient_compression-inl.h quantize_2bit): element j is bit pair j&3 (from the most
    significant end) of byte (j&15)>>2 of float word j>>4; 0b11 is +threshold, 0b10 is -threshold, 0b00 is 0."""
    signs = list(signs)
    out = bytearray(4 * (-(-len(signs) // 16)))
    for j, s in enumerate(signs):
        if s:
            out[(j >> 4) * 4 + ((j & 15) >> 2)] |= (0b11 if s > 0 else 0b10) << (6 - 2 * (j & 3))
    return bytes(out)


def check_reply(reply: Message, request: Message) -> None:
    """What KVServer::Response / SimpleApp::Response copy from the request."""
    m, r = reply.meta, request.meta
    assert not m.request, "a reply must have request=0"
    assert m.timestamp == r.timestamp, f"reply timestamp {m.timestamp} for request {r.timestamp}"
    assert m.customer_id == r.customer_id, f"reply customer_id {m.customer_id} for request {r.customer_id}"
    assert m.app_id == 0
    assert m.head == r.head
    assert m.simple_app == r.simple_app
    if not r.simple_app:
        assert (m.push, m.pull) == (r.push, r.pull)
    assert len(m.data_type) == len(reply.data)


def reply_kv(reply: Message) -> KVPairs:
    from kvstore_lazy.protocol.message import decode_kv
    return decode_kv(reply.data)


# ----------------------------------------------------------------------------------------------------------------
# real sockets


class Timeout(AssertionError):
    pass


def _recv(sock: zmq.Socket, timeout: float) -> list[bytes]:
    if not sock.poll(int(timeout * 1000), zmq.POLLIN):
        raise Timeout(f"nothing received within {timeout}s")
    return sock.recv_multipart()


class FakeScheduler:
    """The scheduler's side of one server's life: ADD_NODE reply, BARRIER releases (ps-lite Van/Postoffice)."""

    def __init__(self, ctx: zmq.Context, host: str = "127.0.0.1", source: str | None = None) -> None:
        self.ctx = ctx
        self.host = host
        self.source = source     # the address its DEALER to the server connects from (None: the kernel's choice)
        self.router = ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.port = self.router.bind_to_random_port(f"tcp://{host}")
        self.to_server: zmq.Socket | None = None
        self.ts = 0
        self.barriers = 0
        self.heartbeats = 0
        self.answer_heartbeats = True

    def close(self) -> None:
        for sock in (self.router, self.to_server):
            if sock is not None:
                sock.close(linger=0)

    def recv(self, timeout: float = 10.0) -> tuple[bytes, Meta]:
        """The next message from the server other than a heartbeat; heartbeats are answered on the way, as the
        stock scheduler does (Van::ProcessHearbeat)."""
        deadline = time.monotonic() + timeout
        while True:
            frames = _recv(self.router, max(deadline - time.monotonic(), 0.001))
            meta = decode_meta(frames[1])
            if meta.control.cmd != HEARTBEAT:
                return frames[0], meta
            self.heartbeats += 1
            if self.answer_heartbeats and self.to_server is not None:
                self.send(Meta(control=Control(cmd=HEARTBEAT, nodes=[self.node()]), timestamp=self._tick()))

    def node(self) -> Node:
        return Node(role=SCHEDULER, id=SCHEDULER_ID, hostname=self.host, port=self.port)

    def register(self, worker_host: str, worker_port: int, timeout: float = 30.0) -> Node:
        """Wait for the server's ADD_NODE, then answer it (as ps1) listing server 8, worker 9 and the scheduler."""
        identity, meta = self.recv(timeout)
        assert meta.control.cmd == ADD_NODE, meta
        assert not identity.startswith(b"ps"), f"the first ADD_NODE must come without identity, got {identity!r}"
        (node,) = meta.control.nodes
        assert node.role == SERVER and node.id == EMPTY
        self.to_server = self.ctx.socket(zmq.DEALER)
        self.to_server.setsockopt(zmq.LINGER, 0)
        self.to_server.setsockopt(zmq.IDENTITY, identity_of(SCHEDULER_ID))
        prefix = f"{self.source}:0;" if self.source else ""
        self.to_server.connect(f"tcp://{prefix}{node.hostname}:{node.port}")
        nodes = [Node(role=SERVER, id=8, hostname=node.hostname, port=node.port),
                 Node(role=WORKER, id=9, hostname=worker_host, port=worker_port),
                 self.node()]
        self.send(Meta(control=Control(cmd=ADD_NODE, nodes=nodes), timestamp=self._tick()))
        return node

    def answer_barrier(self, timeout: float = 10.0) -> Meta:
        """Wait for the server's BARRIER(7) request (from ps8) and release it, with a garbage barrier_group as the
        stock scheduler sends."""
        identity, meta = self.recv(timeout)
        assert identity == b"ps8", identity
        assert meta.control.cmd == BARRIER and meta.request and meta.control.barrier_group == 7, meta
        self.barriers += 1
        self.send(Meta(request=False, app_id=0, customer_id=meta.customer_id, timestamp=self._tick(),
                       control=Control(cmd=BARRIER, barrier_group=-1668298112)))
        return meta

    def send(self, meta: Meta) -> None:
        assert self.to_server is not None
        self.to_server.send_multipart([encode_meta(meta)])

    def _tick(self) -> int:
        ts, self.ts = self.ts, self.ts + 1
        return ts


class FakeWorker:
    """Worker rank 0 (node 9): requests go out on DEALER ``ps9`` to the server's ROUTER, replies come back on our
    own ROUTER (from the server's DEALER ``ps8``)."""

    def __init__(self, ctx: zmq.Context, host: str = "127.0.0.1") -> None:
        self.ctx = ctx
        self.router = ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.host = host
        self.port = self.router.bind_to_random_port(f"tcp://{host}")
        self.dealer: zmq.Socket | None = None
        self.sockets: list[zmq.Socket] = [self.router]   # held until close(): a collected socket is never closed
        self.req = Requests(WORKER0)

    def close(self) -> None:
        for sock in self.sockets:
            sock.close(linger=0)

    def connect(self, host: str, port: int) -> None:
        self.server_address = f"tcp://{host}:{port}"
        self.dealer = self.socket(identity_of(WORKER0))

    def socket(self, identity: bytes | None) -> zmq.Socket:
        """Another DEALER to the server's ROUTER (identity None: ZeroMQ's automatic one)."""
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        if identity is not None:
            sock.setsockopt(zmq.IDENTITY, identity)
        sock.connect(self.server_address)
        self.sockets.append(sock)
        return sock

    def send(self, msg: Message) -> None:
        self.dealer.send_multipart(msg.to_frames())

    def send_frames(self, frames: list[bytes], sock: zmq.Socket | None = None) -> None:
        (sock or self.dealer).send_multipart(frames)

    def recv(self, timeout: float = 10.0) -> Message:
        frames = _recv(self.router, timeout)
        msg = Message.from_frames(frames)
        assert frames[0] == b"ps8", frames[0]
        return msg

    def expect_nothing(self, wait: float = 0.3) -> None:
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            if self.router.poll(10, zmq.POLLIN):
                frames = self.router.recv_multipart()
                raise AssertionError(f"unexpected message {Message.from_frames(frames).meta}")

    def call(self, msg: Message, timeout: float = 10.0) -> Message:
        """Send a request; return its reply (checked against the request)."""
        self.send(msg)
        reply = self.recv(timeout)
        check_reply(reply, msg)
        return reply


class RawWorker:
    """A ps-lite worker in pure pyzmq that registers with the *stock* scheduler like any worker (ADD_NODE from a
    DEALER without identity, then DEALERs ``ps<id>`` to the scheduler and the server), so the server serves it: the
    attacker of tests/test_trust_live.py. It takes part in the job's barriers (``barrier``) and otherwise sends
    whatever it is told. Every receive has a timeout; every socket is closed by close()."""

    def __init__(self, ctx: zmq.Context, scheduler_port: int, port: int = 0, host: str = "127.0.0.1") -> None:
        self.ctx = ctx
        self.host = host
        self.sockets: list[zmq.Socket] = []
        self.router = self._socket(zmq.ROUTER)
        if port:
            self.router.bind(f"tcp://{host}:{port}")
            self.port = port
        else:
            self.port = self.router.bind_to_random_port(f"tcp://{host}")
        self.scheduler_address = f"tcp://127.0.0.1:{scheduler_port}"
        self.van_ts = 0
        self.req: Requests | None = None
        self.node_id: int | None = None
        self.nodes: list[Node] = []
        self.inbox: list[Message] = []     # received, not yet asked for

    def _socket(self, kind: int, identity: bytes | None = None, address: str | None = None) -> zmq.Socket:
        sock = self.ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        if identity is not None:
            sock.setsockopt(zmq.IDENTITY, identity)
        if address is not None:
            sock.connect(address)
        self.sockets.append(sock)
        return sock

    def close(self) -> None:
        for sock in self.sockets:
            sock.close(linger=0)

    def register(self, timeout: float = 60.0) -> None:
        anonymous = self._socket(zmq.DEALER, None, self.scheduler_address)
        self._control(anonymous, Control(cmd=ADD_NODE, nodes=[Node(role=WORKER, hostname=self.host, port=self.port)]))
        reply = self.recv(lambda m: m.meta.control.cmd == ADD_NODE, timeout)
        self.nodes = reply.meta.control.nodes
        self.node_id = next(n.id for n in self.nodes if n.role == WORKER and (n.hostname, n.port) == (self.host,
                                                                                                     self.port))
        server = next(n for n in self.nodes if n.role == SERVER)
        self.server_address = f"tcp://{server.hostname}:{server.port}"
        anonymous.close(linger=0)
        self.to_scheduler = self._socket(zmq.DEALER, identity_of(self.node_id), self.scheduler_address)
        self.to_server = self._socket(zmq.DEALER, identity_of(self.node_id), self.server_address)
        self.req = Requests(self.node_id)

    def _control(self, sock: zmq.Socket, control: Control, request: bool = False) -> None:
        meta = Meta(control=control, timestamp=self.van_ts, request=request)
        if request:
            meta.app_id, meta.customer_id = 0, 0
        self.van_ts += 1
        sock.send_multipart([encode_meta(meta)])

    def barrier(self, group: int, timeout: float = 60.0) -> None:
        """BARRIER(group) at the scheduler, and its release; replies from the server meanwhile are dropped."""
        self._control(self.to_scheduler, Control(cmd=BARRIER, barrier_group=group), request=True)
        self.recv(lambda m: m.meta.control.cmd == BARRIER and not m.meta.request, timeout, keep_data=False)

    def recv(self, match, timeout: float = 10.0, keep_data: bool = True) -> Message:
        """The first received message `match` accepts (earlier ones wait in the inbox, data replies only if
        `keep_data`)."""
        for i, msg in enumerate(self.inbox):
            if match(msg):
                return self.inbox.pop(i)
        deadline = time.monotonic() + timeout
        while True:
            msg = Message.from_frames(_recv(self.router, max(deadline - time.monotonic(), 0.001)))
            if match(msg):
                return msg
            if keep_data or msg.meta.control.cmd:
                self.inbox.append(msg)

    def drain(self, quiet: float = 0.5) -> int:
        """Read and drop every reply until none came for `quiet` seconds; how many."""
        count = 0
        while self.router.poll(int(quiet * 1000), zmq.POLLIN):
            msg = Message.from_frames(self.router.recv_multipart())
            if msg.meta.control.cmd:
                self.inbox.append(msg)
            else:
                count += 1
        return count

    def send(self, msg: Message) -> None:
        self.to_server.send_multipart(msg.to_frames())

    def call(self, msg: Message, timeout: float = 10.0) -> Message:
        """A request to the server and its reply (by timestamp), checked against the request."""
        self.send(msg)
        reply = self.recv(lambda m: not m.meta.control.cmd and m.meta.timestamp == msg.meta.timestamp
                          and m.meta.simple_app == msg.meta.simple_app, timeout)
        check_reply(reply, msg)
        return reply

    def spoof(self, identity: bytes | None, source: str = "127.0.0.1") -> zmq.Socket:
        """A DEALER to the server's ROUTER claiming `identity`, connecting from `source`."""
        host, port = self.server_address[len("tcp://"):].rsplit(":", 1)
        return self._socket(zmq.DEALER, identity, f"tcp://{source}:0;{host}:{port}")
