"""The real server process (``python -m kvstore_lazy.server``) against malformed input on its ROUTER socket.

A fake scheduler (pyzmq, 127.0.0.1) registers it as node 8 next to a fake worker (node 9) and answers its BARRIERs;
the test then plays that worker: DEALER ``ps9`` to the server's ROUTER, replies on its own ROUTER. It sends garbage,
truncated and invalid metas, wrong frame counts, bad keys/lens frames and messages from identities that are not
``ps<digits>``, interleaved with valid requests, and checks that the process stays up, answers every request whose
meta decodes (and nothing else), logs each one, and keeps the stored values. Then kStopServer and the final
BARRIER: the process must exit 0.

Every receive has a timeout; the server process has a deadline and is killed by its PID in a finally.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import zmq

from fakepeer import FakeScheduler, FakeWorker, check_reply
from kvstore_lazy.protocol import mxnet as proto
from kvstore_lazy.protocol.message import Message, decode_kv
from kvstore_lazy.protocol.pbmeta import ADD_NODE, BARRIER, WORKER, Control, Meta, Node, encode_meta

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

ROOT = Path(__file__).resolve().parents[1]
STARTUP = 60.0        # seconds for the server to register (a cold numpy import on a busy machine)
REPLY = 10.0          # seconds for any one reply
EXIT = 20.0           # seconds from the final BARRIER release to the process exit

F32 = 0
DEF = proto.command_code(proto.DEFAULT, F32)
INIT = np.array([1, 2, 3, 4], np.float32)
ROWS = np.arange(8, dtype=np.float32).reshape(4, 2)


class LiveServer:
    def __init__(self, tmp: Path) -> None:
        self.ctx = zmq.Context()
        self.scheduler = FakeScheduler(self.ctx)
        self.worker = FakeWorker(self.ctx)
        self.log_path = tmp / "server.log"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("DMLC_", "PS_", "KVSTORE_LAZY_"))}
        env.update({
            "DMLC_ROLE": "server",
            "DMLC_PS_ROOT_URI": "127.0.0.1",
            "DMLC_PS_ROOT_PORT": str(self.scheduler.port),
            "DMLC_NUM_WORKER": "1",
            "DMLC_NUM_SERVER": "1",
            "DMLC_NODE_HOST": "127.0.0.1",
            "PYTHONPATH": str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""),
        })
        with open(self.log_path, "wb") as fh:
            self.proc = subprocess.Popen([sys.executable, "-m", "kvstore_lazy.server"], env=env, stdout=fh,
                                         stderr=subprocess.STDOUT, cwd=str(ROOT), start_new_session=True)
        node = self.scheduler.register(self.worker.host, self.worker.port, timeout=STARTUP)
        assert node.hostname == "127.0.0.1"
        self.worker.connect(node.hostname, node.port)
        self.scheduler.answer_barrier(REPLY)                 # startup BARRIER(7)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> int:
        """kStopServer (simple_app, head 2) from rank 0, its reply, then the final BARRIER(7); the exit code."""
        w = self.worker
        reply = w.call(w.req.command(proto.STOP_SERVER))
        assert reply.meta.simple_app
        self.scheduler.answer_barrier(REPLY)
        return self.proc.wait(timeout=EXIT)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)
        self.worker.close()
        self.scheduler.close()
        self.ctx.term()


@pytest.fixture
def live(tmp_path):
    server = LiveServer(tmp_path)
    try:
        server.start()
        yield server
    finally:
        log = server.log() if server.log_path.exists() else ""
        server.kill()
        print(f"----- server log -----\n{log[-6000:]}")


def values(reply: Message, dtype=np.float32) -> np.ndarray:
    return np.frombuffer(decode_kv(reply.data).vals, dtype)


def init_and_check(w: FakeWorker) -> None:
    assert w.call(w.req.push(3, INIT)).data == []
    assert w.call(w.req.rsp_push(5, range(4), ROWS)).data == []
    check_values(w)


def check_values(w: FakeWorker) -> None:
    """The values init_and_check stored, answered right away (and before anything else arrives)."""
    assert values(w.call(w.req.pull(3))).tolist() == INIT.tolist()
    assert values(w.call(w.req.rsp_pull(5, [1, 3]))).tolist() == ROWS[[1, 3]].reshape(-1).tolist()


def meta_frame(w: FakeWorker, head: int = DEF, *, push: bool, pull: bool = False, data_types=()) -> tuple[bytes, Meta]:
    msg = w.req.kv(head, [], b"", push=push, pull=pull)
    msg.meta.data_type = list(data_types)
    return encode_meta(msg.meta), msg.meta


def key_bytes(*keys: int) -> bytes:
    return np.array(keys, "<u8").tobytes()


def lens_bytes(*lens: int) -> bytes:
    return np.array(lens, "<i4").tobytes()


def undecodable_metas(w: FakeWorker) -> dict[str, bytes]:
    good, _ = meta_frame(w, push=False, pull=True, data_types=[8, 11])
    with_body = encode_meta(Meta(head=0, body=b"x" * 50, request=True, app_id=0, timestamp=1, customer_id=0))
    return {
        "garbage-wire-type-7": b"\x0f\xff\xff\xff",
        "garbage-text": b"GET / HTTP/1.1\r\n\r\n",
        "truncated-varint": b"\xff",
        "tag-without-value": b"\x08",
        "truncated-meta": good[:-1],
        "truncated-body": with_body[:20],
        "varint-11-bytes": b"\x08" + b"\xff" * 10 + b"\x01",
        "field-number-0": b"\x00\x00",
        "end-group-without-start": b"\x0c",
        "control-without-cmd": b"\x1a\x02\x10\x01",
        "node-without-role": b"\x1a\x06\x08\x02\x12\x02\x10\x01",   # control{cmd=ADD_NODE, node{id=1}}
    }


def bad_requests(w: FakeWorker) -> dict[str, tuple[list[bytes], Meta]]:
    """Frames with a decodable meta: each must be answered. Push-shaped ones go to key 7 (never initialized), so
    the poison a rejected push leaves does not touch keys 3 and 5."""
    out = {}

    def add(name, head=DEF, *, push, pull=False, data=(), types=None):
        frame, meta = meta_frame(w, head, push=push, pull=pull,
                                 data_types=types if types is not None else [8, 11, 3, 11, 11][:len(data)])
        out[name] = ([frame] + list(data), meta)

    add("one-data-frame-pull", push=False, pull=True, data=[key_bytes(3)])
    add("one-data-frame-push", push=True, data=[key_bytes(7)])
    add("four-data-frames", push=True, data=[key_bytes(7), b"\0" * 16, lens_bytes(16), b"extra"])
    add("hundred-data-frames", push=True, data=[key_bytes(7)] + [b""] * 99, types=[8] + [11] * 99)
    add("keys-not-whole-uint64-pull", push=False, pull=True, data=[key_bytes(3) + b"\0\0\0\0", b""])
    add("keys-not-whole-uint64-push", push=True, data=[key_bytes(7)[:5], b"\0" * 16, lens_bytes(16)])
    add("lens-count-mismatch", push=True, data=[key_bytes(7), b"\0" * 16, lens_bytes(8, 8)])
    add("lens-not-whole-int32", push=True, data=[key_bytes(7), b"\0" * 16, b"\x10\0"])
    add("lens-disagree-with-vals", push=True, data=[key_bytes(7), b"\0" * 16, lens_bytes(12)])
    add("no-data-push", push=True)
    add("empty-keys-pull", push=False, pull=True, data=[b"", b""])
    add("garbage-key", push=False, pull=True, data=[b"\xde\xad\xbe\xef\xde\xad\xbe\xef", b""])
    add("unknown-request-type", proto.command_code(3, F32), push=False, pull=True, data=[key_bytes(3), b""])
    add("unknown-dtype", proto.command_code(proto.DEFAULT, 7), push=False, pull=True, data=[key_bytes(3), b""])
    add("negative-head", -12345, push=False, pull=True, data=[key_bytes(3), b""])
    add("rsp-duplicate-rows", proto.command_code(proto.ROW_SPARSE, F32), push=False, pull=True,
        data=[key_bytes(5, 6, 6), b""])
    add("rsp-row-beyond-input-dim", proto.command_code(proto.ROW_SPARSE, F32), push=False, pull=True,
        data=[key_bytes(5, 5 + 4), b""])
    add("wrong-dtype-pull", proto.command_code(proto.DEFAULT, 2), push=False, pull=True, data=[key_bytes(3), b""])
    add("pull-never-initialized", push=False, pull=True, data=[key_bytes(9), b""])
    return out


def expect_reply(w: FakeWorker, request: Meta) -> Message:
    reply = w.recv(REPLY)
    check_reply(reply, Message(request))
    if reply.data:   # a rejected pull: keys back, no values
        kv = decode_kv(reply.data)
        assert kv.vals == b"" and kv.lens.tolist() == [0] * len(kv.keys)
    return reply


def wait_for_log(live: LiveServer, done, timeout: float = REPLY) -> None:
    deadline = time.monotonic() + timeout
    while not done(live.log()):
        assert time.monotonic() < deadline, "the server did not log what it should have"
        assert live.alive()
        time.sleep(0.05)


def test_malformed_frames_do_not_hurt_the_server(live):
    w = live.worker
    init_and_check(w)
    undecodable = undecodable_metas(w)
    for name, frame in undecodable.items():
        w.send_frames([frame])
        w.send_frames([frame, key_bytes(3), b""])            # with data frames too
        w.expect_nothing(0.05)
        check_values(w)                                      # the next reply is the valid request's own
        assert live.alive(), name
    # an empty meta frame decodes to an all-defaults meta, whose request flag is 0: a reply, which is never served
    assert not Message.from_frames([b"ps9", b""]).meta.request
    w.send_frames([b""])
    w.expect_nothing(0.05)
    check_values(w)
    bad = bad_requests(w)
    for name, (frames, meta) in bad.items():
        w.send_frames(frames)
        expect_reply(w, meta)
        check_values(w)
        assert live.alive(), name
    # a burst without waiting: all answered, in order
    burst = list(bad.values()) * 3
    for frames, _ in burst:
        w.send_frames(frames)
    for _, meta in burst:
        expect_reply(w, meta)
    check_values(w)
    assert live.stop() == 0
    log = live.log()
    assert log.count("dropping a malformed message") == 2 * len(undecodable)
    assert log.count("bad request from worker 0 (node 9)") == 4 * len(bad)
    assert log.count("dropping a reply from worker 0 (node 9)") == 1
    assert "Traceback" not in log


def test_unidentified_senders_get_nothing_and_change_nothing(live):
    w = live.worker
    init_and_check(w)
    identities = [None, b"evil", b"ps", b"ps9x", b"PS9", b"ps-9", b"p9", b"ps\xd9\xa9", b"ps 9"]
    socks = [w.socket(identity) for identity in identities]
    for sock in socks:
        for msg in [w.req.pull(3), w.req.push(3, np.zeros(4, np.float32)), w.req.command(proto.STOP_SERVER),
                    w.req.rsp_pull(5, [0])]:
            sock.send_multipart(msg.to_frames())
    # a well-formed identity of a node the server has no connection to: handled, the reply has nowhere to go
    stranger = w.socket(b"ps77")
    stranger.send_multipart(w.req.push(3, np.zeros(4, np.float32)).to_frames())
    stranger.send_multipart(w.req.pull(3).to_frames())
    # those sockets are not ordered with ours: wait until the server has seen them all
    wait_for_log(live, lambda log: log.count("unidentified node") == 4 * len(identities)
                 and "no connection to node 77" in log)
    w.expect_nothing(0.2)
    check_values(w)                                          # no push landed, no stop happened
    assert live.alive()
    assert live.stop() == 0
    log = live.log()
    assert log.count("unidentified node") == 4 * len(identities)
    assert "Traceback" not in log


def test_control_messages_from_a_worker_do_not_hurt_the_server(live):
    """Control messages only the scheduler sends, arriving from the worker: an ADD_NODE naming an unusable or
    other address for node 9, an early BARRIER release, unknown commands, a heartbeat."""
    w = live.worker
    init_and_check(w)
    for control in [Control(cmd=ADD_NODE, nodes=[Node(role=WORKER, id=9, hostname="", port=0)]),
                    Control(cmd=ADD_NODE, nodes=[Node(role=WORKER, id=9, hostname="256.1.1.1", port=1)]),
                    Control(cmd=ADD_NODE, nodes=[Node(role=WORKER, id=9, hostname="127.0.0.1", port=1)]),
                    Control(cmd=BARRIER, barrier_group=7),
                    Control(cmd=99), Control(cmd=-1), Control(cmd=5)]:
        w.send_frames([encode_meta(Meta(control=control, timestamp=0, request=False))])
        w.expect_nothing(0.05)
        check_values(w)                                      # replies still reach the real worker 9
        assert live.alive()
    assert live.stop() == 0
    log = live.log()
    assert log.count("ignoring control command 2 from worker 0 (node 9)") == 3
    assert log.count("ignoring control command 3 from worker 0 (node 9)") == 1
    assert "Traceback" not in log


def test_requests_during_the_final_barrier_are_served(live):
    """After kStopServer the server waits in its final BARRIER(7); requests arriving meanwhile (bad ones too) are
    still answered, and the process exits 0 once the scheduler releases it."""
    w = live.worker
    init_and_check(w)
    stop = w.req.command(proto.STOP_SERVER)
    w.send(stop)
    check_reply(w.recv(REPLY), stop)
    identity, meta = live.scheduler.recv(REPLY)              # the final BARRIER request, not yet released
    assert identity == b"ps8" and meta.control.cmd == BARRIER and meta.request
    check_values(w)
    bad = w.req.pull(9)
    w.send(bad)
    expect_reply(w, bad.meta)
    w.send_frames([b"\xff"])
    # a BARRIER release from the worker does not end the scheduler's barrier
    w.send_frames([encode_meta(Meta(request=False, app_id=0, customer_id=0, timestamp=5,
                                    control=Control(cmd=BARRIER, barrier_group=7)))])
    check_values(w)
    assert live.alive()
    live.scheduler.send(Meta(request=False, app_id=0, customer_id=0, timestamp=99,
                             control=Control(cmd=BARRIER, barrier_group=7)))
    deadline = time.monotonic() + EXIT
    while live.alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert live.proc.poll() == 0, live.proc.poll()
