"""A stock MXNet 1.9.1 worker for the init scenario of scripts/bench.py: kv.init of row_sparse keys of growing
input_dim, one after the other, each timed (rank 0's kv.init, which pushes and then waits for every worker at
kv.init's barrier), with the TCP bytes each worker sent during it and the servers' RSS right after (rank 0).

lazy: kvstore_lazy.worker.init_lazy (declare + an empty row_sparse init). stock: what a stock user does, the full
initial weight (uniform +-0.07) as row_sparse, built on rank 0 before the timer starts; the other ranks pass an
empty array of the same shape (kv.init only pushes from rank 0, so that changes nothing but their memory).
Keys go smallest first: a key the stock job cannot init ends the job, and the records so far are kept. A tiny
dense key is initialized first, untimed, so the first timed kv.init does not carry mxnet's one-off costs.
"""
import argparse
import os
import sys
import time

import mxnet as mx

sys.path.insert(0, os.path.dirname(__file__))
from common import Results, server_pids, servers_rss, stock_initial_weight, tcp_bytes_sent  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--server", required=True, choices=["lazy", "stock"])
p.add_argument("--mode", default="dist_sync")
p.add_argument("--keys", required=True, help="rows:dim[,rows:dim...]")
p.add_argument("--seed", type=int, default=1)
args = p.parse_args()

kv = mx.kv.create(args.mode)
rank = kv.rank
res = Results(args.out, rank)
pids = server_pids() if rank == 0 else []
kv._barrier()
if rank == 0:
    res.add(kind="rss", what="idle", step=0, rss=servers_rss(pids))
# untimed warm-up: the first kv.init of a process pays one-off costs inside mxnet (both servers alike)
kv.init(9, mx.nd.zeros((2, 3)))
mx.nd.waitall()

for index, item in enumerate(args.keys.split(",")):
    rows, dim = (int(x) for x in item.split(":"))
    shape, key = (rows, dim), 10 + index
    build = 0.0
    if args.server == "stock":
        value, build = stock_initial_weight(rank, shape)
    kv._barrier()
    before = servers_rss(pids) if rank == 0 else None
    sent = tcp_bytes_sent()
    t = time.perf_counter()
    if args.server == "lazy":
        from kvstore_lazy.worker import init_lazy
        init_lazy(kv, key, shape, init=mx.init.Uniform(0.07), seed=args.seed)
    else:
        kv.init(key, value)
    mx.nd.waitall()
    seconds = time.perf_counter() - t
    sent = tcp_bytes_sent() - sent
    res.add(kind="init", rows=rows, dim=dim, seconds=seconds, bytes_sent=sent, build_seconds=build,
            rss_before=before, rss=servers_rss(pids) if rank == 0 else None)
    if args.server == "stock":
        del value
    print(f"bench worker {rank}: key {key} {shape} init {seconds:.3f}s, sent {sent} bytes", flush=True)

kv._barrier()
res.add(kind="done")
