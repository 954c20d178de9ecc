"""Gluon on the patched mxnet with KVSTORE_LAZY=1: no full weight on any worker, checkpoints of existing rows only,
save -> crash -> restore (onto 1 or 2 servers) -> continue equals an uninterrupted run (issue: workers and
checkpoints). The worker script is plain Gluon (tests/workers/gluon_lazy.py); the patched mxnet is a private copy
(tests/mxnet_copy.py), never the shared venv.
"""
import os

import numpy as np
import pytest

from lazy_jobs import LAZY, PATCHED_OFF, STOCK, assert_same_checkpoint, checkpoint, finish, kill_after_results, seen, \
    start
from mxnet_copy import patched_copy

pytestmark = pytest.mark.integration

SCRIPT = "gluon_lazy.py"
CATEGORIES = [3, 31337, 99998]


@pytest.fixture(scope="module")
def patched(tmp_path_factory):
    return patched_copy(tmp_path_factory.mktemp("mxnet"))


def test_report_scenario_checkpoint_holds_only_seen_rows_and_training_matches_stock(job_factory, patched, tmp_path):
    """The report: a SparseEmbedding of input_dim 100000 over a categorical feature with 3 values. The same job three
    ways at once: stock mxnet (stock servers), the patched mxnet with the switch off (must be exactly stock), and
    lazy (servers started by `import mxnet` as a launcher does). Both embeddings start from Constant(0.05), so the
    lazy run must train exactly as stock: equal losses, equal values on every row it saved, and stock's other rows
    still hold 0.05."""
    args = ["--constant-init", "--steps", "6", "--input-dim", "100000"]
    runs = {kind: start(job_factory, kind, kind, SCRIPT,
                        args + ["--save", str(tmp_path / kind)] + (["--no-states"] if kind != LAZY else []),
                        copy=patched, server_via_import=True)
            for kind in (STOCK, PATCHED_OFF, LAZY)}
    finish(*runs.values(), timeout=200)
    res = {kind: run.results() for kind, run in runs.items()}

    # the switch off: nothing of kvstore_lazy runs, and everything is exactly stock (checkpoints compared by
    # content: MXNet's serialization of a pulled RowSparseNDArray is not byte-stable from run to run)
    assert_same_checkpoint(checkpoint(str(tmp_path / f"{STOCK}.params")),
                           checkpoint(str(tmp_path / f"{PATCHED_OFF}.params")), atol=0)
    for rank in range(2):
        assert not res[PATCHED_OFF][rank]["kvstore_lazy_imported"]
        assert sorted(res[PATCHED_OFF][rank]) == sorted(res[STOCK][rank])
        for name, value in res[STOCK][rank].items():
            if name != "vmhwm_kb":
                np.testing.assert_array_equal(res[PATCHED_OFF][rank][name], value, err_msg=name)
    assert "kvstore_lazy" not in runs[PATCHED_OFF].job.log("server0")

    # the switch on: `import mxnet` with DMLC_ROLE=server became a kvstore_lazy server
    assert "kvstore_lazy server 0" in runs[LAZY].job.log("server0")
    lazy, stock = res[LAZY], res[STOCK]
    assert all(r["kvstore_lazy_imported"] for r in lazy)
    ckpt = checkpoint(str(tmp_path / f"{LAZY}.params"))
    stock_ckpt = checkpoint(str(tmp_path / f"{STOCK}.params"))
    np.testing.assert_array_equal(ckpt["cat.weight"][0], CATEGORIES)   # the report: not [0 1 2 ... 99999]
    np.testing.assert_array_equal(stock_ckpt["cat.weight"][0], np.arange(100000))
    np.testing.assert_array_equal(ckpt["ids.weight"][0], seen(lazy, "ids_rows"))
    assert int(lazy[0]["local_rows_cat"]) <= len(CATEGORIES)
    for name in ckpt:
        if isinstance(ckpt[name], tuple):
            rows, values = ckpt[name]
            full = np.zeros((100000,) + values.shape[1:], np.float32)
            full[stock_ckpt[name][0]] = stock_ckpt[name][1]
            np.testing.assert_allclose(values, full[rows], rtol=0, atol=1e-6, err_msg=name)
            untouched = np.delete(full, rows, axis=0)
            assert np.all(untouched == np.float32(0.05)), name
        else:
            np.testing.assert_allclose(ckpt[name], stock_ckpt[name], rtol=0, atol=1e-6, err_msg=name)
    for rank in range(2):
        for step in range(6):
            np.testing.assert_allclose(lazy[rank][f"loss_{step}"], stock[rank][f"loss_{step}"], rtol=0, atol=1e-6)


def test_worker_memory_does_not_grow_with_input_dim(job_factory, patched, tmp_path):
    """Peak RSS (VmHWM) of each worker with input_dim 10_000_000 vs 1_000. Stock would hold two 10M x 8 float32
    weights (640 MB) plus their initialization; lazily each worker holds the rows of its batches. What remains is
    MXNet's own CPU kernel for the SparseEmbedding gradient, which takes one int64 of scratch per row of input_dim
    (80 MB here) from its temp space: MXNET_CPU_TEMP_COPY=1 keeps one such buffer (the default 4 keeps up to four)."""
    env = {"MXNET_CPU_TEMP_COPY": "1"}
    runs = {dim: start(job_factory, f"dim{dim}", LAZY, SCRIPT,
                       ["--input-dim", str(dim), "--steps", "6", "--save", str(tmp_path / f"dim{dim}")],
                       copy=patched, env=env)
            for dim in (10_000_000, 1_000)}
    finish(*runs.values(), timeout=200)
    big, small = runs[10_000_000].results(), runs[1_000].results()
    weights = 2 * 10_000_000 * 8 * 4
    kernel_scratch = 10_000_000 * 8
    for rank in range(2):
        grown = (int(big[rank]["vmhwm_kb"]) - int(small[rank]["vmhwm_kb"])) * 1024
        assert grown < kernel_scratch * 1.25 + (16 << 20), f"rank {rank}: peak RSS grew {grown >> 20} MB"
        assert grown < weights / 5
    ckpt = checkpoint(str(tmp_path / "dim10000000.params"))
    np.testing.assert_array_equal(ckpt["cat.weight"][0], CATEGORIES)
    np.testing.assert_array_equal(ckpt["ids.weight"][0], seen(big, "ids_rows"))


def test_save_crash_restore_continue_equals_uninterrupted(job_factory, patched, tmp_path):
    """Adam (two states per row, bias correction by update count). Run A trains 8 steps on 1 server. Run B trains
    steps 0-3, rank 0 saves parameters and trainer states, then every process is SIGKILLed; B is restored into fresh
    jobs with 2 and with 1 servers (load_parameters + load_states on every worker) and trains steps 4-7. The final
    parameters (and optimizer states) equal A's within 1e-6."""
    common = ["--optimizer", "adam", "--steps", "8"]
    a = start(job_factory, "A", LAZY, SCRIPT, common + ["--save", str(tmp_path / "A")], copy=patched)
    b1 = start(job_factory, "B1", LAZY, SCRIPT, common + ["--stop", "4", "--save", str(tmp_path / "B1"), "--linger"],
               copy=patched)
    kill_after_results(b1, timeout=200)
    assert os.path.exists(tmp_path / "B1.states")
    resumed = {servers: start(job_factory, f"B2-{servers}servers", LAZY, SCRIPT,
                              common + ["--start", "4", "--load", str(tmp_path / "B1"),
                                        "--save", str(tmp_path / f"B2-{servers}")], copy=patched, servers=servers)
               for servers in (2, 1)}
    finish(a, *resumed.values(), timeout=200)
    want = checkpoint(str(tmp_path / "A.params"))
    np.testing.assert_array_equal(want["cat.weight"][0], CATEGORIES)
    want_states = np.load(tmp_path / "A.states")
    for servers in (2, 1):
        assert_same_checkpoint(want, checkpoint(str(tmp_path / f"B2-{servers}.params")))
        with np.load(tmp_path / f"B2-{servers}.states") as got:
            names = [n for n in want_states.files if not n.startswith("__")]
            assert sorted(names) == sorted(n for n in got.files if not n.startswith("__")) and names
            for name in names:
                np.testing.assert_allclose(got[name], want_states[name], rtol=0, atol=1e-6, err_msg=name)
