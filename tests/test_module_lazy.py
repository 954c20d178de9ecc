"""mx.mod.Module on the patched mxnet with KVSTORE_LAZY=1: no full weight on any worker, checkpoints
(do_checkpoint / save_checkpoint / mx.model) of existing rows only, save -> crash -> Module.load -> fit(begin_epoch)
onto 1 or 2 servers equals an uninterrupted run (issue: workers and checkpoints). Module uses string keys, so this
also covers reading rows and states through string-named virtual keys. The worker script is plain Module code
(tests/workers/module_lazy.py); the patched mxnet is a private copy (tests/mxnet_copy.py).
"""
import mxnet as mx
import numpy as np
import pytest

import lazy_scenarios as scenarios
from lazy_jobs import LAZY, PATCHED_OFF, STOCK, assert_same_checkpoint, checkpoint
from lazy_scenarios import patched  # noqa: F401  (the fixture)
from kvstore_lazy.persist.checkpoint import lazy_params

pytestmark = pytest.mark.integration

SCRIPT = "module_lazy.py"


def test_report_scenario_checkpoint_holds_only_seen_rows_and_training_matches_stock(job_factory, patched, tmp_path):
    """The report, with Module.fit and mx.callback.do_checkpoint: a row_sparse weight of input_dim 100000 over a
    one-hot categorical feature with 3 values; `mx.nd.load(...)['arg:cat_weight'].indices` lists only those. Run
    three ways at once as in the Gluon test: stock, patched with the switch off (exactly stock), lazy (exactly
    stock's training on the rows it holds; stock's other rows keep their Constant(0.05) initial value)."""
    args = ["--constant-init", "--end", "3", "--input-dim", "100000"]
    runs, res = scenarios.run_three_ways(job_factory, SCRIPT, args, "--prefix", tmp_path, patched)
    ckpts = {kind: {epoch: checkpoint(str(tmp_path / f"{kind}-{epoch:04d}.params")) for epoch in (1, 2, 3)}
             for kind in runs}

    for epoch in (1, 2, 3):
        assert_same_checkpoint(ckpts[STOCK][epoch], ckpts[PATCHED_OFF][epoch], atol=0)
    scenarios.assert_switch_off_stock_and_on_lazy(runs, res)

    for epoch in (1, 2, 3):
        lazy, stock = ckpts[LAZY][epoch], ckpts[STOCK][epoch]
        scenarios.assert_holds_fed_rows(lazy, "arg:cat_weight", "arg:ids_weight", res[LAZY])
        np.testing.assert_array_equal(stock["arg:cat_weight"][0], np.arange(100000))
        scenarios.assert_lazy_matches_stock(lazy, stock, 100000, f" epoch {epoch}")
    # every checkpoint, from mx.callback.do_checkpoint (mx.model.save_checkpoint) and from Module.save_checkpoint,
    # has the sidecar naming both lazy weights (issue 12); the stock runs' have none
    for epoch in (1, 2, 3):
        specs = lazy_params(tmp_path / f"{LAZY}-{epoch:04d}.params")
        assert {name: (p["rows"], p["row_shape"], p["init"]) for name, p in specs.items()} == {
            name: (100000, [8], mx.init.Constant(0.05).dumps()) for name in ("arg:cat_weight", "arg:ids_weight")}
        assert lazy_params(tmp_path / f"{STOCK}-{epoch:04d}.params") is None
    # save_checkpoint(save_optimizer_states=True) wrote the servers' states beside the parameters
    with np.load(tmp_path / f"{LAZY}-0003.states") as states:
        np.testing.assert_array_equal(states["cat_weight:row_ids"], scenarios.CATEGORIES)
        assert states["cat_weight:state0"].shape == (3, 8)


def test_worker_memory_does_not_grow_with_input_dim(job_factory, patched, tmp_path):
    """Peak RSS (VmHWM) with input_dim 10_000_000 vs 1_000. Stock holds two 10M x 8 float32 weights (640 MB) in
    arg_params, in the executor and in the init push. What remains is MXNet's CPU kernel for the gradient of
    dot(csr, row_sparse), which takes one int64 of scratch per row of input_dim (80 MB here) from its temp space."""
    scenarios.assert_memory_does_not_grow(job_factory, SCRIPT, patched,
                                          lambda dim: ["--end", "2", "--prefix", str(tmp_path / f"dim{dim}")],
                                          str(tmp_path / "dim10000000-0002.params"), "arg:cat_weight", "arg:ids_weight")


def test_save_crash_restore_continue_equals_uninterrupted(job_factory, patched, tmp_path):
    """SGD with momentum; MXNET_KVSTORE_BIGARRAY_BOUND=1000 so both sparse weights are partitioned (over both
    servers after the restore onto 2). Run A: fit epochs 0-2 on 1 server. Run B: fit epochs 0-1, rank 0
    save_checkpoint(save_optimizer_states=True), then every process is SIGKILLed; restored into fresh jobs with 2 and
    with 1 servers by Module.load(load_optimizer_states=True) + fit(begin_epoch=2). The final checkpoints equal A's
    within 1e-6."""
    env = {"MXNET_KVSTORE_BIGARRAY_BOUND": "1000"}
    common = ["--optimizer", "sgd"]
    resumed = scenarios.crash_and_resume(
        job_factory, SCRIPT, patched, env=env,
        whole=common + ["--end", "3", "--prefix", str(tmp_path / "A")],
        first=common + ["--end", "2", "--prefix", str(tmp_path / "B1")],
        rest=lambda servers: common + ["--resume", str(tmp_path / "B1"), "--begin", "2", "--end", "3",
                                       "--prefix", str(tmp_path / f"B2-{servers}")])
    scenarios.assert_resumed_equals_uninterrupted(
        str(tmp_path / "A-0003.params"), {servers: str(tmp_path / f"B2-{servers}-0003.params") for servers in (2, 1)},
        "arg:cat_weight")
    # the partitioned keys really were split over both servers after the restore
    log0, log1 = (resumed[2].job.log(f"server{r}") for r in range(2))
    assert "key 0 rows" in log0 and "key 0 rows" in log1
