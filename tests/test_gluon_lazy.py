"""Gluon on the patched mxnet with KVSTORE_LAZY=1: no full weight on any worker, checkpoints of existing rows only,
save -> crash -> restore (onto 1 or 2 servers) -> continue equals an uninterrupted run (issue: workers and
checkpoints). The worker script is plain Gluon (tests/workers/gluon_lazy.py); the patched mxnet is a private copy
(tests/mxnet_copy.py), never the shared venv.
"""
import os
import subprocess

import mxnet as mx
import numpy as np
import pytest

import lazy_scenarios as scenarios
from cluster import PYTHON, ROOT
from kvstore_lazy.persist import checkpoint as lazy_checkpoint
from lazy_jobs import LAZY, PATCHED_OFF, STOCK, assert_same_checkpoint, checkpoint
from lazy_scenarios import patched  # noqa: F401  (the fixture)
from mxnet_copy import job_env

pytestmark = pytest.mark.integration

SCRIPT = "gluon_lazy.py"


def test_report_scenario_checkpoint_holds_only_seen_rows_and_training_matches_stock(job_factory, patched, tmp_path):
    """The report: a SparseEmbedding of input_dim 100000 over a categorical feature with 3 values. The same job three
    ways at once: stock mxnet (stock servers), the patched mxnet with the switch off (must be exactly stock), and
    lazy (servers started by `import mxnet` as a launcher does). Both embeddings start from Constant(0.05), so the
    lazy run must train exactly as stock: equal losses, equal values on every row it saved, and stock's other rows
    still hold 0.05."""
    args = ["--constant-init", "--steps", "6", "--input-dim", "100000"]
    runs, res = scenarios.run_three_ways(job_factory, SCRIPT, args, "--save", tmp_path, patched)

    # the switch off: nothing of kvstore_lazy runs, and everything is exactly stock (checkpoints compared by
    # content: MXNet's serialization of a pulled RowSparseNDArray is not byte-stable from run to run)
    assert_same_checkpoint(checkpoint(str(tmp_path / f"{STOCK}.params")),
                           checkpoint(str(tmp_path / f"{PATCHED_OFF}.params")), atol=0)
    for rank in range(2):
        assert sorted(res[PATCHED_OFF][rank]) == sorted(res[STOCK][rank])
        for name, value in res[STOCK][rank].items():
            if name != "vmhwm_kb":
                np.testing.assert_array_equal(res[PATCHED_OFF][rank][name], value, err_msg=name)
    # neither its workers nor its server import kvstore_lazy; the switch on: `import mxnet` with DMLC_ROLE=server
    # became a kvstore_lazy server
    scenarios.assert_switch_off_stock_and_on_lazy(runs, res)

    lazy, stock = res[LAZY], res[STOCK]
    ckpt = checkpoint(str(tmp_path / f"{LAZY}.params"))
    stock_ckpt = checkpoint(str(tmp_path / f"{STOCK}.params"))
    scenarios.assert_holds_fed_rows(ckpt, "cat.weight", "ids.weight", lazy)
    np.testing.assert_array_equal(stock_ckpt["cat.weight"][0], np.arange(100000))
    assert int(lazy[0]["local_rows_cat"]) <= len(scenarios.CATEGORIES)
    scenarios.assert_lazy_matches_stock(ckpt, stock_ckpt, 100000)
    for rank in range(2):
        for step in range(6):
            np.testing.assert_allclose(lazy[rank][f"loss_{step}"], stock[rank][f"loss_{step}"], rtol=0, atol=1e-6)
    check_saved_parameters(tmp_path / f"{LAZY}.params", ckpt, stock_ckpt, patched, tmp_path)


def check_saved_parameters(path, ckpt: dict, stock_ckpt: dict, copy, tmp_path) -> None:
    """What save_parameters wrote beside the file (issue 12) and who can read it: the sidecar names both embeddings
    with the Trainer's keys and their initializer; stock Gluon load_parameters (this process: stock mxnet) loads the
    file without ignore_extra; the patched load_parameters in a local process rebuilds every row (absent ones with
    their initial value, Constant(0.05) here, where stock loads zeros); densify writes exactly what the stock run
    saved."""
    params = lazy_checkpoint.lazy_params(path)
    init = mx.init.Constant(0.05).dumps()
    assert {name: (p["key"], p["rows"], p["row_shape"], p["init"], p["seed"]) for name, p in params.items()} == {
        "cat.weight": (0, 100000, [8], init, 0), "ids.weight": (5, 100000, [8], init, 0)}   # the Trainer's index:
    # its parameters in name order (net_cat_weight, net_fc1_bias, net_fc1_weight, net_fc2_*, net_ids_weight)

    class Net(mx.gluon.Block):   # the structure of tests/workers/gluon_lazy.py's Net
        def __init__(self):
            super().__init__(prefix="net_")
            with self.name_scope():
                self.cat = mx.gluon.contrib.nn.SparseEmbedding(100000, 8, prefix="cat_")
                self.ids = mx.gluon.contrib.nn.SparseEmbedding(100000, 8, prefix="ids_")
                self.fc1 = mx.gluon.nn.Dense(16, in_units=16, prefix="fc1_")
                self.fc2 = mx.gluon.nn.Dense(1, in_units=16, prefix="fc2_")

    stock_net = Net()
    stock_net.load_parameters(str(path))
    np.testing.assert_array_equal(stock_net.cat.weight._data[0].indices.asnumpy(), scenarios.CATEGORIES)

    env = {k: v for k, v in os.environ.items() if not k.startswith(("DMLC_", "PS_", "KVSTORE_LAZY"))}
    env.update(job_env(copy, lazy=True))
    out = tmp_path / "local-load.npz"
    done = subprocess.run([PYTHON, str(ROOT / "tests" / "workers" / "gluon_lazy.py"), "--out", str(out),
                           "--constant-init", "--input-dim", "100000", "--local-load", str(path)],
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    with np.load(out) as local:
        for name in ("cat.weight", "ids.weight"):
            rows, values = ckpt[name]
            np.testing.assert_array_equal(local[f"indices_{name}"], np.arange(100000))
            np.testing.assert_array_equal(local[f"data_{name}"][rows], values)
            assert np.all(np.delete(local[f"data_{name}"], rows, axis=0) == np.float32(0.05))

    lazy_checkpoint.densify(path, tmp_path / "dense.params")
    assert_same_checkpoint(checkpoint(str(tmp_path / "dense.params")), stock_ckpt, atol=0)


def test_worker_memory_does_not_grow_with_input_dim(job_factory, patched, tmp_path):
    """Peak RSS (VmHWM) of each worker with input_dim 10_000_000 vs 1_000. Stock would hold two 10M x 8 float32
    weights (640 MB) plus their initialization; lazily each worker holds the rows of its batches. What remains is
    MXNet's own CPU kernel for the SparseEmbedding gradient, which takes one int64 of scratch per row of input_dim
    (80 MB here) from its temp space: MXNET_CPU_TEMP_COPY=1 keeps one such buffer (the default 4 keeps up to four)."""
    scenarios.assert_memory_does_not_grow(job_factory, SCRIPT, patched,
                                          lambda dim: ["--steps", "6", "--save", str(tmp_path / f"dim{dim}")],
                                          str(tmp_path / "dim10000000.params"), "cat.weight", "ids.weight")


def test_save_crash_restore_continue_equals_uninterrupted(job_factory, patched, tmp_path):
    """Adam (two states per row, bias correction by update count). Run A trains 8 steps on 1 server. Run B trains
    steps 0-3, rank 0 saves parameters and trainer states, then every process is SIGKILLed; B is restored into fresh
    jobs with 2 and with 1 servers (load_parameters + load_states on every worker) and trains steps 4-7. The final
    parameters (and optimizer states) equal A's within 1e-6."""
    common = ["--optimizer", "adam", "--steps", "8"]
    scenarios.crash_and_resume(job_factory, SCRIPT, patched,
                               whole=common + ["--save", str(tmp_path / "A")],
                               first=common + ["--stop", "4", "--save", str(tmp_path / "B1")],
                               rest=lambda servers: common + ["--start", "4", "--load", str(tmp_path / "B1"),
                                                              "--save", str(tmp_path / f"B2-{servers}")])
    assert os.path.exists(tmp_path / "B1.states")
    scenarios.assert_resumed_equals_uninterrupted(
        str(tmp_path / "A.params"), {servers: str(tmp_path / f"B2-{servers}.params") for servers in (2, 1)},
        "cat.weight")
    want_states = np.load(tmp_path / "A.states")
    for servers in (2, 1):
        with np.load(tmp_path / f"B2-{servers}.states") as got:
            names = [n for n in want_states.files if not n.startswith("__")]
            assert sorted(names) == sorted(n for n in got.files if not n.startswith("__")) and names
            for name in names:
                np.testing.assert_allclose(got[name], want_states[name], rtol=0, atol=1e-6, err_msg=name)
