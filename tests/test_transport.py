"""kvstore_lazy.transport.zmq_van with real ZeroMQ sockets on 127.0.0.0/8 (issue 11).

- every received message carries the TCP address it came from (ZeroMQ's Peer-Address), the claimed identity
  notwithstanding;
- sends never block: a peer that does not read (or was never there) gets a queue, flushed in order once it reads;
  past the limit it is dropped, logged once, and the other peers keep being served;
- an address ZeroMQ refuses leaves nothing open, so closing the van cannot hang in context.term();
- a watched DEALER's link goes down when the peer's process closes its socket;
- messages received and sent whole by the compiled path (``_zmqmsg.recv_message``/``send_message``) are the ones
  pyzmq's per-part calls give: every test runs with both (``whole``).
Every receive and wait has a deadline.
"""
from __future__ import annotations

import logging
import os
import sys
import threading
import time

import pytest
import zmq

from cluster import free_port
from kvstore_lazy.protocol.message import Message, identity_of
from kvstore_lazy.protocol.pbmeta import Meta
from kvstore_lazy.transport import zmq_van
from kvstore_lazy.transport.zmq_van import ConnectError, ZmqVan


@pytest.fixture(params=[True, False], ids=["whole", "pyzmq"])
def van(request):
    v = ZmqVan(whole=request.param)
    assert v.whole == request.param, "the compiled path did not load (zmq_van.native_zmq)"
    v.bind("127.0.0.1", 0)
    yield v
    closer = threading.Thread(target=v.close, daemon=True)
    closer.start()
    closer.join(10)
    assert not closer.is_alive(), "ZmqVan.close() hung"


class Sockets:
    """The test's own sockets, every one closed at teardown (a socket left to the garbage collector is never
    closed, and then the context's term() waits for it forever)."""

    def __init__(self) -> None:
        self.context = zmq.Context()
        self.sockets: list[zmq.Socket] = []

    def socket(self, kind: int) -> zmq.Socket:
        sock = self.context.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        self.sockets.append(sock)
        return sock

    def close(self) -> None:
        for sock in self.sockets:
            sock.close(linger=0)
        self.context.term()


@pytest.fixture
def ctx():
    sockets = Sockets()
    yield sockets
    sockets.close()


def port_of(van: ZmqVan) -> int:
    return int(van.receiver.getsockopt(zmq.LAST_ENDPOINT).decode().rsplit(":", 1)[1])


def recv(van: ZmqVan, timeout: float = 5.0) -> list:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        frames = van.recv(50)
        if frames is not None:
            return frames
    raise AssertionError(f"nothing received within {timeout}s")


def dealer(ctx: Sockets, address: str, identity: bytes) -> zmq.Socket:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, identity)
    sock.connect(address)
    return sock


def message(ts: int, payload: bytes = b"") -> Message:
    meta = Meta(head=0, timestamp=ts, request=False)
    data = []
    if payload:
        data, meta.data_type = [payload], [11]
    return Message(meta, data)


def test_each_message_says_which_address_it_came_from(van, ctx):
    port = port_of(van)
    honest = dealer(ctx, f"tcp://127.0.0.1:{port}", b"ps9")
    # another loopback source address claiming the same identity: ZeroMQ's "source;destination" endpoint
    spoof = dealer(ctx, f"tcp://127.0.0.2:0;127.0.0.1:{port}", b"ps11")
    honest.send_multipart([b"meta-a", b"data"])
    frames = recv(van)
    assert [bytes(f) for f in frames] == [b"ps9", b"meta-a", b"data"] and van.last_peer == "127.0.0.1"
    spoof.send_multipart([b"meta-b"])
    frames = recv(van)
    assert bytes(frames[0]) == b"ps11" and van.last_peer == "127.0.0.2"


def test_sends_never_block_and_a_peer_that_does_not_read_is_dropped(van, ctx, caplog):
    # node 11 has a ROUTER that never reads and small buffers; node 9 reads everything
    lazy = ctx.socket(zmq.ROUTER)
    lazy.setsockopt(zmq.RCVBUF, 4096)
    lazy_port = lazy.bind_to_random_port("tcp://127.0.0.1")
    reader = ctx.socket(zmq.ROUTER)
    reader_port = reader.bind_to_random_port("tcp://127.0.0.1")
    van.queue_messages, van.queue_bytes = 200, 1 << 30   # beyond ZeroMQ's own 1000 (SNDHWM) and TCP's buffers
    van.connect(11, "127.0.0.1", lazy_port, identity_of(8))
    van.connect(9, "127.0.0.1", reader_port, identity_of(8))
    payload = b"x" * 20000
    got = []

    def read() -> None:
        while reader.poll(0):
            got.append(Message.from_frames(reader.recv_multipart()).meta.timestamp)

    started = time.monotonic()
    with caplog.at_level(logging.ERROR):
        for ts in range(3000):
            van.send(11, message(ts, payload))
            van.send(9, message(ts))
            van.recv(0)                                   # the loop: flushes what became writable
            read()
            while van.pending(9) > 20 and time.monotonic() - started < 15:
                # node 9 reads everything: on a loaded machine ZeroMQ's I/O thread may lag the loop, so node 9
                # is given time to read what reached it rather than being taken for a peer that stopped reading
                van.recv(1)
                reader.poll(5)
                read()
    assert time.monotonic() - started < 20               # a blocking send would hang here for good
    assert list(van.dropped) == [11] and "stopped reading" in van.dropped[11]
    assert [r.getMessage() for r in caplog.records].count(van_drop_line(caplog)) == 1   # logged once
    assert van.send(11, message(1)) == 0 and 11 not in van.senders
    deadline = time.monotonic() + 10
    while len(got) < 3000 and time.monotonic() < deadline:   # node 9 got every message, in order
        van.recv(10)
        read()
    assert got == list(range(3000))


def van_drop_line(caplog) -> str:
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("dropping node 11")]
    assert lines, "the drop was not logged"
    return lines[0]


def test_queued_messages_go_out_in_order_once_the_peer_appears(van, ctx):
    # a DEALER whose peer is not listening yet: once ZeroMQ's own queue (SNDHWM, 1000) is full, ps-lite's send
    # blocks; here the rest waits in the van's queue
    port = free_port()   # (closed synchronously: a ZeroMQ socket's close may still accept the van's connect)
    van.connect(9, "127.0.0.1", port, identity_of(8))
    started = time.monotonic()
    for ts in range(1500):
        assert van.send(9, message(ts)) > 0
    assert time.monotonic() - started < 10
    assert van.pending(9) >= 400
    late = ctx.socket(zmq.ROUTER)
    late.bind(f"tcp://127.0.0.1:{port}")
    got = []
    deadline = time.monotonic() + 20
    while len(got) < 1500 and time.monotonic() < deadline:
        van.recv(5)
        while late.poll(0):
            got.append(Message.from_frames(late.recv_multipart()).meta.timestamp)
    assert got == list(range(1500)) and van.pending(9) == 0


@pytest.mark.parametrize("host, port", [("127.0.0.1", -1), ("10.1.2.3", -65536)])
def test_a_refused_address_leaves_nothing_open(van, host, port):
    """What ZeroMQ itself refuses (membership.check_address refuses much more before the runtime connects)."""
    before = len(van.senders)
    with pytest.raises(ConnectError, match=f"node 9 at {host}:{port}"):
        van.connect(9, host, port, identity_of(8), watch=True)
    assert len(van.senders) == before and van.link(9) is None
    # (the van fixture then checks close() returns: a leaked socket made context.term() wait forever)


def test_a_watched_link_goes_down_when_the_peer_closes(van, ctx):
    peer = ctx.socket(zmq.ROUTER)
    port = peer.bind_to_random_port("tcp://127.0.0.1")
    van.connect(1, "127.0.0.1", port, identity_of(8), watch=True)

    def wait(up: bool) -> None:
        deadline = time.monotonic() + 10
        while van.link(1).up != up:
            assert time.monotonic() < deadline, f"link never went {'up' if up else 'down'}"
            van.recv(20)

    wait(True)
    assert van.link(1).ever_up
    peer.close(linger=0)
    wait(False)
    assert time.monotonic() - van.link(1).changed < 5
    van.disconnect(1)
    assert van.link(1) is None


def test_taking_queued_messages_still_services_links_and_queued_sends(van, ctx):
    """recv(0) in a drain polls only every POLL_EVERY messages, but it does poll: a watched link's events are read
    and a queue waiting for its peer is flushed while messages keep arriving, with no recv that waits."""
    peer = ctx.socket(zmq.ROUTER)
    port = peer.bind_to_random_port("tcp://127.0.0.1")
    van.connect(1, "127.0.0.1", port, identity_of(8), watch=True)
    late_port = free_port()
    van.connect(9, "127.0.0.1", late_port, identity_of(8))
    for ts in range(1200):      # past ZeroMQ's queue to a peer that is not there yet: the rest waits in the van
        van.send(9, message(ts))
    assert van.pending(9) > 0
    late = ctx.socket(zmq.ROUTER)
    late.bind(f"tcp://127.0.0.1:{late_port}")
    sender = dealer(ctx, f"tcp://127.0.0.1:{port_of(van)}", b"ps11")
    got, taken = [], 0
    deadline = time.monotonic() + 20
    while (len(got) < 1200 or not van.link(1).up) and time.monotonic() < deadline:
        for ts in range(zmq_van.POLL_EVERY):
            sender.send_multipart([b"m", b"%d" % ts])
        time.sleep(0.005)
        while van.recv(0) is not None:   # only ever takes what is queued: the drain of the server's loop
            taken += 1
        while late.poll(0):
            got.append(Message.from_frames(late.recv_multipart()).meta.timestamp)
    assert van.link(1).up, "the watched link's events were never read"
    assert got == list(range(1200)) and van.pending(9) == 0
    assert taken > 0


def test_whole_messages_are_the_parts_pyzmq_gives(van, ctx):
    """Small parts come as bytes and large ones (ZERO_COPY_MIN on) as writable memoryviews that stay valid after
    later messages; the peer's address, the bytes counted and a large reply (sent without a copy: through pyzmq's
    zero-copy path, or the compiled calls') are those of the per-part path."""
    port = port_of(van)
    sock = dealer(ctx, f"tcp://127.0.0.1:{port}", b"ps9")
    big = bytes(range(256)) * (zmq_van.ZERO_COPY_MIN // 256 + 3)
    sock.send_multipart([b"meta", b"", big, b"lens"])
    first = recv(van)
    sock.send_multipart([b"again", big[::-1]])
    second = recv(van)
    assert [type(f) for f in first] == [bytes, bytes, bytes, memoryview, bytes]
    assert [bytes(f) for f in first] == [b"ps9", b"meta", b"", big, b"lens"] and bytes(second[2]) == big[::-1]
    assert not first[3].readonly and van.last_peer == "127.0.0.1"
    assert van.bytes_received == (3 + 4 + len(big) + 4) + (3 + 5 + len(big))
    peer = ctx.socket(zmq.ROUTER)
    peer_port = peer.bind_to_random_port("tcp://127.0.0.1")
    van.connect(1, "127.0.0.1", peer_port, identity_of(8))
    reply = Message(Meta(head=0, timestamp=7, request=False, data_type=[11, 11]), [b"k" * 8, big])
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not peer.poll(50):
        van.send(1, message(1))       # until the connection is up (nothing queued beyond ZeroMQ's own queue)
    got = []
    van.send(1, reply)
    while time.monotonic() < deadline and (not got or got[-1].meta.timestamp != 7):
        if peer.poll(50):
            got.append(Message.from_frames(peer.recv_multipart()))
    assert got and got[-1].meta.timestamp == 7 and [bytes(d) for d in got[-1].data] == [b"k" * 8, big]
    assert [m.meta.timestamp for m in got[:-1]] == [1] * (len(got) - 1)


def test_a_part_sent_without_a_copy_is_held_until_zeromq_is_done_with_it(ctx):
    """The compiled sends hand a large part to ZeroMQ as it is: its object is held (one reference) while ZeroMQ may
    read it and released by a later call once ZeroMQ is done, also for a message it could not take now; the peer
    gets its bytes."""
    van = ZmqVan(whole=True)
    assert van.whole
    try:
        van.bind("127.0.0.1", 0)
        peer = ctx.socket(zmq.ROUTER)
        peer_port = peer.bind_to_random_port("tcp://127.0.0.1")
        van.connect(1, "127.0.0.1", peer_port, identity_of(8))
        big = bytes(range(256)) * (zmq_van.ZERO_COPY_MIN // 256 + 3)
        held = sys.getrefcount(big)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not peer.poll(50):
            van.send(1, message(1))
        while peer.poll(0):
            peer.recv_multipart()
        for ts in range(3):
            van.send(1, Message(Meta(head=0, timestamp=ts, request=False, data_type=[11]), [big]))
        got = []
        while time.monotonic() < deadline and len(got) < 3:
            if peer.poll(50):
                got.append(Message.from_frames(peer.recv_multipart()))
        assert [bytes(m.data[0]) == big for m in got] == [True] * 3
        while time.monotonic() < deadline and sys.getrefcount(big) > held:
            zmq_van.zmqmsg.release_sent()    # (every receive and send does it too)
            time.sleep(0.01)
        assert sys.getrefcount(big) == held
    finally:
        van.close()


def test_pace_puts_the_io_thread_under_sched_batch_while_busy_and_back_when_idle():
    """ZmqVan.pace: ZeroMQ's I/O thread under SCHED_BATCH while the loop is busy, a normal thread otherwise."""
    if zmq_van._batch_allowed() is None:
        pytest.skip("this kernel does not let the process use SCHED_BATCH")
    before = set(zmq_van._io_threads())         # (other tests' contexts may still have theirs)
    v = ZmqVan()
    try:
        v.bind("127.0.0.1", 0)                   # (the first socket starts the I/O thread)
        # libzmq's thread names itself once it runs: until then /proc shows it under the process's name
        deadline = time.monotonic() + 10
        tids = set(zmq_van._io_threads()) - before
        while not tids and time.monotonic() < deadline:
            time.sleep(0.01)
            tids = set(zmq_van._io_threads()) - before
        assert tids, "no ZMQbg/IO thread found in /proc/self/task"
        assert {os.sched_getscheduler(t) for t in tids} == {os.SCHED_OTHER}
        v.pace(True)
        assert v.io_busy and {os.sched_getscheduler(t) for t in tids} == {os.SCHED_BATCH}
        v.pace(False)
        assert not v.io_busy and {os.sched_getscheduler(t) for t in tids} == {os.SCHED_OTHER}
    finally:
        v.close()
