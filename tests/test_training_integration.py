"""Training through the worker-side APIs people use: Gluon `Trainer` (SparseEmbedding + Dense, update_on_kvstore,
row_sparse_pull per batch) and `mx.mod.Module` (sparse.dot of csr data with a row_sparse weight, prepare() with a
sparse_row_id_fn), with 2 stock workers, against the stock C++ server and against kvstore_lazy in the same test.

Every parameter (initial and final, as the servers hold them), every per-step loss and prediction, and the dense
weights the workers got back from their pushpulls must be bit-identical between the two servers: the server-side
optimizers (SGD with momentum, Adam, both with lazy_update on the row_sparse weight) reproduce MXNet 1.9.1's
float32 kernels exactly.

dist_async: with 2 workers pushing freely the servers' update order (and so the result) is not deterministic, so
the worker scripts take turns: rank 0 trains a step, waits until all its pushes are answered (mx.nd.waitall()),
barrier, rank 1 trains a step, waits, barrier, ... Each rank pulls every parameter right before and right after its
step; the test checks the chain "rank 0 after step k == rank 1 before step k" and "rank 1 after step k == rank 0
before step k+1", which proves each server applied the steps in exactly that order.
"""
import numpy as np
import pytest

from cluster import JobFailed
from common import load

pytestmark = pytest.mark.integration

PARTITIONED = 1000       # MXNET_KVSTORE_BIGARRAY_BOUND: the embedding (8000 / 6400 elements) and the first Dense /
                         # FullyConnected weight (1280) are split over both servers, the rest is not
UNPARTITIONED = 10 ** 6  # with 2 servers each key lives whole on one server ((key * 9973) % 2)

CASES = [
    # id, worker script, mode, servers, optimizer, bound
    ("gluon-sync-1s-sgd", "gluon_train.py", "dist_sync", 1, "sgd", PARTITIONED),
    ("gluon-sync-2s-adam-partitioned", "gluon_train.py", "dist_sync", 2, "adam", PARTITIONED),
    ("gluon-async-1s-adam", "gluon_train.py", "dist_async", 1, "adam", PARTITIONED),
    ("gluon-async-2s-sgd", "gluon_train.py", "dist_async", 2, "sgd", UNPARTITIONED),
    ("module-sync-1s-adam", "module_train.py", "dist_sync", 1, "adam", PARTITIONED),
    ("module-sync-2s-sgd", "module_train.py", "dist_sync", 2, "sgd", UNPARTITIONED),
    ("module-async-1s-sgd", "module_train.py", "dist_async", 1, "sgd", PARTITIONED),
    ("module-async-2s-adam-partitioned", "module_train.py", "dist_async", 2, "adam", PARTITIONED),
]
STEPS = 6
SPARSE = {"gluon_train.py": "net_sparseembedding0_weight", "module_train.py": "emb_weight"}


def run(job_factory, server, script, mode, servers, args, bound):
    job = job_factory(server, num_workers=2, num_servers=servers, server=server,
                      mode_env={"MXNET_KVSTORE_BIGARRAY_BOUND": str(bound)})
    job.start()
    out = str(job.tmp / "res")
    job.run_workers(script, ["--out", out, "--mode", mode, "--steps", str(STEPS)] + args, timeout=150)
    return [load(out, r) for r in range(2)]


def params_of(res, prefix):
    return {k[len(prefix):]: v for k, v in res.items() if k.startswith(prefix)}


def check_training_moved_weights(res, script):
    """Every parameter changed; in the row_sparse weight exactly the rows some batch used changed (lazy update:
    rows no batch touched keep their initial values, wd included)."""
    for rank in range(2):
        init, final = params_of(res[rank], "init_"), params_of(res[rank], "final_")
        assert sorted(init) == sorted(final) and len(init) >= 5
        for name in init:
            assert not np.array_equal(init[name], final[name]), f"rank {rank}: {name} did not change"
        emb = SPARSE[script]
        changed = np.flatnonzero(np.any(init[emb] != final[emb], axis=1))
        touched = np.union1d(res[0]["touched"], res[1]["touched"])
        np.testing.assert_array_equal(changed, touched, err_msg=f"rank {rank}: changed rows != touched rows")
        # the batches reach both halves of the rows, i.e. both servers' row partitions when partitioned
        assert touched.min() < len(init[emb]) // 2 <= touched.max() and len(touched) < len(init[emb]) // 2
    # both ranks see the same server values
    for name, value in params_of(res[0], "final_").items():
        np.testing.assert_array_equal(res[1]["final_" + name], value, err_msg=name)


def check_turn_order(res, label):
    """dist_async with turns: what rank r saw after its step is exactly what the next rank saw before its step."""
    names = sorted(params_of(res[0], "init_"))
    sequence = []  # (rank, step) in the intended server order
    for step in range(STEPS):
        sequence += [(0, step), (1, step)]
    previous = ("init", res[0], "init_")
    for rank, step in sequence:
        before, after = params_of(res[rank], f"before{step}_"), params_of(res[rank], f"after{step}_")
        assert sorted(before) == names and sorted(after) == names
        prev_label, prev_res, prev_prefix = previous
        for name in names:
            np.testing.assert_array_equal(
                before[name], prev_res[prev_prefix + name],
                err_msg=f"{label}: rank {rank} step {step} did not start from {prev_label}'s result ({name})")
        assert any(not np.array_equal(before[n], after[n]) for n in names), f"rank {rank} step {step} no update"
        previous = (f"rank {rank} step {step}", res[rank], f"after{step}_")
    last_rank, last_step = sequence[-1]
    for name in names:
        np.testing.assert_array_equal(res[0]["final_" + name], res[last_rank][f"after{last_step}_{name}"])


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_training_matches_stock(job_factory, case):
    _, script, mode, servers, optimizer, bound = case
    args = ["--optimizer", optimizer]
    stock = run(job_factory, "stock", script, mode, servers, args, bound)
    lazy = run(job_factory, "lazy", script, mode, servers, args, bound)

    for label, res in (("stock", stock), ("lazy", lazy)):
        check_training_moved_weights(res, script)
        if mode == "dist_async":
            check_turn_order(res, label)
        elif script == "gluon_train.py":
            # dist_sync: both ranks got the same merged-round result back from every pushpull
            for step in range(STEPS):
                np.testing.assert_array_equal(res[0][f"fc1_local_{step}"], res[1][f"fc1_local_{step}"])
        if script == "module_train.py":
            # Module.get_params(): the row_sparse weight is pulled with all rows; in dist_sync the dense ones (the
            # last pushpull's result) are the final server values too
            names = ["emb_weight"] if mode == "dist_async" else sorted(params_of(res[0], "final_"))
            for rank in range(2):
                for name in names:
                    np.testing.assert_array_equal(res[rank]["getparams_" + name], res[rank]["final_" + name])

    # The comparison proper: everything bit-identical (SGD+momentum and Adam alike).
    for rank in range(2):
        assert sorted(lazy[rank]) == sorted(stock[rank])
        for name in sorted(stock[rank]):
            s, ours = stock[rank][name], lazy[rank][name]
            assert s.dtype == ours.dtype and s.shape == ours.shape, name
            np.testing.assert_array_equal(ours, s, err_msg=f"rank {rank} {name}")


def test_gluon_embedding_sparse_grad_fails_loudly(job_factory):
    """nn.Embedding(sparse_grad=True) (dense weight, row_sparse gradient) on a dist kvstore does not work in stock
    MXNet 1.9.1: the stock server aborts on the row_sparse push to the dense key ("copying size mismatch") and the
    whole job then hangs; and the worker's following dense pull trips its own CHECK ("The value size cannot be
    changed"), since the pull reuses the push's row_sparse comm buffer. kvstore_lazy rejects the push (logged),
    answers it, and so the job ends with failing workers instead of hanging.

    One step only: a worker that fails in step k never sends its step k+1 pushpulls, so a peer that got that far
    waits forever for the dist_sync round (as with any dead worker), and the job would hang at shutdown."""
    job = job_factory("lazy", num_workers=2, num_servers=1, server="lazy",
                      mode_env={"MXNET_KVSTORE_BIGARRAY_BOUND": str(PARTITIONED)})
    job.start()
    with pytest.raises(JobFailed) as info:
        job.run_workers("gluon_train.py", ["--out", str(job.tmp / "res"), "--embedding", "sparse_grad",
                                           "--steps", "1"], timeout=90)
    message = str(info.value).splitlines()[0]
    assert "worker0 exited" in message and "worker1 exited" in message
    assert "server0 exited" not in message and "scheduler exited" not in message
    assert "The value size cannot be changed" in job.log("worker0")
    assert "row_sparse push to a dense key" in job.log("server0")
