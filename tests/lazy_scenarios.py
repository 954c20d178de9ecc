"""The scenarios test_gluon_lazy.py and test_module_lazy.py share (the report's job three ways, the worker memory
pair, save -> crash -> restore) and the checks on their results, so the Gluon and Module variants run and check the
same things; each test keeps what only its API has. Built on lazy_jobs.py."""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import numpy as np
import pytest

from lazy_jobs import LAZY, PATCHED_OFF, STOCK, Run, assert_same_checkpoint, checkpoint, finish, kill_after_results, \
    seen, start
from mxnet_copy import patched_copy

CATEGORIES = [3, 31337, 99998]   # the values of the workers' categorical feature (tests/workers/common_train.py)
BIG_DIM, SMALL_DIM = 10_000_000, 1_000


@pytest.fixture(scope="module")
def patched(tmp_path_factory) -> Path:
    """The private patched mxnet copy (tests/mxnet_copy.py), made once per test module that imports this fixture."""
    return patched_copy(tmp_path_factory.mktemp("mxnet"))


def run_three_ways(job_factory, script: str, args: list[str], prefix_option: str, tmp_path: Path,
                   copy: Path) -> tuple[dict[str, Run], dict[str, list[dict]]]:
    """The same job at once with stock mxnet (stock servers), the patched copy with the switch off, and lazy (servers
    started by `import mxnet` as a launcher does); each writes its checkpoints at tmp_path/<kind> (`prefix_option`),
    the two stock ones without optimizer states (stock refuses them on dist). Returns the runs and their results."""
    runs = {kind: start(job_factory, kind, kind, script,
                        args + [prefix_option, str(tmp_path / kind)] + (["--no-states"] if kind != LAZY else []),
                        copy=copy, server_via_import=True)
            for kind in (STOCK, PATCHED_OFF, LAZY)}
    finish(*runs.values(), timeout=200)
    return runs, {kind: run.results() for kind, run in runs.items()}


def assert_switch_off_stock_and_on_lazy(runs: dict[str, Run], res: dict[str, list[dict]]) -> None:
    """With the switch off nothing of kvstore_lazy runs (no worker imports it, the server is MXNet's own); with it on
    `import mxnet` with DMLC_ROLE=server became a kvstore_lazy server and every worker went through kvstore_lazy."""
    assert len(res[PATCHED_OFF]) == len(res[LAZY]) == 2
    assert not any(r["kvstore_lazy_imported"] for r in res[PATCHED_OFF])
    assert "kvstore_lazy" not in runs[PATCHED_OFF].job.log("server0")
    assert "kvstore_lazy server 0" in runs[LAZY].job.log("server0")
    assert all(r["kvstore_lazy_imported"] for r in res[LAZY])


def assert_holds_fed_rows(ckpt: dict, cat: str, ids: str, results: list[dict]) -> None:
    """A lazy checkpoint holds exactly the rows the workers fed: the categorical feature's values (the report: not
    [0 1 2 ... input_dim-1]) and the ids any rank saw."""
    np.testing.assert_array_equal(ckpt[cat][0], CATEGORIES)
    np.testing.assert_array_equal(ckpt[ids][0], seen(results, "ids_rows"))


def assert_lazy_matches_stock(lazy: dict, stock: dict, input_dim: int, what: str = "") -> None:
    """Both checkpoints from Constant(0.05) sparse weights: stock's holds every row, the lazy one's values equal
    stock's within 1e-6 (on the rows it holds), and stock's other rows still hold 0.05 (never trained)."""
    for name, value in lazy.items():
        if isinstance(value, tuple):
            rows, values = value
            np.testing.assert_array_equal(stock[name][0], np.arange(input_dim), err_msg=f"{name}{what}: stock rows")
            np.testing.assert_allclose(values, stock[name][1][rows], rtol=0, atol=1e-6, err_msg=f"{name}{what}")
            assert np.all(np.delete(stock[name][1], rows, axis=0) == np.float32(0.05)), f"{name}{what}"
        else:
            np.testing.assert_allclose(value, stock[name], rtol=0, atol=1e-6, err_msg=f"{name}{what}")


def assert_memory_does_not_grow(job_factory, script: str, copy: Path, args: Callable[[int], list[str]],
                                big_checkpoint: str, cat: str, ids: str) -> None:
    """Run `script` lazily with input_dim BIG_DIM and SMALL_DIM at once (plus args(dim)); MXNET_CPU_TEMP_COPY=1 keeps
    one temp-space buffer (the default 4 keeps up to four). Each worker's peak RSS (VmHWM) must grow from SMALL_DIM to
    BIG_DIM by no more than MXNet's gradient kernel scratch (one int64 per row of input_dim) and 16 MB, and by far
    less than stock's two BIG_DIM x 8 float32 weights; the big run's checkpoint must hold only the rows it fed."""
    env = {"MXNET_CPU_TEMP_COPY": "1"}
    runs = {dim: start(job_factory, f"dim{dim}", LAZY, script, ["--input-dim", str(dim)] + args(dim), copy=copy,
                       env=env)
            for dim in (BIG_DIM, SMALL_DIM)}
    finish(*runs.values(), timeout=200)
    big, small = runs[BIG_DIM].results(), runs[SMALL_DIM].results()
    weights = 2 * BIG_DIM * 8 * 4
    kernel_scratch = BIG_DIM * 8
    assert len(big) == len(small) == 2
    for rank in range(2):
        grown = (int(big[rank]["vmhwm_kb"]) - int(small[rank]["vmhwm_kb"])) * 1024
        assert grown < kernel_scratch * 1.25 + (16 << 20), f"rank {rank}: peak RSS grew {grown >> 20} MB"
        assert grown < weights / 5
    assert_holds_fed_rows(checkpoint(big_checkpoint), cat, ids, big)


def crash_and_resume(job_factory, script: str, copy: Path, whole: list[str], first: list[str],
                     rest: Callable[[int], list[str]], env: dict | None = None) -> dict[int, Run]:
    """Run A: `whole` on 1 server. Run B1: `first` on 1 server, every process SIGKILLed once every worker wrote its
    results (a crash after the checkpoint). B2: rest(servers), restoring B1's checkpoint in fresh jobs with 2 and with
    1 servers. Waits for A and both B2 jobs; returns the B2 runs by number of servers."""
    a = start(job_factory, "A", LAZY, script, whole, copy=copy, env=env)
    b1 = start(job_factory, "B1", LAZY, script, first + ["--linger"], copy=copy, env=env)
    kill_after_results(b1, timeout=200)
    resumed = {servers: start(job_factory, f"B2-{servers}servers", LAZY, script, rest(servers), copy=copy, env=env,
                              servers=servers)
               for servers in (2, 1)}
    finish(a, *resumed.values(), timeout=200)
    return resumed


def assert_resumed_equals_uninterrupted(want: str, got: dict[int, str], cat: str) -> None:
    """Run A's final checkpoint (`want`) holds only the categories' rows of `cat`, and every resumed run's final
    checkpoint (`got`, by number of servers) equals it within 1e-6."""
    want_ckpt = checkpoint(want)
    np.testing.assert_array_equal(want_ckpt[cat][0], CATEGORIES)
    assert sorted(got) == [1, 2]
    for servers, path in got.items():
        assert_same_checkpoint(want_ckpt, checkpoint(path))
