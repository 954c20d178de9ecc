"""ZmqVan.recv against a real DEALER on 127.0.0.1: whole messages in order, identity first, small frames as bytes and
large ones as views of ZeroMQ's buffer, None after the timeout, and every queued message taken without waiting."""
import time

import pytest
import zmq

from kvstore_lazy.transport.zmq_van import ZERO_COPY_MIN, ZmqVan


@pytest.fixture
def pair():
    van = ZmqVan()
    port = van.bind("127.0.0.1", 0)
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.setsockopt(zmq.IDENTITY, b"ps9")
    dealer.connect(f"tcp://127.0.0.1:{port}")
    yield van, dealer
    dealer.close(linger=0)
    ctx.term()
    van.close()


def recv_within(van: ZmqVan, seconds: float = 10.0):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        frames = van.recv(100)
        if frames is not None:
            return frames
    raise AssertionError("no message within the deadline")


def test_recv_times_out_with_none(pair):
    van, _ = pair
    started = time.monotonic()
    assert van.recv(50) is None
    assert time.monotonic() - started >= 0.04
    assert van.recv(0) is None
    assert van.bytes_received == 0


def test_recv_returns_whole_messages_in_order(pair):
    van, dealer = pair
    big = bytes(range(256)) * (ZERO_COPY_MIN // 256 + 1)
    messages = [[b"meta0", b"keys", b"", b"lens"], [b"meta1"], [b"meta2", big, b"x"]]
    for parts in messages:
        dealer.send_multipart(parts)
    got = [recv_within(van)]
    deadline = time.monotonic() + 10
    while len(got) < len(messages) and time.monotonic() < deadline:
        frames = van.recv(0) or van.recv(100)   # queued ones come without waiting
        if frames is not None:
            got.append(frames)
    assert [[bytes(f) for f in frames] for frames in got] == [[b"ps9"] + parts for parts in messages]
    assert all(type(f) is bytes for frames in got[:2] for f in frames)
    assert type(got[2][2]) is memoryview and type(got[2][3]) is bytes   # the large frame is not copied
    assert van.bytes_received == sum(3 + sum(len(p) for p in parts) for parts in messages)
    assert van.recv(0) is None


def test_a_queued_message_is_taken_with_no_wait(pair):
    van, dealer = pair
    dealer.send_multipart([b"first"])
    dealer.send_multipart([b"second"])
    assert [bytes(f) for f in recv_within(van)] == [b"ps9", b"first"]
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:   # the second one is in the same TCP stream: queued soon after the first
        frames = van.recv(0)
        if frames is not None:
            assert [bytes(f) for f in frames] == [b"ps9", b"second"]
            return
        time.sleep(0.001)
    raise AssertionError("the queued message never came with timeout 0")


def test_the_whole_message_calls_are_the_transports_own_build(tmp_path, monkeypatch):
    """transport/_zmqmsg.so is built from the _zmqmsg.c beside it (setup.py's digest, written out) and refused when
    that source changed; protocol/'s compiled module has none of its calls."""
    import hashlib

    from kvstore_lazy.protocol.fast import native
    from kvstore_lazy.transport import zmq_van

    (source,) = zmq_van.ZMQMSG_SOURCES
    data = source.read_bytes()
    want = hashlib.sha256(source.name.encode() + b"\0" + str(len(data)).encode() + b"\0" + data).hexdigest()
    assert zmq_van.zmqmsg.digest() == want
    assert {p.name for p in source.parent.glob("*.[ch]")} == {source.name}
    assert not any(hasattr(native, name) for name in ("set_zmq", "recv_message", "send_message"))
    stale = tmp_path / source.name
    stale.write_bytes(data + b"\n")
    monkeypatch.setattr(zmq_van, "ZMQMSG_SOURCES", (stale,))
    with pytest.raises(zmq_van.ZmqMsgLoadError, match=r"built from another _zmqmsg\.c .*pip install"):
        zmq_van._load_zmqmsg()
