"""CPU per received message of the transport alone: ``python scripts/bench_workers/van_recv.py``.

A DEALER on 127.0.0.1 queues N messages shaped like a worker's requests (a 256-row row_sparse pull: meta, 2 KiB of
keys, no values, lens; and a dense 2x3 push), then ZmqVan.recv takes them all as the server's loop does (wait for
one, then take what is queued); prints this process's CPU per message (the ZeroMQ I/O thread included, as in a
server's /proc/<pid>/stat). Like core_step.py, with PYTHONPATH=<another checkout> it measures that checkout's
ZmqVan (printed first).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[2]))   # appended: PYTHONPATH wins (see core_step.py)

import zmq  # noqa: E402

import kvstore_lazy  # noqa: E402
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
    try:
        print(f"{'message':<32} {'CPU us/message (best of ' + str(args.rounds) + ')':>30}")
        for name, parts in SHAPES.items():
            best = min(measure(van, dealer, parts, args.count) for _ in range(args.rounds))
            print(f"{name:<32} {best:>30.1f}")
    finally:
        dealer.close(linger=0)
        ctx.term()
        van.close()


if __name__ == "__main__":
    main()
