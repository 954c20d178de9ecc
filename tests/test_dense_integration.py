"""Dense keys against stock workers: the same worker script against the stock C++ server and against kvstore_lazy,
in the same test, must give the same values (bit-identical where the stock result is deterministic)."""
import numpy as np
import pytest

from common import load

pytestmark = pytest.mark.integration

BOUND = {"MXNET_KVSTORE_BIGARRAY_BOUND": "1000"}   # keys 7 (2000) and 99 (5535 elements) are partitioned

CASES = [
    # id, mode, servers, worker args, exact?
    ("sync-1s-noopt", "dist_sync", 1, [], True),
    ("sync-2s-test", "dist_sync", 2, ["--optimizer", "test"], True),
    ("sync-2s-sgd", "dist_sync", 2, ["--optimizer", "sgd"], False),
    ("sync-1s-adam", "dist_sync", 1, ["--optimizer", "adam"], False),
    ("sync-2s-fp16-mp-sgd", "dist_sync", 2, ["--dtype", "float16", "--optimizer", "sgd", "--multi-precision"], False),
    ("sync-2s-fp16-test", "dist_sync", 2, ["--dtype", "float16", "--optimizer", "test"], True),
    ("sync-2s-2bit", "dist_sync", 2, ["--compression", "0.5", "--optimizer", "test"], True),
    ("async-2s-test", "dist_async", 2, ["--optimizer", "test"], True),
    ("async-1s-2bit-test", "dist_async", 1, ["--compression", "0.5", "--optimizer", "test"], True),
]


def run(job_factory, server, mode, servers, args):
    job = job_factory(server, num_workers=2, num_servers=servers, server=server, mode_env=BOUND)
    job.start()
    out = str(job.tmp / "res")
    job.run_workers("dense.py", ["--out", out, "--mode", mode] + args, timeout=120)
    return [load(out, r) for r in range(2)], job


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_dense_matches_stock(job_factory, case):
    _, mode, servers, args, exact = case
    # The stock server's dist_async path loses updates now and then (seen here: one run in two; its async branch
    # hands the updater an NDArray over the request's buffer). With MXNet's 'test' optimizer the final value is
    # init + rescale * (sum of every pushed gradient), whatever the order, so the reference for an async run is
    # the same script run in dist_sync against the stock server, compared on the final values.
    stock, _ = run(job_factory, "stock", "dist_sync", servers, args)
    lazy, _ = run(job_factory, "lazy", mode, servers, args)
    for rank in range(2):
        names = (sorted(stock[rank]) if mode == "dist_sync"
                 else [n for n in stock[rank] if n.startswith(("init", "final"))])
        assert sorted(lazy[rank]) == sorted(names)
        for name in names:
            s, ours = stock[rank][name], lazy[rank][name]
            assert s.dtype == ours.dtype and s.shape == ours.shape, name
            if exact:
                np.testing.assert_array_equal(ours, s, err_msg=f"rank {rank} {name}")
            else:
                rtol = 1e-3 if s.dtype == np.float16 else 1e-6
                np.testing.assert_allclose(ours, s, rtol=rtol, atol=1e-7, err_msg=f"rank {rank} {name}")
    # the job did real work: values moved away from their init
    assert any(not np.array_equal(lazy[0][f"final_{k}"], lazy[0][f"init_{k}"]) for k in (3, 7, 99))
