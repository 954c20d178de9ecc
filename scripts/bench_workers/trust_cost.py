"""What checking who sent each message costs the server: ``python scripts/bench_workers/trust_cost.py``.

Prints microseconds per received message for the two pieces issue 11 added to the receive path: ZeroMQ's
``Peer-Address`` of a frame received on a TCP ROUTER (127.0.0.1), and ``trust.Gate.refusal`` for an admitted
request (announced worker, its own address), with and without an allow-list. For scale: a dense push+pull round
costs the server ~1 ms and a B=8192 row_sparse step ~17 ms (README, make bench).
"""
from __future__ import annotations

import sys
import timeit
from pathlib import Path

import zmq

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from kvstore_lazy.node.membership import Roster  # noqa: E402
from kvstore_lazy.protocol.pbmeta import ADD_NODE, SCHEDULER, SERVER, WORKER, Control, Meta, Node  # noqa: E402
from kvstore_lazy.node.trust import Gate, parse_allow  # noqa: E402

N = 200_000


def per_call(fn) -> float:
    return timeit.timeit(fn, number=N) / N * 1e6


def main() -> None:
    ctx = zmq.Context()
    router, dealer = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    try:
        port = router.bind_to_random_port("tcp://127.0.0.1")
        dealer.connect(f"tcp://127.0.0.1:{port}")
        dealer.send_multipart([b"meta", b"x" * 100])
        assert router.poll(5000), "no message over 127.0.0.1"
        frames = router.recv_multipart(copy=False)
        rows = [("Frame.get('Peer-Address')", per_call(lambda: frames[-1].get("Peer-Address")))]
    finally:
        router.close(linger=0)
        dealer.close(linger=0)
        ctx.term()
    nodes = [Node(role=SERVER, id=8, hostname="127.0.0.1", port=9000),
             Node(role=WORKER, id=9, hostname="127.0.0.1", port=9001),
             Node(role=SCHEDULER, id=1, hostname="127.0.0.1", port=9091)]
    roster = Roster.from_reply(Meta(control=Control(cmd=ADD_NODE, nodes=nodes)), 1, 1)
    request = Meta(head=0, request=True, push=True)
    for allow in ("", "10.0.0.0/8,127.0.0.0/8"):
        gate = Gate(allow=parse_allow(allow))
        gate.expect_scheduler("127.0.0.1")
        gate.set_roster(roster, 8)
        assert gate.refusal(9, "127.0.0.1", request) is None
        rows.append((f"Gate.refusal, allow-list {allow or 'none'}",
                     per_call(lambda gate=gate: gate.refusal(9, "127.0.0.1", request))))
    width = max(len(name) for name, _ in rows)
    print(f"{'per received message':<{width}}  microseconds")
    for name, us in rows:
        print(f"{name:<{width}}  {us:8.2f}")


if __name__ == "__main__":
    main()
