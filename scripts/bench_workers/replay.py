"""Replay a worker request stream through our server in-process (no sockets, no other processes): the CPU cost
of the server's own work per step, steady enough on a loaded machine to measure an optimisation before/after.

Each step is what 2 stock workers send in scenario 3 of scripts/bench.py: per worker a row_sparse pull of B Zipf
rows, then a push of their gradients (dist_sync: the round completes on the 2nd push); or for dense keys a push
and a pull per worker. Every request goes through Message.from_frames -> KVServer.handle -> Message.to_frames,
i.e. everything the server process does but the ZeroMQ calls.

    python scripts/bench_workers/replay.py rows --batch 8192 --steps 40 [--optimizer sgd] [--profile]
    python scripts/bench_workers/replay.py dense --shape 1000x1000 --steps 40
"""
import argparse
import cProfile
import json
import os
import pickle
import pstats
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from common import ZipfRows  # noqa: E402  (puts the repo on sys.path)

from kvstore_lazy.protocol import mxnet as proto  # noqa: E402
from kvstore_lazy.protocol.message import KVPairs, Message, identity_of  # noqa: E402
from kvstore_lazy.protocol.pbmeta import Meta, encode_meta  # noqa: E402
from kvstore_lazy.server.core import KVServer  # noqa: E402

WORKERS = (9, 11)
F32 = 0


class Peer:
    def __init__(self, node_id: int) -> None:
        self.node_id, self.ts = node_id, 0

    def frames(self, meta: Meta, data=()) -> list[bytes]:
        meta.request, meta.app_id, meta.customer_id = True, 0, 0
        meta.timestamp, self.ts = self.ts, self.ts + 1
        return [identity_of(self.node_id), encode_meta(meta)] + list(data)

    def command(self, head: int, body: bytes) -> list[bytes]:
        return self.frames(Meta(head=head, body=body, simple_app=True))

    def kv(self, request_type: int, keys, vals: bytes, lens, push: bool) -> list[bytes]:
        data, types = KVPairs(np.asarray(keys, np.uint64), vals, np.asarray(lens, np.int32)).frames()
        return self.frames(Meta(head=proto.command_code(request_type, F32), push=push, pull=not push,
                                data_type=types), data)


def serve(server: KVServer, frames: list[bytes]) -> int:
    out = 0
    for _, reply in server.handle(Message.from_frames(frames)):
        out += sum(len(f) for f in reply.to_frames())
    return out


def optimizer_body(name: str) -> bytes:
    import mxnet as mx   # only to pickle the optimizer as KVStore.set_optimizer does
    opt = mx.optimizer.SGD(learning_rate=0.05, momentum=0.9, wd=1e-5) if name == "sgd" else \
        mx.optimizer.Adam(learning_rate=0.001)
    return pickle.dumps(opt, 0)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("kind", choices=["rows", "dense"])
    p.add_argument("--batch", type=int, default=8192)
    p.add_argument("--input-dim", type=int, default=1_000_000)
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--shape", default="1000x1000")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=0, help="untimed steps first")
    p.add_argument("--optimizer", default="sgd", choices=["sgd", "adam"])
    p.add_argument("--mode", default="dist_sync", choices=["dist_sync", "dist_async"])
    p.add_argument("--profile", action="store_true")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()

    server = KVServer(0, 1, len(WORKERS))
    peers = [Peer(w) for w in WORKERS]
    body = optimizer_body(args.optimizer)
    for peer in peers:
        serve(server, peer.command(proto.CONTROLLER, body))
        if args.mode == "dist_sync":
            serve(server, peer.command(proto.SYNC_MODE, b""))
    key = 3
    steps = []
    if args.kind == "rows":
        spec = {"key": key, "rows": args.input_dim, "row_shape": [args.dim], "dtype": "float32",
                "init": '["uniform", {"scale": 0.07}]', "seed": 1, "bound": 1_000_000}
        for peer in peers:
            serve(server, peer.command(proto.LAZY_DECLARE, json.dumps(spec).encode()))
        serve(server, peers[0].kv(proto.ROW_SPARSE, [key], b"", [0], push=True))
        streams = [ZipfRows(args.input_dim, args.batch, 1, r) for r in range(len(peers))]
        grad = np.random.default_rng(0).normal(0, 0.01, (args.batch, args.dim)).astype(np.float32).tobytes()
        for _ in range(args.warmup + args.steps):
            step = []
            ids = [s.next() for s in streams]
            for peer, i in zip(peers, ids):
                step.append(peer.kv(proto.ROW_SPARSE, np.concatenate([[key], key + i]), b"", [], push=False))
            for peer, i in zip(peers, ids):
                step.append(peer.kv(proto.ROW_SPARSE, np.concatenate([[key], key + i]), grad,
                                    [0] + [args.dim * 4] * len(i), push=True))
            steps.append(step)
    else:
        shape = tuple(int(x) for x in args.shape.split("x"))
        value = np.full(shape, 0.1, np.float32).tobytes()
        serve(server, peers[0].kv(proto.DEFAULT, [key], value, [len(value)], push=True))
        grad = np.full(shape, 0.01, np.float32).tobytes()
        for _ in range(args.warmup + args.steps):
            step = [peer.kv(proto.DEFAULT, [key], grad, [len(grad)], push=True) for peer in peers]
            step += [peer.kv(proto.DEFAULT, [key], b"", [], push=False) for peer in peers]
            steps.append(step)

    for step in steps[:args.warmup]:
        for frames in step:
            serve(server, frames)
    profiler = cProfile.Profile(time.process_time) if args.profile else None
    cpu, wall = time.process_time(), time.perf_counter()
    if profiler:
        profiler.enable()
    sent = 0
    for step in steps[args.warmup:]:
        for frames in step:
            sent += serve(server, frames)
    if profiler:
        profiler.disable()
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    result = {"kind": args.kind, "steps": args.steps, "cpu_ms_per_step": cpu / args.steps * 1e3,
              "wall_ms_per_step": wall / args.steps * 1e3, "reply_bytes": sent,
              "rows_stored": sum(s["rows"] for s in server.stats()["sparse"].values())}
    if args.json:
        print(json.dumps(result))
    else:
        print(f"{args.kind} {args.batch if args.kind == 'rows' else args.shape} {args.mode} {args.optimizer}: "
              f"{result['cpu_ms_per_step']:.2f} ms CPU/step ({result['wall_ms_per_step']:.2f} ms wall), "
              f"{result['rows_stored']} rows stored")
    if profiler:
        pstats.Stats(profiler).sort_stats("tottime").print_stats(18)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
