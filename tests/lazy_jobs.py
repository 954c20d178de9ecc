"""Running the lazy-integration worker scripts (tests/workers/gluon_lazy.py, module_lazy.py) in ps-lite jobs, several
at once: stock mxnet, the patched copy with the switch off, or the patched copy with KVSTORE_LAZY=1."""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import mxnet as mx
import numpy as np

from cluster import Job, JobHung
from kvstore_lazy.persist import checkpoint as lazy_checkpoint
from common import load
from mxnet_copy import job_env

STOCK, PATCHED_OFF, LAZY = "stock", "patched-off", "lazy"


@dataclass
class Run:
    job: Job
    out: str
    workers: int = 2

    def results(self) -> list[dict]:
        return [load(self.out, r) for r in range(self.workers)]


def start(job_factory, name: str, kind: str, script: str, args: list[str], copy: Path | None = None,
          servers: int = 1, env: dict | None = None, server_via_import: bool = False) -> Run:
    """Start a job of 2 workers running `script`. STOCK: the venv's mxnet and MXNet's C++ servers; PATCHED_OFF: the
    patched copy with the switch off and C++ servers; LAZY: the patched copy with KVSTORE_LAZY=1 and kvstore_lazy
    servers, started as `python -m kvstore_lazy.server` or (server_via_import) as `import mxnet`, which the patch
    turns into that."""
    extra = dict(env or {})
    if kind == STOCK:
        mode_env = dict(extra, KVSTORE_LAZY="0")
    else:
        assert copy is not None
        mode_env = job_env(copy, lazy=kind == LAZY, extra=extra)
    server = "lazy" if kind == LAZY and not server_via_import else "stock"
    job = job_factory(name, num_workers=2, num_servers=servers, server=server, mode_env=mode_env)
    job.start()
    out = str(job.tmp / "res")
    job.spawn_workers(script, ["--out", out] + args)
    return Run(job, out)


def finish(*runs: Run, timeout: float = 150.0) -> None:
    deadline = time.monotonic() + timeout
    for run in runs:
        run.job.wait(max(deadline - time.monotonic(), 1.0))


def kill_after_results(run: Run, timeout: float = 150.0) -> list[dict]:
    """Wait until every worker wrote its results (then they linger), then SIGKILL the whole job: a crash."""
    deadline = time.monotonic() + timeout
    workers = [p for p in run.job.procs if p.name.startswith("worker")]
    while not all(" done; " in p.output() for p in workers):   # (ps-lite ranks need not follow spawn order)
        dead = [p.name for p in run.job.procs if p.popen.poll() is not None]
        if dead or time.monotonic() > deadline:
            run.job.kill()
            raise JobHung(f"no results before the deadline (ended early: {dead})\n" + run.job.report())
        time.sleep(0.2)
    results = run.results()
    run.job.kill()
    return results


def checkpoint(path: str) -> dict:
    """mx.nd.load, as numpy: row_sparse -> (indices, data), dense -> array."""
    out = {}
    for name, value in mx.nd.load(path).items():
        if value.stype == "row_sparse":
            out[name] = (value.indices.asnumpy(), value.data.asnumpy())
        else:
            out[name] = value.asnumpy()
    return out


def assert_same_checkpoint(a: dict, b: dict, atol: float = 1e-6) -> None:
    assert sorted(a) == sorted(b)
    for name in a:
        if isinstance(a[name], tuple):
            np.testing.assert_array_equal(a[name][0], b[name][0], err_msg=f"{name}: other rows")
            np.testing.assert_allclose(a[name][1], b[name][1], rtol=0, atol=atol, err_msg=name)
        else:
            np.testing.assert_allclose(a[name], b[name], rtol=0, atol=atol, err_msg=name)


def stored_rows(snap_dir, servers: int, key: int) -> np.ndarray:
    """Global row ids (sorted, uint64) of `key` stored on all servers, from the snapshots they write at shutdown
    (KVSTORE_LAZY_SNAPSHOT_DIR=snap_dir)."""
    ids = []
    for rank in range(servers):
        info = lazy_checkpoint.read_manifest(snap_dir, rank)["keys"].get(str(key))
        if info is not None:
            ids.append(lazy_checkpoint.read_snapshot_key(snap_dir, rank, key, info)["row_ids"])
    ids = np.concatenate(ids) if ids else np.zeros(0, np.uint64)
    assert len(np.unique(ids)) == len(ids), "a row is stored on two servers"
    return np.sort(ids).astype(np.uint64)


def seen(results: list[dict], key: str) -> np.ndarray:
    return np.unique(np.concatenate([r[key] for r in results])).astype(np.int64)
