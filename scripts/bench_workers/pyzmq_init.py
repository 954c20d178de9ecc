"""A minimal ps-lite *worker* in pure pyzmq (no mxnet), for lazy keys a stock MXNet 1.9.1 worker cannot even
describe: mxnet refuses an NDArray of 2**31 elements or more ((1e8, 32) fails its int32 size check, (2**40, D)
overflows the shape), so a stock worker can neither kv.init nor row_sparse_pull such a key.

It joins the job started by the stock scheduler as the only worker (DMLC_NUM_WORKER=1), as ps-lite does:
ADD_NODE without identity -> the scheduler's node list -> DEALERs with identity ps<id> -> BARRIER(7); then per key
the two requests a stock worker's kvstore_lazy.worker.init_lazy makes (the LAZY_DECLARE command, then the
row_sparse init push with no rows), timed and with the TCP bytes this process sent; then a pull and a push of a
few rows at the far end of the range (the ids a stock worker could never address); at the end kStopServer and the
final BARRIER(7), so the scheduler and servers exit 0. Records go to <out>.rank0.jsonl (see common.Results).
"""
import argparse
import json
import os
import sys
import time

import numpy as np
import zmq

sys.path.insert(0, os.path.dirname(__file__))
from common import Results, server_pids, servers_rss, tcp_bytes_sent  # noqa: E402

from kvstore_lazy.node import membership  # noqa: E402
from kvstore_lazy.protocol import mxnet as proto  # noqa: E402
from kvstore_lazy.protocol.message import KVPairs, Message, decode_kv, identity_of  # noqa: E402
from kvstore_lazy.protocol.pbmeta import ADD_NODE, WORKER, Control, Meta, Node, encode_meta  # noqa: E402

UNIFORM_007 = '["uniform", {"scale": 0.07}]'   # mx.init.Uniform(0.07).dumps()
F32 = 0

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--keys", required=True, help="rows:dim[,rows:dim...] (rows may be 2**40)")
p.add_argument("--seed", type=int, default=1)
p.add_argument("--touch", type=int, default=64, help="rows pulled and pushed at the end of each key's range")
p.add_argument("--timeout", type=float, default=60.0)
args = p.parse_args()

host = os.environ.get("DMLC_NODE_HOST", "127.0.0.1")
num_servers = int(os.environ["DMLC_NUM_SERVER"])
if num_servers != 1 or int(os.environ.get("DMLC_NUM_WORKER", "1")) != 1:
    raise SystemExit("pyzmq_init.py runs as the only worker of a job with one server")
res = Results(args.out, 0)
ctx = zmq.Context()
router = ctx.socket(zmq.ROUTER)
router.setsockopt(zmq.LINGER, 0)
port = router.bind_to_random_port(f"tcp://{host}")
van_ts = 0
customer_ts = 0


def dealer(address: str, identity: bytes | None) -> zmq.Socket:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if identity is not None:
        sock.setsockopt(zmq.IDENTITY, identity)
    sock.connect(address)
    return sock


def recv() -> Message:
    if not router.poll(int(args.timeout * 1000), zmq.POLLIN):
        raise SystemExit(f"nothing received within {args.timeout}s")
    return Message.from_frames(router.recv_multipart())


def control(sock: zmq.Socket, meta: Meta) -> None:
    global van_ts
    meta.timestamp, van_ts = van_ts, van_ts + 1
    sock.send_multipart([encode_meta(meta)])


scheduler_address = f"tcp://{os.environ['DMLC_PS_ROOT_URI']}:{os.environ['DMLC_PS_ROOT_PORT']}"
to_scheduler = dealer(scheduler_address, None)
control(to_scheduler, Meta(control=Control(cmd=ADD_NODE, nodes=[Node(role=WORKER, hostname=host, port=port)])))
reply = recv()
while reply.meta.control.cmd != ADD_NODE:
    reply = recv()
my_id = next(n.id for n in reply.meta.control.nodes if n.role == WORKER and n.hostname == host and n.port == port)
servers = {n.id: n for n in reply.meta.control.nodes if n.role == 0}
to_scheduler.close()
to_scheduler = dealer(scheduler_address, identity_of(my_id))
to_server = dealer(f"tcp://{servers[8].hostname}:{servers[8].port}", identity_of(my_id))


def barrier() -> None:
    control(to_scheduler, membership.barrier_request(membership.ALL_GROUP, 0).meta)
    while True:
        msg = recv()
        if membership.is_barrier_release(msg.meta):
            return


def request(meta: Meta, data: list[bytes] = ()) -> Message:
    """Send one customer request to server 0 and wait for its reply."""
    global customer_ts
    meta.request, meta.app_id, meta.customer_id = True, 0, 0
    meta.timestamp, customer_ts = customer_ts, customer_ts + 1
    to_server.send_multipart([encode_meta(meta)] + list(data))
    while True:
        msg = recv()
        if not msg.meta.request and msg.meta.timestamp == meta.timestamp:
            return msg


def command(head: int, body: bytes) -> Message:
    return request(Meta(head=head, body=body, simple_app=True))


def kv_request(keys, vals: bytes, lens, *, push: bool) -> Message:
    pairs = KVPairs(np.asarray(keys, np.uint64), vals, np.asarray(lens, np.int32))
    data, types = pairs.frames()
    return request(Meta(head=proto.command_code(proto.ROW_SPARSE, F32), push=push, pull=not push,
                        data_type=types), data)


barrier()
pids = server_pids()
res.add(kind="rss", what="idle", step=0, rss=servers_rss(pids))
begin = proto.server_key_begin(0, 1)
for index, item in enumerate(args.keys.split(",")):
    rows, dim = (int(x) for x in item.split(":"))
    key = 10 + index
    spec = {"key": key, "rows": rows, "row_shape": [dim], "dtype": "float32", "init": UNIFORM_007,
            "seed": args.seed, "bound": int(os.environ.get("MXNET_KVSTORE_BIGARRAY_BOUND", "1000000"))}
    sent = tcp_bytes_sent()
    t = time.perf_counter()
    command(proto.LAZY_DECLARE, json.dumps(spec).encode())     # what kvstore_lazy.worker.declare sends
    kv_request([begin + key], b"", [0], push=True)              # kv.init of an empty row_sparse array
    seconds = time.perf_counter() - t
    sent = tcp_bytes_sent() - sent
    after = servers_rss(pids)
    # rows a stock worker could never address: the last `touch` ids of the range (sorted, unique)
    ids = np.arange(rows - args.touch, rows, dtype=np.uint64)
    keys = np.concatenate([[begin + key], begin + key + ids]).astype(np.uint64)
    t = time.perf_counter()
    got = kv_request(keys, b"", [], push=False)
    pulled = decode_kv(got.data)
    values = np.frombuffer(pulled.vals, np.float32).reshape(len(ids), dim)
    grad = np.full((len(ids), dim), 0.01, np.float32)
    kv_request(keys, grad.tobytes(), [0] + [dim * 4] * len(ids), push=True)   # first push: no optimizer set
    touch_seconds = time.perf_counter() - t
    ok = bool(np.all(np.abs(values) <= 0.07) and values.std() > 0)
    res.add(kind="init", rows=rows, dim=dim, seconds=seconds, bytes_sent=sent, rss=after,
            touch_rows=len(ids), touch_seconds=touch_seconds, touch_values_ok=ok, rss_after_touch=servers_rss(pids))
    print(f"pyzmq worker: key {key} ({rows} x {dim}) init {seconds * 1e3:.1f} ms, {sent} bytes; "
          f"rows {rows - args.touch}..{rows - 1} pulled (values in [-0.07, 0.07]: {ok})", flush=True)

command(proto.STOP_SERVER, b"")
barrier()
res.add(kind="done")
for sock in (to_scheduler, to_server, router):
    sock.close(linger=0)
ctx.term()
