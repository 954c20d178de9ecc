"""CPU per received and per sent message of the transport alone: ``python scripts/bench_workers/van_recv.py``.

A DEALER on 127.0.0.1 queues N messages shaped like a worker's requests (a 256-row row_sparse pull: meta, 2 KiB of
keys, no values, lens; and a dense 2x3 push), then ZmqVan.recv takes them all as the server's loop does (wait for
one, then take what is queued); then ZmqVan.send sends N replies (a 256-row pull's answer, 16 floats a row; a push's
empty reply) to a ROUTER that reads them afterwards. Prints this process's CPU per message (the ZeroMQ I/O thread
included, as in a server's /proc/<pid>/stat). The van watches one link, as a server watches the scheduler's, so
receives pay for its monitor as they do in a server. Like core_step.py, with PYTHONPATH=<another checkout> it
measures that checkout's ZmqVan (printed first).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[2]))   # appended: PYTHONPATH wins (see core_step.py)

import zmq  # noqa: E402

import kvstore_lazy  # noqa: E402
from kvstore_lazy.protocol.message import Message  # noqa: E402
from kvstore_lazy.protocol.pbmeta import Meta  # noqa: E402
from kvstore_lazy.transport.zmq_van import ZmqVan  # noqa: E402

SHAPES = {
    "row_sparse pull, 256 rows": [b"m" * 22, b"k" * 8 * 257, b"", b"l" * 4 * 257],
    "dense 2x3 push": [b"m" * 22, b"k" * 8, b"v" * 24, b"l" * 4],
}


def measure(van: ZmqVan, dealer, parts: list[bytes], count: int) -> float:
    for _ in range(count):
        dealer.send_multipart(parts)
    time.sleep(0.3)   # all of them in the ROUTER's queue
    received = 0
    started = time.process_time()
    deadline = time.monotonic() + 60
    while received < count and time.monotonic() < deadline:
        if van.recv(100) is not None:   # as the runtime's loop: wait for one, then take what is queued
            received += 1
            while van.recv(0) is not None:
                received += 1
    if received < count:
        raise SystemExit(f"received {received} of {count} messages")
    return 1e6 * (time.process_time() - started) / count


def reply(push: bool) -> Message:
    meta = Meta(head=3 if push else 0, request=False, push=push, pull=not push, app_id=0, timestamp=7,
                customer_id=0, data_type=[] if push else [8, 11, 3])
    return Message(meta, [] if push else [b"k" * 8 * 257, b"v" * 4 * 16 * 256, b"l" * 4 * 257])


REPLIES = {"row_sparse pull answer, 256 x 16": reply(False), "push reply (meta only)": reply(True)}


def measure_send(van: ZmqVan, router, message: Message, count: int) -> float:
    count = min(count, 900)   # within ZeroMQ's queue (SNDHWM 1000): every send goes out at once, none is queued
    started = time.process_time()
    for _ in range(count):
        van.send(9, message)
    cpu = time.process_time() - started
    received = 0
    deadline = time.monotonic() + 60
    while received < count and time.monotonic() < deadline:
        van.recv(1)   # what ZeroMQ could not take at once waits in the van's queue: a wait (the loop's) flushes it
        if router.poll(100):
            router.recv_multipart()
            received += 1
    if received < count:
        raise SystemExit(f"sent {count} messages, {received} arrived")
    return 1e6 * cpu / count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--count", type=int, default=4000, help="messages per shape and round")
    parser.add_argument("--rounds", type=int, default=5, help="best of this many rounds")
    args = parser.parse_args()
    print(f"kvstore_lazy from {Path(kvstore_lazy.__file__).resolve().parent}")
    van = ZmqVan()
    port = van.bind("127.0.0.1", 0)
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.setsockopt(zmq.SNDHWM, 0)
    dealer.setsockopt(zmq.IDENTITY, b"ps9")
    dealer.connect(f"tcp://127.0.0.1:{port}")
    van.receiver.setsockopt(zmq.RCVHWM, 0)
    router = ctx.socket(zmq.ROUTER)   # the replies' peer (a worker's ROUTER), and the watched link
    router.setsockopt(zmq.LINGER, 0)
    router.setsockopt(zmq.RCVHWM, 0)
    peer_port = router.bind_to_random_port("tcp://127.0.0.1")
    van.connect(9, "127.0.0.1", peer_port, b"ps8", watch=True)
    time.sleep(0.3)
    try:
        print(f"{'message':<36} {'CPU us/message (best of ' + str(args.rounds) + ')':>30}")
        for name, parts in SHAPES.items():
            best = min(measure(van, dealer, parts, args.count) for _ in range(args.rounds))
            print(f"received: {name:<26} {best:>30.1f}")
        for name, message in REPLIES.items():
            best = min(measure_send(van, router, message, args.count) for _ in range(args.rounds))
            print(f"sent: {name:<30} {best:>30.1f}")
    finally:
        dealer.close(linger=0)
        router.close(linger=0)
        ctx.term()
        van.close()


if __name__ == "__main__":
    main()
