"""The disk-scale scenario's one worker process (issue 29): W simulated workers (``loadgen.SimWorkers``) take one
server with a memory budget and a disk tier through every phase of a job's life, at hundreds of millions of rows of a
(2^40, D) SGD-momentum key with hashed ids, and measure the server's RSS in each phase.

Owns: the phases, the ids they touch, the checks of what comes back, and the per-phase memory figures (the server's
VmRSS sampled every 0.1 s, its VmHWM reset at each phase's start through ``/proc/<pid>/clear_refs``), written as
JSON lines to <out>.rank0.jsonl (``common.Results``) and the sample rows to <out>.sample.npz.
Does not own: sockets, registration and barriers (``loadgen``), request bytes (``loadgen_wire``: a stock worker's),
the tables (``bench.py``, scenario disk-scale), the server.

Two jobs, one server each, on the same snapshot and disk directories:

- ``--role train``: fill (each worker pushes B fresh hashed rows per dist_sync step until --rows exist); a full
  snapshot as a job asks for one (LAZY_SNAPSHOT, ``kvstore_lazy.worker.snapshot``: the tagged snapshot, written
  before the answer, then the periodic chain's next snapshot, a base, written before the next request: a LAZY_STATS
  ends that phase); Zipf(1.2) pull + push steps over the rows; LAZY_SNAPSHOT again (tagged, then the chain's delta);
  ``fetch_rows`` of the whole key with the requests ``kvstore_lazy.worker.fetch_rows`` makes (LAZY_ROWS, the header
  and the listed ids through ROWS_HEADER_KEY, then the rows, in pieces of FETCH_BYTES of reply),
  each piece checked and dropped. Then it leaves without kStopServer, as a preempted job: the launcher stops the
  server, which writes no shutdown snapshot, so the chain on disk is base + delta.
- ``--role restore``: the server starts with KVSTORE_LAZY_RESUME=latest on that chain (base and delta folded, the
  disk store linked back and verified before its startup barrier); the workers join as the same job again (their
  init and optimizer are dropped by the server's resume gate), check the row count and the sample rows, then stop
  the server (kStopServer: its shutdown snapshot, a full base, is the last phase).

Checks (recorded, asserted by tests/test_disk_scale.py): the listing is sorted, unique, --rows long, and its ids hash
(a sum of splitmix64 over the ids, order-free) to the trained ids'; a sample of rows (their initial values pulled
just before their push) fetched equal to ``init - lr * grad`` exactly (lr and the gradients are powers of two
times small integers, weight decay 0: one float32 rounding, as MXNet's sgd_mom_update does it) unless a Zipf step
touched them after; after the restore, the same count and the sample equal bit for bit to what the fetch returned.

Ids: counter c -> a bijection of [0, 2^40) (:func:`hashed`), so N counters are N distinct ids spread over the key as
hashed feature ids are; Zipf rank r is counter r (the popular ids are the first trained).

    DMLC_* (from the launcher, DMLC_NUM_WORKER=W) python scripts/bench_workers/scale_job.py --out OUT
        --role train|restore [--rows 2000000] [--dim 8] [--batch 16384] [--zipf-steps 10] [--sample 4096]
        [--expect TRAIN_OUT.sample.npz] [--dirs DIR,...]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
import loadgen_wire as wire  # noqa: E402
from common import Results, ZipfRows, cpu_seconds, server_pids  # noqa: E402
from loadgen import LoadgenError, SimWorkers  # noqa: E402

from kvstore_lazy.protocol import mxnet as proto  # noqa: E402
from kvstore_lazy.protocol.kv import RowsHeader  # noqa: E402
from kvstore_lazy.protocol.message import KVPairs, decode_kv  # noqa: E402
from kvstore_lazy.protocol.pbmeta import Meta  # noqa: E402
from kvstore_lazy.worker import piece_rows  # noqa: E402

KEY = 3
ID_BITS = 40
KEY_ROWS = 1 << ID_BITS
LR = 0.25                  # with weight decay 0 and gradients (1 + id % 5) / 128: lr * grad is exact in float32
F64_HEAD = proto.command_code(proto.ROW_SPARSE, proto.DTYPE_FLAGS[np.dtype(np.float64)])
_M40 = np.uint64(KEY_ROWS - 1)


# ----------------------------------------------------------------------------------------------------------------
# ids, gradients, checks

def hashed(counters: np.ndarray, seed: int) -> np.ndarray:
    """A bijection of [0, 2^40) (an offset, odd multipliers and xor-shifts, all mod 2^40): distinct counters give
    distinct ids, spread over the whole key. int64."""
    x = (np.asarray(counters, np.uint64) + np.uint64(seed * 0x9E3779B1)) & _M40
    x = (x * np.uint64(0x7F4A7C15F39CC061 & (KEY_ROWS - 1) | 1)) & _M40
    x ^= x >> np.uint64(21)
    x = (x * np.uint64(0x1CE4E5B9BF58476D & (KEY_ROWS - 1) | 1)) & _M40
    x ^= x >> np.uint64(19)
    return x.astype(np.int64)


def id_hash(ids: np.ndarray) -> int:
    """Order-free digest of a set of ids: the sum (mod 2^64) of splitmix64's finalizer of each."""
    x = np.asarray(ids, np.uint64).copy()
    x ^= x >> np.uint64(30)
    x *= np.uint64(0xBF58476D1CE4E5B9)
    x ^= x >> np.uint64(27)
    x *= np.uint64(0x94D049BB133111EB)
    x ^= x >> np.uint64(31)
    return int(x.sum(dtype=np.uint64))


def gradients(ids: np.ndarray, dim: int) -> np.ndarray:
    """(len(ids), dim) float32: (1 + id % 5) / 128 in every column."""
    g = ((np.asarray(ids) % 5) + 1).astype(np.float32) / np.float32(128)
    return np.repeat(g[:, None], dim, axis=1)


def trained(initial: np.ndarray, grads: np.ndarray) -> np.ndarray:
    """A row's value after one push from zero momentum, as MXNet's sgd_mom_update computes it with wd 0:
    mom = 0.9 * 0 - lr * 0 * w - lr * g = -(lr * g) (exact), w + mom (one rounding)."""
    return initial.astype(np.float32) + (-(np.float32(LR) * grads))


# ----------------------------------------------------------------------------------------------------------------
# the server's memory, per phase

class ServerMemory:
    """The server's VmRSS every `interval` s on a thread; per phase the peak: VmHWM since the phase began (the kernel's
    exact high-water mark, reset at its start by writing 5 to /proc/<pid>/clear_refs) and the largest VmRSS
    sampled, whichever is larger (a sample also catches a peak whose VmHWM could not be reset or read)."""

    def __init__(self, pid: int, interval: float = 0.1) -> None:
        self.pid, self.interval = pid, interval
        self.lock = threading.Lock()
        self.phase: dict | None = None
        self.last: dict[str, int] = {}
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="server-rss", daemon=True)
        self.thread.start()

    def status(self) -> dict[str, int]:
        try:
            with open(f"/proc/{self.pid}/status") as fh:
                text = fh.read()
        except OSError:
            return {}
        out = {}
        for line in text.splitlines():
            name, _, value = line.partition(":")
            parts = value.split()
            if name in ("VmRSS", "VmHWM", "RssAnon", "RssFile") and len(parts) == 2:
                out[name] = int(parts[0]) * 1024
        return out

    def _sample(self) -> None:
        st = self.status()
        if "VmRSS" not in st:
            return
        with self.lock:
            self.last = st
            p = self.phase
            if p is None:
                return
            p["hwm"] = max(p["hwm"], st.get("VmHWM", 0))
            if st["VmRSS"] >= p["sampled"]:
                p["sampled"], p["anon"], p["file"] = st["VmRSS"], st.get("RssAnon"), st.get("RssFile")
            p["trace"].append((round(time.monotonic() - p["t0"], 2), st["VmRSS"]))

    def _run(self) -> None:
        while not self.stop.wait(self.interval):
            self._sample()

    def begin(self, name: str, reset: bool = True) -> None:
        """A phase starts now; `reset`: its VmHWM counts from here (else from the process's start)."""
        reset_ok = False
        if reset:
            try:
                with open(f"/proc/{self.pid}/clear_refs", "w") as fh:
                    fh.write("5")
                reset_ok = True
            except OSError:
                pass
        with self.lock:
            self.phase = {"phase": name, "t0": time.monotonic(), "hwm": 0, "sampled": 0, "anon": None,
                          "file": None, "trace": [], "hwm_reset": reset_ok, "cpu0": cpu_seconds(self.pid)}
        self._sample()

    def end(self) -> dict:
        self._sample()
        with self.lock:
            p, self.phase = self.phase, None
        assert p is not None
        cpu = cpu_seconds(self.pid)
        trace = p.pop("trace")
        step = max(1, len(trace) // 200)                      # at most ~200 points a phase in the records
        return {**{k: v for k, v in p.items() if k not in ("t0", "cpu0")},
                "seconds": time.monotonic() - p["t0"], "peak": max(p["hwm"], p["sampled"]),
                "rss_end": self.last.get("VmRSS"),
                "server_cpu": None if cpu is None or p["cpu0"] is None else cpu - p["cpu0"],
                "trace": trace[::step]}

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=2)


def disk_usage(dirs: list[str]) -> int:
    """Bytes allocated under `dirs`, each inode once (the snapshots hard-link the disk tier's segments)."""
    seen, total = set(), 0
    for top in dirs:
        for root, _, files in os.walk(top):
            for name in files:
                try:
                    st = os.lstat(os.path.join(root, name))
                except OSError:
                    continue
                if (st.st_dev, st.st_ino) not in seen:
                    seen.add((st.st_dev, st.st_ino))
                    total += st.st_blocks * 512
    return total


# ----------------------------------------------------------------------------------------------------------------
# the job

class ScaleJob:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.n = int(os.environ["DMLC_NUM_WORKER"])
        if int(os.environ.get("DMLC_NUM_SERVER", "1")) != 1:
            raise SystemExit("scale_job.py measures one server: DMLC_NUM_SERVER=1")
        self.res = Results(args.out, 0)
        pids = server_pids()
        if not pids:
            raise SystemExit("scale_job.py needs the server's pid (BENCH_PIDS, written by bench.py)")
        self.pid = pids[0]
        self.memory = ServerMemory(self.pid)
        self.workers = SimWorkers(self.n, os.environ["DMLC_PS_ROOT_URI"], int(os.environ["DMLC_PS_ROOT_PORT"]),
                                  os.environ.get("DMLC_NODE_HOST", "127.0.0.1"), timeout=args.timeout)
        self.workers.keep_frames = True       # pull replies are read (values), then dropped
        self.begin = proto.server_key_begin(0, 1)
        self.rank0 = 0
        self.steps = -(-args.rows // (self.n * args.batch))
        self.rows = self.steps * self.n * args.batch          # whole steps: the rows that will exist

    # -- helpers

    def call(self, request: wire.Request, worker: int | None = None):
        return self.workers.call(self.rank0 if worker is None else worker, request)

    def register(self) -> None:
        """Register the simulated workers; rank 0 is the one the scheduler gave node id 9 (ranks follow ports, not
        the order they were made in): the init push and the one-worker commands go from it, as from a stock job's
        rank 0 (a restored server's resume gate drops kv.init only from node 9)."""
        ids = self.workers.register()
        self.rank0 = ids.index(min(ids))

    def stats(self) -> dict:
        """LAZY_STATS: the server's stats (its reply's body), the row key's part and the lifecycle's."""
        reply = self.call(wire.command(proto.LAZY_STATS))
        st = json.loads(bytes(reply.meta.body))
        return {"key": st["sparse"].get(str(KEY), {}), "lifecycle": st.get("lifecycle", {}),
                "bad_requests": st.get("bad_requests")}

    def phase(self, name: str, fn, reset: bool = True, stats: bool = True, **extra) -> object:
        """Run `fn` as phase `name`; record its memory figures, the server's stats after it and `extra`."""
        self.memory.begin(name, reset)
        out = fn()
        figures = self.memory.end()
        record = {"kind": "phase", "role": self.args.role, **figures, **extra}
        if isinstance(out, dict):
            record.update(out)
        if stats:
            record["stats"] = self.stats()
        if self.args.dirs:
            record["disk_usage"] = disk_usage(self.args.dirs)
        self.res.add(**record)
        peak = record["peak"] / 2**20
        print(f"  {name}: {record['seconds']:.1f}s, server peak {peak:.1f} MiB"
              + (f", rows {record['stats']['key'].get('rows')} + {record['stats']['key'].get('disk_rows')} on disk"
                 if stats else ""), flush=True)
        return out

    def pull_values(self, worker: int, ids: np.ndarray) -> np.ndarray:
        """row_sparse_pull of sorted `ids`: their values, (len(ids), D) float32 (a copy)."""
        reply = self.call(wire.rsp_pull(self.begin, KEY, ids, self.args.dim), worker)
        return np.frombuffer(decode_kv([f.buffer for f in reply.frames[2:]]).vals,
                             np.float32).reshape(len(ids), self.args.dim).copy()

    def setup(self) -> None:
        """A stock worker's start, as loadgen_job does it (register, barrier, kSyncMode, kController), then what
        kvstore_lazy.worker.init_lazy sends for the (2^40, D) key."""
        w = self.workers
        self.register()
        w.barrier(wire.ALL_GROUP)
        self.init_key()

    def init_key(self) -> None:
        """kSyncMode from rank 0 (mx.kv.create), kController from every worker (set_optimizer), then
        kvstore_lazy.worker.init_lazy: LAZY_DECLARE from every worker, rank 0's init push with no rows, kv.init's
        worker barrier."""
        args, w = self.args, self.workers
        body = wire.optimizer_body(momentum=0.9, learning_rate=LR, wd=0.0)
        self.call(wire.command(proto.SYNC_MODE))
        w.call_all({i: wire.command(proto.CONTROLLER, body) for i in range(w.n)})
        spec = wire.lazy_declare_body(KEY, KEY_ROWS, args.dim, args.seed)
        w.call_all({i: wire.command(proto.LAZY_DECLARE, spec) for i in range(w.n)})
        self.call(wire.rsp_init(self.begin, KEY, None, args.dim))
        w.barrier(wire.WORKER_GROUP)

    # -- train

    def fill(self) -> dict:
        """Every step each worker pushes B fresh ids (counters (step * W + w) * B ...), sorted, as dist_sync
        rounds. The next step's requests are built while the server works on this one. Worker 0 first pulls a few
        of its ids (their initial values: the sample)."""
        args, w, n, b = self.args, self.workers, self.n, self.args.batch
        per_step = -(-args.sample // self.steps)
        samples: list[tuple[np.ndarray, np.ndarray]] = []
        digest = 0

        def build(step: int) -> tuple[dict, np.ndarray | None]:
            nonlocal digest
            pushes, sample = {}, None
            for i in range(n):
                ids = np.sort(hashed(np.arange((step * n + i) * b, (step * n + i + 1) * b), args.seed))
                digest = (digest + id_hash(ids)) % 2**64
                pushes[i] = wire.rsp_push(self.begin, KEY, ids, gradients(ids, args.dim).tobytes(), args.dim)
                if i == 0 and len(samples) * per_step < args.sample:
                    sample = ids[np.linspace(0, b - 1, per_step).astype(np.int64)]
            return pushes, sample

        started = time.perf_counter()
        pushes, sample = build(0)
        for step in range(self.steps):
            sent = {}
            if sample is not None:
                pull = wire.rsp_pull(self.begin, KEY, sample, args.dim)
                sent[("pull", 0)] = (w.send(0, pull), pull, sample)
            for i, req in pushes.items():
                sent[("push", i)] = (w.send(i, req), req, None)
            if step + 1 < self.steps:
                pushes, sample_next = build(step + 1)
            for kind_worker, reply in self.replies(sent).items():
                if kind_worker[0] == "pull":
                    ids = sent[kind_worker][2]
                    vals = np.frombuffer(decode_kv([f.buffer for f in reply.frames[2:]]).vals, np.float32)
                    samples.append((ids, vals.reshape(len(ids), args.dim).copy()))
            if step + 1 < self.steps:
                sample = sample_next
            if args.progress and (step + 1) % args.progress == 0:
                done = (step + 1) * n * b
                print(f"  fill: {done:,} rows, {done / (time.perf_counter() - started):,.0f} rows/s", flush=True)
        wall = time.perf_counter() - started
        ids = np.concatenate([s[0] for s in samples])[:args.sample]
        initial = np.concatenate([s[1] for s in samples])[:args.sample]
        order = np.argsort(ids)
        self.sample = {"ids": ids[order], "initial": initial[order]}
        self.digest = digest
        return {"rows": self.rows, "fill_seconds": wall, "rows_per_s": self.rows / wall, "steps": self.steps,
                "batch": b, "workers": n}

    def replies(self, sent: dict) -> dict:
        """Wait (deadline: --timeout) for the reply to every (ts, request) in `sent`, each checked."""
        by_ts = {(tag[1], ts): tag for tag, (ts, _, _) in sent.items()}
        got: dict = {}
        deadline = time.monotonic() + self.args.timeout
        while len(got) < len(sent):
            left = deadline - time.monotonic()
            if left <= 0:
                raise LoadgenError(f"{len(got)} of {len(sent)} replies within {self.args.timeout:.0f}s")
            for reply in self.workers.receive(int(left * 1000) + 1):
                tag = by_ts.get((reply.worker, reply.meta.timestamp))
                if tag is None:
                    raise LoadgenError(f"worker {reply.worker}: a reply to nothing (timestamp {reply.meta.timestamp})")
                error = wire.reply_error(sent[tag][1], reply.sizes)
                if error:
                    raise LoadgenError(f"worker {reply.worker}: {error}")
                got[tag] = reply
        return got

    def zipf(self, seed: int) -> dict:
        """Zipf(1.2) steps: each worker pulls then pushes B distinct ids (rank r -> counter r -> its id)."""
        args, w = self.args, self.workers
        streams = [ZipfRows(self.rows, args.batch, seed, i) for i in range(self.n)]
        touched = []
        for _ in range(args.zipf_steps):
            ids = [np.sort(hashed(s.next(), args.seed)) for s in streams]
            touched += ids
            w.call_all({i: wire.rsp_pull(self.begin, KEY, ids[i], args.dim) for i in range(self.n)})
            w.call_all({i: wire.rsp_push(self.begin, KEY, ids[i], gradients(ids[i], args.dim).tobytes(), args.dim)
                        for i in range(self.n)})
        self.touched = np.unique(np.concatenate(touched)) if touched else np.zeros(0, np.int64)
        return {"zipf_steps": args.zipf_steps, "zipf_rows": int(len(self.touched))}

    def snapshot(self, tag: dict) -> None:
        """kvstore_lazy.worker.snapshot(kv, tag) from one worker: LAZY_SNAPSHOT, answered once the tagged snapshot
        is written; the chain's next one is written right after the answer."""
        self.call(wire.command(proto.LAZY_SNAPSHOT, json.dumps(tag).encode()))

    def virtual_pull(self, rows: np.ndarray) -> np.ndarray:
        """A pull of ROWS_HEADER_KEY's virtual rows (float64, ROWS_WIDTH wide), as fetch_rows' _pull_rows makes it."""
        keys = np.concatenate([[self.begin + proto.ROWS_HEADER_KEY],
                               self.begin + proto.ROWS_HEADER_KEY + rows.astype(np.uint64)]).astype(np.uint64)
        meta = Meta(head=F64_HEAD, push=False, pull=True)
        data, types = KVPairs(keys, b"", np.zeros(0, np.int32)).frames()
        meta.data_type = types
        request = wire.Request.of(meta, data, "pull", len(rows), len(rows) * proto.ROWS_WIDTH * 8)
        reply = self.call(request)
        return np.frombuffer(decode_kv([f.buffer for f in reply.frames[2:]]).vals, np.float64)

    def header(self) -> RowsHeader:
        """LAZY_ROWS for the key, then the header row (local row 0 of ROWS_HEADER_KEY)."""
        self.call(wire.command(proto.LAZY_ROWS, json.dumps({"key": KEY}).encode()))
        return RowsHeader.from_row(self.virtual_pull(np.zeros(1, np.int64)))

    def listing(self) -> dict:
        """The header and every listed id, a piece of virtual rows a pull; kept as uint32 gaps (the worker's
        side is not what is measured: 4 bytes a row, not fetch_rows' 8)."""
        head = self.header()
        count, chunks = head.count, -(-head.count // proto.ROWS_WIDTH)
        gaps = np.empty(count, np.uint32)
        at, last, digest = 0, -1, 0
        piece = piece_rows(proto.ROWS_WIDTH * 8)
        for lo in range(0, chunks, piece):
            rows = 1 + np.arange(lo, min(lo + piece, chunks), dtype=np.int64)
            vals = self.virtual_pull(rows)[:count - at]
            ids = vals.astype(np.int64)
            if not np.array_equal(ids, vals) or len(ids) == 0 or ids[0] <= last or np.any(ids[1:] <= ids[:-1]):
                raise LoadgenError(f"the listing is not sorted unique integer ids (piece at row {lo})")
            step = np.diff(ids, prepend=last)
            if step.max() >= 2**32:
                raise LoadgenError("a gap between listed ids passes 2^32: keep them as int64")
            gaps[at:at + len(ids)] = step
            digest = (digest + id_hash(ids)) % 2**64
            at, last = at + len(ids), int(ids[-1])
        if at != count:
            raise LoadgenError(f"the listing holds {at} ids, its header says {count}")
        self.gaps = gaps
        return {"listed": count, "listed_hash": digest, "trained_hash": self.digest,
                "header": {name: getattr(head, name) for name in RowsHeader.FIELDS}}

    def fetch(self) -> dict:
        """The rows of the listing, a piece a pull; every piece checked (finite values) and dropped, the sample's
        rows kept."""
        args = self.args
        sample = self.sample["ids"]
        fetched = np.full((len(sample), args.dim), np.nan, np.float32)
        last, finite, pulls = -1, True, 0
        piece = piece_rows(4 * args.dim)
        for lo in range(0, len(self.gaps), piece):
            ids = np.cumsum(self.gaps[lo:lo + piece], dtype=np.int64) + last
            last = int(ids[-1])
            vals = self.pull_values(0, ids)
            pulls += 1
            finite &= bool(np.isfinite(vals).all())
            at = np.searchsorted(ids, sample)
            hit = (at < len(ids)) & (ids[np.minimum(at, len(ids) - 1)] == sample)
            fetched[hit] = vals[at[hit]]
            del vals
        del self.gaps
        untouched = ~np.isin(sample, self.touched)
        expect = trained(self.sample["initial"], gradients(sample, args.dim))
        equal = np.all(fetched == expect, axis=1)
        np.savez(f"{args.out}.sample.npz", ids=sample, initial=self.sample["initial"], fetched=fetched,
                 expected=expect, zipf_touched=~untouched)
        return {"pulls": pulls, "all_finite": finite, "sample": len(sample),
                "sample_fetched": int(np.isfinite(fetched).all(axis=1).sum()),
                "sample_untouched": int(untouched.sum()),
                "sample_untouched_equal_trained": int((equal & untouched).sum())}

    def train(self) -> None:
        args = self.args
        self.setup()
        self.res.add(kind="setup", role="train", server_pid=self.pid, rows=self.rows, idle=self.memory.status())
        self.phase("fill", self.fill)
        self.phase("snapshot: tagged (full)", lambda: self.snapshot({"phase": "full"}), stats=False)
        self.phase("snapshot: chain base (full)", lambda: None)
        self.phase("zipf steps", lambda: self.zipf(args.seed + 1))
        self.phase("snapshot: tagged (full) again", lambda: self.snapshot({"phase": "delta"}), stats=False)
        self.phase("snapshot: chain delta", lambda: None)
        self.phase("fetch_rows: listing", self.listing)
        self.phase("fetch_rows: rows", self.fetch)
        self.res.add(kind="done", role="train")
        # no kStopServer: the launcher stops the server (no shutdown snapshot: the chain stays base + delta)

    # -- restore

    def verify(self) -> dict:
        """The restored server's count (its header after LAZY_ROWS) and the sample rows, pulled."""
        expect = np.load(self.args.expect)
        head = self.header()
        ids = expect["ids"]
        piece = piece_rows(4 * self.args.dim)
        got = np.concatenate([self.pull_values(0, ids[lo:lo + piece]) for lo in range(0, len(ids), piece)])
        same = np.all(got.view(np.uint32) == expect["fetched"].view(np.uint32), axis=1)
        return {"restored_rows": head.count, "sample": len(ids), "sample_equal_fetched": int(same.sum())}

    def restore(self) -> None:
        # the server restored its snapshot between registering and the startup barrier; its VmHWM since its start
        # is the restore's peak
        w = self.workers

        def start() -> None:
            self.register()
            w.barrier(wire.ALL_GROUP)

        self.phase("restore (start, chain folded)", start, reset=False, stats=False)
        self.init_key()          # the same job's start again: the resume gate drops its optimizer and init
        self.phase("restored: count and sample", self.verify)

        def stop() -> None:
            self.call(wire.command(proto.STOP_SERVER))
            w.barrier(wire.ALL_GROUP)

        self.phase("stop (shutdown snapshot, full)", stop, stats=False)
        self.res.add(kind="done", role="restore")

    def close(self) -> None:
        self.memory.close()
        self.workers.close()


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--role", required=True, choices=["train", "restore"])
    p.add_argument("--rows", type=int, default=2_000_000, help="rows to train (rounded up to whole steps)")
    p.add_argument("--dim", type=int, default=8)
    p.add_argument("--batch", type=int, default=16384, help="fresh rows per worker and step (B)")
    p.add_argument("--zipf-steps", type=int, default=10)
    p.add_argument("--sample", type=int, default=4096, help="rows whose values are checked")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--expect", default=None, help="restore: the train job's <out>.sample.npz")
    p.add_argument("--dirs", default="", help="comma list of directories whose disk use is recorded per phase")
    p.add_argument("--progress", type=int, default=0, help="print the fill's rate every this many steps")
    p.add_argument("--timeout", type=float, default=3600.0, help="deadline of one request or barrier (s)")
    args = p.parse_args(argv)
    args.dirs = [d for d in args.dirs.split(",") if d]
    if args.role == "restore" and not args.expect:
        p.error("--role restore needs --expect (the train job's sample file)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    job = ScaleJob(args)
    try:
        job.train() if args.role == "train" else job.restore()
    finally:
        job.close()
    print("scale_job done", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
