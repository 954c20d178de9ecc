"""mx.mod.Module on the patched mxnet with KVSTORE_LAZY=1: no full weight on any worker, checkpoints
(do_checkpoint / save_checkpoint / mx.model) of existing rows only, save -> crash -> Module.load -> fit(begin_epoch)
onto 1 or 2 servers equals an uninterrupted run (issue: workers and checkpoints). Module uses string keys, so this
also covers reading rows and states through string-named virtual keys. The worker script is plain Module code
(tests/workers/module_lazy.py); the patched mxnet is a private copy (tests/mxnet_copy.py).
"""
import numpy as np
import pytest

from lazy_jobs import LAZY, PATCHED_OFF, STOCK, assert_same_checkpoint, checkpoint, finish, kill_after_results, seen, \
    start
from mxnet_copy import patched_copy

pytestmark = pytest.mark.integration

SCRIPT = "module_lazy.py"
CATEGORIES = [3, 31337, 99998]


@pytest.fixture(scope="module")
def patched(tmp_path_factory):
    return patched_copy(tmp_path_factory.mktemp("mxnet"))


def test_report_scenario_checkpoint_holds_only_seen_rows_and_training_matches_stock(job_factory, patched, tmp_path):
    """The report, with Module.fit and mx.callback.do_checkpoint: a row_sparse weight of input_dim 100000 over a
    one-hot categorical feature with 3 values; `mx.nd.load(...)['arg:cat_weight'].indices` lists only those. Run
    three ways at once as in the Gluon test: stock, patched with the switch off (exactly stock), lazy (exactly
    stock's training on the rows it holds; stock's other rows keep their Constant(0.05) initial value)."""
    args = ["--constant-init", "--end", "3", "--input-dim", "100000"]
    runs = {kind: start(job_factory, kind, kind, SCRIPT,
                        args + ["--prefix", str(tmp_path / kind)] + (["--no-states"] if kind != LAZY else []),
                        copy=patched, server_via_import=True)
            for kind in (STOCK, PATCHED_OFF, LAZY)}
    finish(*runs.values(), timeout=200)
    res = {kind: run.results() for kind, run in runs.items()}
    ckpts = {kind: {epoch: checkpoint(str(tmp_path / f"{kind}-{epoch:04d}.params")) for epoch in (1, 2, 3)}
             for kind in runs}

    for epoch in (1, 2, 3):
        assert_same_checkpoint(ckpts[STOCK][epoch], ckpts[PATCHED_OFF][epoch], atol=0)
    assert not any(r["kvstore_lazy_imported"] for r in res[PATCHED_OFF])
    assert "kvstore_lazy" not in runs[PATCHED_OFF].job.log("server0")

    assert "kvstore_lazy server 0" in runs[LAZY].job.log("server0")
    assert all(r["kvstore_lazy_imported"] for r in res[LAZY])
    for epoch in (1, 2, 3):
        lazy, stock = ckpts[LAZY][epoch], ckpts[STOCK][epoch]
        np.testing.assert_array_equal(lazy["arg:cat_weight"][0], CATEGORIES)   # the report: not [0 1 ... 99999]
        np.testing.assert_array_equal(stock["arg:cat_weight"][0], np.arange(100000))
        np.testing.assert_array_equal(lazy["arg:ids_weight"][0], seen(res[LAZY], "ids_rows"))
        for name, value in lazy.items():
            if isinstance(value, tuple):
                rows, values = value
                np.testing.assert_allclose(values, stock[name][1][rows], rtol=0, atol=1e-6, err_msg=name)
                assert np.all(np.delete(stock[name][1], rows, axis=0) == np.float32(0.05)), name
            else:
                np.testing.assert_allclose(value, stock[name], rtol=0, atol=1e-6, err_msg=f"{name} epoch {epoch}")
    # save_checkpoint(save_optimizer_states=True) wrote the servers' states beside the parameters
    with np.load(tmp_path / f"{LAZY}-0003.states") as states:
        np.testing.assert_array_equal(states["cat_weight:row_ids"], CATEGORIES)
        assert states["cat_weight:state0"].shape == (3, 8)


def test_worker_memory_does_not_grow_with_input_dim(job_factory, patched, tmp_path):
    """Peak RSS (VmHWM) with input_dim 10_000_000 vs 1_000. Stock holds two 10M x 8 float32 weights (640 MB) in
    arg_params, in the executor and in the init push. What remains is MXNet's CPU kernel for the gradient of
    dot(csr, row_sparse), which takes one int64 of scratch per row of input_dim (80 MB here) from its temp space."""
    env = {"MXNET_CPU_TEMP_COPY": "1"}
    runs = {dim: start(job_factory, f"dim{dim}", LAZY, SCRIPT,
                       ["--input-dim", str(dim), "--end", "2", "--prefix", str(tmp_path / f"dim{dim}")],
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
    ckpt = checkpoint(str(tmp_path / "dim10000000-0002.params"))
    np.testing.assert_array_equal(ckpt["arg:cat_weight"][0], CATEGORIES)
    np.testing.assert_array_equal(ckpt["arg:ids_weight"][0], seen(big, "ids_rows"))


def test_save_crash_restore_continue_equals_uninterrupted(job_factory, patched, tmp_path):
    """SGD with momentum; MXNET_KVSTORE_BIGARRAY_BOUND=1000 so both sparse weights are partitioned (over both
    servers after the restore onto 2). Run A: fit epochs 0-2 on 1 server. Run B: fit epochs 0-1, rank 0
    save_checkpoint(save_optimizer_states=True), then every process is SIGKILLed; restored into fresh jobs with 2 and
    with 1 servers by Module.load(load_optimizer_states=True) + fit(begin_epoch=2). The final checkpoints equal A's
    within 1e-6."""
    env = {"MXNET_KVSTORE_BIGARRAY_BOUND": "1000"}
    common = ["--optimizer", "sgd"]
    a = start(job_factory, "A", LAZY, SCRIPT, common + ["--end", "3", "--prefix", str(tmp_path / "A")],
              copy=patched, env=env)
    b1 = start(job_factory, "B1", LAZY, SCRIPT, common + ["--end", "2", "--prefix", str(tmp_path / "B1"), "--linger"],
               copy=patched, env=env)
    kill_after_results(b1, timeout=200)
    resumed = {servers: start(job_factory, f"B2-{servers}servers", LAZY, SCRIPT,
                              common + ["--resume", str(tmp_path / "B1"), "--begin", "2", "--end", "3",
                                        "--prefix", str(tmp_path / f"B2-{servers}")],
                              copy=patched, env=env, servers=servers)
               for servers in (2, 1)}
    finish(a, *resumed.values(), timeout=200)
    want = checkpoint(str(tmp_path / "A-0003.params"))
    np.testing.assert_array_equal(want["arg:cat_weight"][0], CATEGORIES)
    for servers in (2, 1):
        assert_same_checkpoint(want, checkpoint(str(tmp_path / f"B2-{servers}-0003.params")))
    # the partitioned keys really were split over both servers after the restore
    log0, log1 = (resumed[2].job.log(f"server{r}") for r in range(2))
    assert "key 0 rows" in log0 and "key 0 rows" in log1
