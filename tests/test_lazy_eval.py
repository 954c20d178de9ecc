"""Issue 12: with the defaults, a Module job that pulls every row before scoring and saving (as MXNet's sparse
examples do) stores only the rows it trained, on the servers and in its checkpoints; the checkpoint carries what
rebuilds the other rows (its .lazy.json sidecar), so scoring it in a fresh local Module reproduces the job's eval
exactly; stock readers load the file unchanged; and densify turns it into exactly what a stock run, started from
the same initial values, saved. The worker is tests/workers/module_eval.py (stock mxnet, patched copy for the lazy
run), with real stock workers and scheduler and 2 servers.
"""
import os
import subprocess
import sys

import mxnet as mx
import numpy as np
import pytest

from cluster import PYTHON, ROOT
from common import load
from kvstore_lazy.persist import checkpoint
from lazy_jobs import LAZY, STOCK, checkpoint as read_checkpoint, finish, start, stored_rows
from lazy_scenarios import patched  # noqa: F401  (the fixture)
from mxnet_copy import job_env

pytestmark = pytest.mark.integration

SCRIPT = ROOT / "tests" / "workers" / "module_eval.py"
D, EPOCHS = 100_000, 2


def score(out, prefix, env: dict) -> dict:
    """Score checkpoint <prefix>-<last epoch> in a fresh local process (no DMLC_* at all)."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("DMLC_", "PS_", "KVSTORE_LAZY"))}
    base.update({"OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}, **env)
    done = subprocess.run([PYTHON, str(SCRIPT), "--out", str(out), "--score", str(prefix), "--epoch",
                           str(EPOCHS - 1)], env=base, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr
    return load(str(out), 0)


def test_defaults_keep_only_trained_rows_and_the_checkpoint_reproduces_the_eval(job_factory, patched, tmp_path):
    snap = tmp_path / "snap"
    args = ["--epochs", str(EPOCHS), "--input-dim", str(D)]
    lazy = start(job_factory, "lazy", LAZY, "module_eval.py", args + ["--prefix", str(tmp_path / "lazy")],
                 copy=patched, servers=2, env={"KVSTORE_LAZY_SNAPSHOT_DIR": str(snap)})
    stock = start(job_factory, "stock", STOCK, "module_eval.py",
                  args + ["--prefix", str(tmp_path / "stock"), "--stock-init"], servers=2)
    finish(lazy, stock, timeout=300)
    res, ref = lazy.results(), stock.results()
    last = f"{tmp_path / 'lazy'}-{EPOCHS - 1:04d}.params"
    trained = np.unique(np.concatenate([r["trained"] for r in res]))
    assert 0 < len(trained) < D // 2

    # the job pulled every row before scoring, and trained exactly as the stock run did (same eval every epoch)
    for rank in range(2):
        for epoch in range(EPOCHS):
            assert int(res[rank][f"held_rows_{epoch}"]) == D
            assert float(res[rank][f"eval_{epoch}"]) == float(ref[rank][f"eval_{epoch}"]), (rank, epoch)

    # the sidecar: what rebuilds the rows the file does not hold (key ids as the stock run numbered them)
    params = checkpoint.lazy_params(last)
    assert sorted(params) == ["arg:v", "arg:w"]
    for name, cols in (("w", 2), ("v", 4)):
        assert params[f"arg:{name}"] == {"key": int(ref[0][f"key_{name}"]), "rows": D, "row_shape": [cols],
                                         "dtype": "float32", "init": mx.init.Uniform(0.1).dumps(), "seed": 0}

    # with the defaults only trained rows exist: on the servers at the end, and in every checkpoint
    for name in ("w", "v"):
        np.testing.assert_array_equal(stored_rows(snap, 2, params[f"arg:{name}"]["key"]), trained.astype(np.uint64))
        for epoch in range(EPOCHS):
            ckpt = read_checkpoint(f"{tmp_path / 'lazy'}-{epoch:04d}.params")
            assert ckpt[f"arg:{name}"][0].max() < D // 2
        np.testing.assert_array_equal(read_checkpoint(last)[f"arg:{name}"][0], trained)

    # stock readers load the file unchanged (this process runs the venv's stock mxnet)
    assert sorted(mx.nd.load(last)) == ["arg:fc_bias", "arg:fc_weight", "arg:v", "arg:w"]
    _, arg_params, aux_params = mx.model.load_checkpoint(str(tmp_path / "lazy"), EPOCHS - 1)
    assert sorted(arg_params) == ["fc_bias", "fc_weight", "v", "w"] and aux_params == {}
    gluon = mx.gluon.ParameterDict()   # Gluon's loader of Module files (Block.load_parameters of arg:/aux: names)
    for name, value in arg_params.items():
        gluon.get(name, shape=value.shape, stype=value.stype)
    gluon.load(last)
    loaded = gluon["w"]._data[0]   # (row_sparse_data() needs a Trainer)
    np.testing.assert_array_equal(loaded.indices.asnumpy(), trained)
    np.testing.assert_array_equal(loaded.data.asnumpy(), read_checkpoint(last)["arg:w"][1])

    # a fresh local Module scoring the checkpoint: with our loader (patched mxnet, KVSTORE_LAZY=1) exactly the job's
    # last eval; with stock mxnet the absent rows load as zeros and the score differs (the test set needs them)
    want = float(res[0][f"eval_{EPOCHS - 1}"])
    ours = score(tmp_path / "score-lazy", tmp_path / "lazy", job_env(patched, lazy=True))
    assert int(ours["w_rows"]) == D and float(ours["score"]) == want
    plain = score(tmp_path / "score-stock", tmp_path / "lazy", {"KVSTORE_LAZY": "0"})
    assert int(plain["w_rows"]) == len(trained) and float(plain["score"]) != want

    # densify (no kvstore_lazy needed to read its output): exactly what the stock run saved, and stock mxnet
    # scoring it reproduces the eval too
    dense = tmp_path / "dense"
    done = subprocess.run([sys.executable, "-m", "kvstore_lazy.persist.checkpoint", "densify", last,
                           f"{dense}-{EPOCHS - 1:04d}.params"], capture_output=True, text=True, timeout=120,
                          cwd=str(ROOT))
    assert done.returncode == 0, done.stdout + done.stderr
    got, want_ckpt = (read_checkpoint(f"{p}-{EPOCHS - 1:04d}.params") for p in (dense, tmp_path / "stock"))
    assert sorted(got) == sorted(want_ckpt)
    for name, value in want_ckpt.items():
        if isinstance(value, tuple):
            np.testing.assert_array_equal(got[name][0], value[0], err_msg=name)
            np.testing.assert_array_equal(got[name][1], value[1], err_msg=name)
        else:
            np.testing.assert_array_equal(got[name], value, err_msg=name)
    os.link(f"{tmp_path / 'lazy'}-symbol.json", f"{dense}-symbol.json")
    assert float(score(tmp_path / "score-dense", dense, {"KVSTORE_LAZY": "0"})["score"]) == want
