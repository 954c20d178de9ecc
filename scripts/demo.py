"""`make demo`: wide & deep CTR training with 2 workers and 2 servers (dist_sync), on kvstore_lazy servers and then
the same job on MXNet's stock C++ servers, side by side.

Each run is a Job (stock scheduler, servers, two stock MXNet workers running scripts/wide_deep.py) with a
deadline; every process is ended by PID. While it runs, this process samples the servers' memory
(kvstore_lazy.node.procstats) and condenses the lazy servers' row counts ("stats" log lines) into one line per interval.
At the end: a per-feature table (input_dim, rows seen by the workers, rows stored) and a cost table (bytes rank 0
shipped at init, server peak RSS, checkpoint size, wall time, loss), printed and written to <out>/summary.json.

    python scripts/demo.py [--quick] [--no-stock] [--steps N] [--out DIR] [--verbose]
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import signal
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvstore_lazy.node import procstats as metrics  # noqa: E402
from kvstore_lazy.launch import SERVER_PREFIX, Job, LineSink  # noqa: E402

WORKER = ROOT / "scripts" / "wide_deep.py"
NUM_WORKERS = NUM_SERVERS = 2
EMB_KEY, WIDE_KEY = 100, 200   # as in wide_deep.py

PRESETS = {
    # stock ships every row at init: 3.6M rows x (16 + 1) floats = 245 MB from rank 0, held by the servers with
    # two Adam states each
    "default": {"dims": [2_000_000, 1_000_000, 500_000, 100_000], "emb_dim": 16, "steps": 200, "batch": 512,
                "timeout": 240},
    "quick": {"dims": [200_000, 100_000, 50_000, 10_000], "emb_dim": 8, "steps": 30, "batch": 256,
              "timeout": 150},
}

STATS_JSON = re.compile(rf"^{SERVER_PREFIX} .*? INFO stats: (\{{.*\}})\s*$")
STATS_LINE = re.compile(rf"^{SERVER_PREFIX} .*? INFO stats \(([^)]*)\): key (\d+) rows (\d+) bytes (\d+)")
# keys with a row lifecycle policy (KVSTORE_LAZY_ADMIT_MIN_COUNT, _MEMORY_BUDGET, ...) add their counters
LIFECYCLE = re.compile(r" pending (\d+) admitted (\d+) dropped (\d+) evicted (\d+)")
LIFECYCLE_FIELDS = ("pending", "admitted", "dropped", "evicted")
QUIET = re.compile(r"INFO (lazy key \d+ declared|stats: \{|stats \(|listening on|optimizer set)")


def key_name(key: int) -> str:
    if EMB_KEY <= key < WIDE_KEY:
        return f"emb{key - EMB_KEY}"
    if WIDE_KEY <= key < WIDE_KEY + 100:
        return f"wide{key - WIDE_KEY}"
    return f"key{key}"


class Output(LineSink):
    """Job's output sink: every line to <run>/job.log; to the console all but routine server lines (unless
    verbose); lazy servers' row counts condensed into one console line per stats round."""

    def __init__(self, log_path: Path, verbose: bool, num_servers: int) -> None:
        super().__init__()
        self.log = open(log_path, "w", buffering=1)
        self.verbose = verbose
        self.num_servers = num_servers
        self.round: dict[str, dict] = {}        # server -> its latest "stats: {json}" since the last summary
        self.latest: dict[str, dict] = {}       # server -> its latest "stats: {json}"
        self.shutdown: dict[str, dict[int, tuple[int, int]]] = {}   # server -> key -> (rows, bytes) at shutdown
        self.lifecycle: dict[int, list[int]] = {}   # key -> pending, admitted, dropped, evicted at shutdown (summed)
        self.on_init_done = None                # called when rank 0 reports its sparse init
        self.server_rss = None                  # () -> current RSS of the servers, summed
        self.stats_expected = False             # lazy servers log row counts when rank 0 asks

    def flush(self) -> None:
        sys.stdout.flush()

    def on_line(self, line: str) -> None:
        self.log.write(line + "\n")
        m = STATS_JSON.match(line)
        if m:
            try:
                body = json.loads(m.group(2))
            except ValueError:
                body = None
            if body is not None:
                self.round[m.group(1)] = self.latest[m.group(1)] = body
                if len(self.round) == self.num_servers:
                    self._summary()
        m = STATS_LINE.match(line)
        if m and m.group(2) == "at shutdown":
            self.shutdown.setdefault(m.group(1), {})[int(m.group(3))] = (int(m.group(4)), int(m.group(5)))
            extra = LIFECYCLE.search(line)
            if extra:
                counts = self.lifecycle.setdefault(int(m.group(3)), [0] * len(LIFECYCLE_FIELDS))
                for i, v in enumerate(extra.groups()):
                    counts[i] += int(v)
        if self.on_init_done is not None and "rank 0: sparse init" in line:
            self.on_init_done()
        if self.verbose or not QUIET.search(line):
            print(line, flush=True)
        if not self.stats_expected and self.server_rss is not None and "rank 0: step" in line:
            print(f"[demo] server RSS now {self.server_rss() / 2**20:.1f} MiB (sum of {self.num_servers})", flush=True)

    def _summary(self) -> None:
        rows: dict[int, int] = {}
        nbytes = 0
        for body in self.round.values():
            for key, s in body.get("sparse", {}).items():
                rows[int(key)] = rows.get(int(key), 0) + int(s["rows"])
                nbytes += int(s["bytes"])
        self.round = {}
        parts = " ".join(f"{key_name(k)}={v:,}" for k, v in sorted(rows.items()) if k < WIDE_KEY)
        rss = f"; server RSS now {self.server_rss() / 2**20:.1f} MiB" if self.server_rss is not None else ""
        print(f"[demo] rows on the lazy servers: {parts} (wide keys alike); row tables {nbytes / 2**20:.1f} MiB{rss}",
              flush=True)

    def server_rows(self) -> dict[int, int]:
        """Rows per key summed over servers: at shutdown if every server logged it, else the latest stats."""
        rows: dict[int, int] = {}
        if len(self.shutdown) == self.num_servers:
            for per_key in self.shutdown.values():
                for key, (n, _) in per_key.items():
                    rows[key] = rows.get(key, 0) + n
        else:
            for body in self.latest.values():
                for key, s in body.get("sparse", {}).items():
                    rows[int(key)] = rows.get(int(key), 0) + int(s["rows"])
        return rows

    def close(self) -> None:
        super().close()
        self.log.close()


def run_job(kind: str, run_dir: Path, cfg: dict, args) -> dict:
    out_dir = run_dir / kind
    out_dir.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, str(WORKER), "--server", kind, "--out", str(out_dir),
               "--dims", ",".join(str(d) for d in cfg["dims"]), "--emb-dim", str(cfg["emb_dim"]),
               "--steps", str(cfg["steps"]), "--batch", str(cfg["batch"])]
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH", "")])),
           "OMP_NUM_THREADS": "1"}
    output = Output(out_dir / "job.log", args.verbose, NUM_SERVERS)
    job = Job(command=command, num_workers=NUM_WORKERS, num_servers=NUM_SERVERS, server=kind, env=env,
                   out=output)
    label = "kvstore_lazy" if kind == "lazy" else "stock MXNet"
    print(f"\n=== {kind} run: {NUM_WORKERS} workers, {NUM_SERVERS} {label} servers, dist_sync, "
          f"{cfg['steps']} steps of {cfg['batch']} samples per worker ===", flush=True)
    print(f"[demo] worker command: {shlex.join(command)}", flush=True)
    started = time.monotonic()
    sampler = None
    after_init: dict[int, int] = {}
    try:
        job.start()
        servers = [n.popen.pid for n in job.nodes if n.role == "server"]
        workers = [n.popen.pid for n in job.nodes if n.role == "worker"]
        sampler = metrics.RssSampler(servers + workers, interval=0.1).start()
        output.server_rss = lambda: sum(metrics.rss(p) or 0 for p in servers)
        output.stats_expected = kind == "lazy"
        output.on_init_done = lambda: after_init.update({p: metrics.rss(p) or 0 for p in servers})
        code = job.supervise(timeout=cfg["timeout"])
    finally:
        job.stop()
        if sampler is not None:
            sampler.stop()
        output.close()
    wall = time.monotonic() - started
    peak = {pid: sampler.peak.get(pid, 0) for pid in servers + workers} if sampler else {}
    result = {"kind": kind, "status": code, "wall_seconds": wall, "log": str(out_dir / "job.log"),
              "server_peak_rss": sum(peak[p] for p in servers),
              "server_rss_after_init": sum(after_init.values()) if after_init else None,
              "worker_peak_rss": max((peak[p] for p in workers), default=0),
              "server_rows": {str(k): v for k, v in output.server_rows().items()},
              "lifecycle": {str(k): dict(zip(LIFECYCLE_FIELDS, v)) for k, v in output.lifecycle.items()}}
    worker_result = out_dir / "result.json"
    if worker_result.exists():
        result["worker"] = json.loads(worker_result.read_text())
    seen = []
    for f in range(len(cfg["dims"])):
        ids = []
        for r in range(NUM_WORKERS):
            path = out_dir / f"seen.rank{r}.npz"
            if path.exists():
                with np.load(path) as data:
                    ids.append(data[f"f{f}"])
        seen.append(int(len(np.unique(np.concatenate(ids)))) if len(ids) == NUM_WORKERS else None)
    result["rows_seen"] = seen
    print(f"[demo] {kind} run finished with status {code} in {wall:.1f}s", flush=True)
    return result


# ----------------------------------------------------------------------------------------------------------------
# report

def mib(n) -> str:
    if n is None:
        return "-"
    if n < 2**20:
        return f"{n / 1024:.1f} KiB"
    return f"{n / 2**20:.1f} MiB"


def secs(x) -> str:
    return "-" if x is None else f"{x:.1f} s"


def num(x) -> str:
    return "-" if x is None else f"{x:,}"


def ratio(stock, lazy) -> str:
    if stock is None or lazy is None or lazy == 0 or stock == 0:
        return "-"
    r = stock / lazy
    return f"{r:,.0f}x" if r >= 100 else f"{r:.2f}x"


def table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(c)) for c in col) for col in zip(headers, *rows)]
    fmt = lambda cells: "  ".join(str(c).ljust(w) if i == 0 else str(c).rjust(w)   # noqa: E731
                                  for i, (c, w) in enumerate(zip(cells, widths)))
    line = "  ".join("-" * w for w in widths)
    return "\n".join([fmt(headers), line] + [fmt(r) for r in rows])


def feature_init_bytes(worker: dict, f: int):
    per_key = worker.get("init_bytes_per_key")
    if not per_key:
        return None
    return per_key.get(f"emb{f}_weight", 0) + per_key.get(f"wide{f}_weight", 0)


def lifecycle_table(dims: list[int], lazy: dict) -> str:
    """The lazy servers' row lifecycle counters per feature (its embedding key) at shutdown."""
    counts = lazy.get("lifecycle") or {}
    if not counts:
        return ("Row lifecycle: no policy on the lazy servers (no KVSTORE_LAZY_ADMIT_*/TTL_*/MEMORY_BUDGET): every "
                "row seen is kept")
    rows = []
    for f in range(len(dims)):
        c = counts.get(str(EMB_KEY + f), {})
        rows.append([f"f{f}", num(lazy["server_rows"].get(str(EMB_KEY + f))), num(c.get("pending")),
                     num(c.get("admitted")), num(c.get("dropped")), num(c.get("evicted"))])
    return "Row lifecycle on the lazy servers (at shutdown)\n" + table(
        ["feature", "rows", "pending admission", "admitted", "dropped gradient rows", "evicted"], rows)


def report(cfg: dict, lazy: dict, stock: dict | None) -> tuple[str, dict, list[str]]:
    dims = cfg["dims"]
    lw = lazy.get("worker", {})
    sw = (stock or {}).get("worker", {})
    problems = []
    if lazy["status"] != 0:
        problems.append(f"the lazy job failed (status {lazy['status']}, see {lazy['log']})")
    if stock is not None and stock["status"] != 0:
        problems.append(f"the stock job failed (status {stock['status']}, see {stock['log']})")
    for name, w in (("lazy", lw), ("stock", sw)):
        for p in w.get("ckpt_problems", []):
            problems.append(f"{name} checkpoint: {p}")

    # per feature
    feat_rows, features = [], []
    for f, dim in enumerate(dims):
        seen = lazy["rows_seen"][f]
        ck = lw.get("ckpt_rows", {}).get(f"emb{f}_weight")
        ck_wide = lw.get("ckpt_rows", {}).get(f"wide{f}_weight")
        srv = lazy["server_rows"].get(str(EMB_KEY + f))
        srv_wide = lazy["server_rows"].get(str(WIDE_KEY + f))
        stock_rows = sw.get("ckpt_rows", {}).get(f"emb{f}_weight") if stock else None
        if lazy["status"] == 0 and not lazy.get("lifecycle"):   # (with a policy, fewer rows by design)
            for what, v in (("checkpoint emb", ck), ("checkpoint wide", ck_wide), ("server emb", srv),
                            ("server wide", srv_wide)):
                if v != seen:
                    problems.append(f"feature {f}: rows stored ({what}) {v} != rows seen {seen}")
        lazy_init = feature_init_bytes(lw, f)
        stock_init = feature_init_bytes(sw, f) if stock else None
        feat_rows.append([f"f{f}", num(dim), num(seen), f"{100 * seen / dim:.2f}%" if seen else "-", num(ck), num(srv),
                          num(stock_rows), ratio(stock_rows, ck), mib(lazy_init), mib(stock_init),
                          ratio(stock_init, lazy_init)])
        features.append({"feature": f, "input_dim": dim, "rows_seen": seen, "lazy_rows_checkpoint": ck,
                         "lazy_rows_server_stats": srv, "lazy_wide_rows_checkpoint": ck_wide,
                         "lazy_wide_rows_server_stats": srv_wide, "stock_rows": stock_rows,
                         "lazy_init_bytes": lazy_init, "stock_init_bytes": stock_init})
    t1 = table(["feature", "input_dim", "rows seen", "seen", "stored: lazy ckpt", "lazy stats", "stock",
                "stock/lazy", "init bytes: lazy", "stock", "stock/lazy"], feat_rows)

    def both(fn):
        a = fn(lazy, lw)
        b = fn(stock, sw) if stock else None
        return a, b

    metrics_rows, costs = [], {}

    def add(label, key, fn, fmt, with_ratio=True):
        a, b = both(fn)
        costs[key] = {"lazy": a, "stock": b}
        metrics_rows.append([label, fmt(a), fmt(b) if stock else "(skipped)", ratio(b, a) if with_ratio else ""])

    add("bytes shipped at init (rank 0 TCP)", "init_bytes", lambda r, w: w.get("init_bytes"), mib)
    add("server peak RSS (sum of 2)", "server_peak_rss", lambda r, w: r["server_peak_rss"], mib)
    add("  server RSS after sparse init", "server_rss_after_init", lambda r, w: r["server_rss_after_init"], mib)
    add("worker peak RSS (max of 2)", "worker_peak_rss", lambda r, w: r["worker_peak_rss"], mib)
    add("checkpoint file (sparse + dense)", "ckpt_bytes", lambda r, w: w.get("ckpt_bytes"), mib)
    add("wall time (whole job)", "wall_seconds", lambda r, w: r["wall_seconds"], secs)
    add("  sparse init (rank 0)", "init_seconds", lambda r, w: w.get("init_seconds"), secs)
    add("    of which building full weights", "weight_gen_seconds", lambda r, w: w.get("weight_gen_seconds"), secs,
        with_ratio=False)
    add(f"  training ({cfg['steps']} steps)", "train_seconds", lambda r, w: w.get("train_seconds"), secs)
    add("  checkpoint save + reload", "ckpt_seconds",
        lambda r, w: (w["ckpt_save_seconds"] + w["ckpt_load_seconds"]) if "ckpt_save_seconds" in w else None, secs)
    loss = lambda x: "-" if x is None else f"{x:.4f}"  # noqa: E731
    add("loss, first interval (rank 0)", "first_loss", lambda r, w: w.get("first_loss"), loss, with_ratio=False)
    add("loss, last interval (rank 0)", "final_loss", lambda r, w: w.get("final_loss"), loss, with_ratio=False)
    t2 = table(["", "lazy", "stock", "stock/lazy"], metrics_rows)
    notes = [f"checkpoint, lazy: {lw.get('ckpt_method', '-')}",
             f"checkpoint, stock: {sw.get('ckpt_method', '-') if stock else '(skipped)'}"]
    if stock and lw.get("final_loss") is not None and sw.get("final_loss") is not None:
        same = lw.get("losses") == sw.get("losses")
        notes.append("losses: identical at every interval (same data, same initial values, same optimizer)" if same
                     else f"losses differ: last interval {lw['final_loss']:.6f} (lazy) vs {sw['final_loss']:.6f} "
                          f"(stock)")
    notes.append("stock/lazy > 1: the lazy servers need less (bytes, memory, time); < 1: they need more")
    text = ("\nPer feature (rows of its embedding key, the wide key holds the same; init bytes of both)\n" + t1 +
            "\n\n" + lifecycle_table(dims, lazy) + "\n\nCosts\n" + t2 + "\n" + "\n".join(notes))
    summary = {"config": cfg, "features": features, "costs": costs, "notes": notes, "problems": problems,
               "runs": {"lazy": lazy, "stock": stock}}
    return text, summary, problems


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Wide & deep on kvstore_lazy servers vs stock MXNet servers.")
    parser.add_argument("--quick", action="store_true", help="small input_dims and few steps (for tests)")
    parser.add_argument("--no-stock", action="store_true", help="run only the kvstore_lazy job")
    parser.add_argument("--steps", type=int, help="training steps per worker (default: 200, --quick: 30)")
    parser.add_argument("--out", help="run directory (default: a new kvstore-lazy-demo-* in the temp dir)")
    parser.add_argument("--timeout", type=float, help="deadline of each job in seconds (default: 240, --quick: 150)")
    parser.add_argument("--verbose", action="store_true", help="show every server line (always in <run>/*/job.log)")
    args = parser.parse_args(argv)

    cfg = dict(PRESETS["quick" if args.quick else "default"])
    if args.steps:
        cfg["steps"] = args.steps
    if args.timeout:
        cfg["timeout"] = args.timeout
    run_dir = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="kvstore-lazy-demo-"))
    run_dir.mkdir(parents=True, exist_ok=True)
    print(f"[demo] run directory: {run_dir}")
    print(f"[demo] features: input_dims {', '.join(f'{d:,}' for d in cfg['dims'])}; embeddings of {cfg['emb_dim']} "
          f"+ a wide weight per feature (row_sparse), MLP on top (dense, Gluon Trainer, Adam on the servers)")

    # SIGTERM ends the jobs like Ctrl-C does (Job.supervise stops every process by PID on the way out)
    previous = signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    try:
        lazy = run_job("lazy", run_dir, cfg, args)
        stock = None if args.no_stock else run_job("stock", run_dir, cfg, args)
    except KeyboardInterrupt:
        print("[demo] interrupted; every process was stopped", flush=True)
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)

    text, summary, problems = report(cfg, lazy, stock)
    print(text)
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    print(f"\n[demo] summary: {run_dir / 'summary.json'}; logs: {run_dir}/*/job.log")
    if problems:
        print("[demo] PROBLEMS:\n  " + "\n  ".join(problems))
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
