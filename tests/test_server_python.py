"""Our servers on another Python and numpy than the workers': ``KVSTORE_LAZY_SERVER_PYTHON``.

``make test-server-python`` (part of ``make test``) builds the wheel, installs it with nothing but its pinned
dependencies into a CPython 3.13 venv with numpy 2 (requirements-server.txt), leaves no C compiler on PATH, and runs
these tests and a few real jobs under this Python (3.11, stock mxnet), with KVSTORE_LAZY_SERVER_PYTHON pointing at
that venv's interpreter: tests/cluster.py then starts our servers with it, isolated from this source tree
(``python -I -m kvstore_lazy.server``). Here:

- that interpreter imports kvstore_lazy from its own site-packages, with the wheel's compiled kernels, no mxnet and
  no compiler;
- its arithmetic is bit-identical: every optimizer (dense; row_sparse through both server paths; compiled kernels
  and numpy expressions; the rows of optimizers stock runs on every row, brought over missed steps) to MXNet 1.9.1
  itself, run here; all of tests/server_numerics.py (initializers, 2-bit
  dequantization too) to this Python's numpy;
- a real job runs with its servers on that interpreter (checked in /proc: executable and the kernels it mapped).

Skipped without KVSTORE_LAZY_SERVER_PYTHON.
"""
from __future__ import annotations

import json
import pickle
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from cluster import ROOT, SERVER_PYTHON
from common import load

pytestmark = pytest.mark.skipif(not SERVER_PYTHON, reason="KVSTORE_LAZY_SERVER_PYTHON is not set "
                                                         "(make test-server-python sets it)")
COMPILERS = ("cc", "gcc", "c99", "clang", "tcc")


def server_python(*args: str, timeout: float = 300) -> str:
    proc = subprocess.run([SERVER_PYTHON, "-I", *args], capture_output=True, text=True, timeout=timeout,
                          cwd="/")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_the_server_python_runs_the_installed_wheel_without_a_compiler():
    info = json.loads(server_python("-c", f"""
import importlib.util, json, shutil, sys, sysconfig, numpy
from kvstore_lazy.store import kernels
import kvstore_lazy.server.core
print(json.dumps({{"package": kvstore_lazy.__file__, "library": str(kernels.LIBRARY), "numpy": numpy.__version__,
    "python": sys.version, "mxnet": importlib.util.find_spec("mxnet") is not None,
    "compilers": [c for c in {COMPILERS!r} + ((sysconfig.get_config_var("CC") or "cc").split()[0],) if shutil.which(c)],
    "loaded": [m for m in sys.modules if m.startswith("kvstore_lazy")]}}))
"""))
    package = Path(info["package"]).resolve()
    assert package.parent != (ROOT / "kvstore_lazy").resolve(), "the server python imported this source tree"
    assert "site-packages" in package.parts, package
    assert Path(info["library"]).resolve() == package.parent / "store" / "_kernels.so"
    assert info["compilers"] == [], f"a C compiler is on the server's PATH: {info['compilers']}"
    assert not info["mxnet"], "the server venv has mxnet: it should hold only what the server needs"
    assert "kvstore_lazy.server.core" in info["loaded"]
    print(f"server python {info['python'].split()[0]}, numpy {info['numpy']}, {package}")


def _states(state):
    from test_optimizers import _states_as_numpy
    return _states_as_numpy(state)


def _mxnet_dense(mx, make, case, numerics):
    """MXNet's weights and states after the dense steps of server_numerics.run_dense."""
    updater = mx.optimizer.get_updater(make())
    weights, grads = numerics.dense_data(case)
    arrays = {k: mx.nd.array(w) for k, w in weights.items()}
    for step in range(numerics.STEPS):
        for key in numerics.SHAPES:
            updater(key, mx.nd.array(grads[step][key]), arrays[key])
    out = {f"w{k}": a.asnumpy() for k, a in arrays.items()}
    for key in numerics.SHAPES:
        out.update({f"s{key}.{i}": s for i, s in enumerate(_states(updater.states[key]))})
    return out


def _mxnet_sparse(mx, make, numerics, data=None):
    """MXNet's updater over a row_sparse weight holding every row, fed the rounds of server_numerics.sparse_data
    (or `data`: catchup_data, whose optimizers move every row every step)."""
    updater = mx.optimizer.get_updater(make())
    initial, steps = (data or numerics.sparse_data)()
    shape = (numerics.ROWS, numerics.COLS)
    weight = mx.nd.sparse.row_sparse_array((initial, np.arange(numerics.ROWS)), shape=shape)
    for idx, grad in steps:
        updater(numerics.SPARSE_KEY, mx.nd.sparse.row_sparse_array((grad, idx), shape=shape), weight)
    return {"w": weight.asnumpy(), **{f"s{i}": s for i, s in enumerate(_states(updater.states[numerics.SPARSE_KEY]))}}


def _arrays(path: Path) -> dict[str, np.ndarray]:
    with np.load(path, allow_pickle=False) as npz:
        return {name: npz[name] for name in npz.files}


def _same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def test_server_arithmetic_is_bit_identical_to_mxnet_and_to_this_numpy(tmp_path):
    mx = pytest.importorskip("mxnet")
    import server_numerics as numerics
    from test_catchup import CASES as EVERY_ROW_CASES
    from test_optimizers import DENSE_CASES, SPARSE_CASES

    cases = {"dense": {c: pickle.dumps(make(), 0).decode("latin-1") for c, make in DENSE_CASES.items()},
             "sparse": {c: pickle.dumps(make(), 0).decode("latin-1") for c, make in SPARSE_CASES.items()},
             "catchup": {c: pickle.dumps(make(), 0).decode("latin-1") for c, make in EVERY_ROW_CASES.items()}}
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    script, cases_file = str(ROOT / "tests" / "server_numerics.py"), str(tmp_path / "cases.json")
    print(server_python(script, cases_file, str(tmp_path / "theirs.npz")).strip())
    subprocess.run([sys.executable, script, cases_file, str(tmp_path / "ours.npz")], check=True, timeout=300,
                   cwd=ROOT)
    theirs, ours = _arrays(tmp_path / "theirs.npz"), _arrays(tmp_path / "ours.npz")
    assert sorted(theirs) == sorted(ours) and len(ours) > 300
    differ = [name for name in ours if not _same_bits(theirs[name], ours[name])]
    assert not differ, f"{len(differ)} results differ from this Python's numpy, e.g. {differ[:10]}"

    against_mxnet = 0
    for case, make in DENSE_CASES.items():
        for name, want in _mxnet_dense(mx, make, case, numerics).items():
            for path in ("kernels", "numpy"):
                assert _same_bits(theirs[f"dense/{case}/{path}/{name}"], want), f"dense {case} {path} {name}"
                against_mxnet += 1
    for case, make in SPARSE_CASES.items():
        for name, want in _mxnet_sparse(mx, make, numerics).items():
            for how in ("gathered-kernels", "gathered-numpy", "in_place-kernels", "in_place-numpy"):
                assert _same_bits(theirs[f"sparse/{case}/{how}/{name}"], want), f"sparse {case} {how} {name}"
                against_mxnet += 1
    for case, make in EVERY_ROW_CASES.items():
        for name, want in _mxnet_sparse(mx, make, numerics, numerics.catchup_data).items():
            assert _same_bits(theirs[f"catchup/{case}/{name}"], want), f"catchup {case} {name}"
            against_mxnet += 1
    assert against_mxnet > 290


def _wait_for_mapping(pid: int, path: Path, timeout: float = 60) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if str(path) in Path(f"/proc/{pid}/maps").read_text():
                return True
        except (FileNotFoundError, ProcessLookupError):
            return False
        time.sleep(0.05)
    return False


@pytest.mark.integration
def test_a_job_runs_with_its_servers_on_the_server_python(job_factory):
    library = Path(server_python("-c", "from kvstore_lazy.store import kernels; print(kernels.LIBRARY)").strip())
    job = job_factory("lazy", num_workers=2, num_servers=2, server="lazy",
                      mode_env={"MXNET_KVSTORE_BIGARRAY_BOUND": "1000"})
    job.start()
    for proc in job.procs:
        if proc.name.startswith("server"):
            assert Path(f"/proc/{proc.popen.pid}/exe").resolve() == Path(SERVER_PYTHON).resolve()
            assert _wait_for_mapping(proc.popen.pid, library), f"{proc.name} never loaded {library}\n{job.report()}"
    out = str(job.tmp / "res")
    job.run_workers("dense.py", ["--out", out, "--mode", "dist_sync", "--optimizer", "test"], timeout=120)
    res = [load(out, rank) for rank in range(2)]
    for key in (3, 7, 99):
        assert not np.array_equal(res[0][f"final_{key}"], res[0][f"init_{key}"])
        np.testing.assert_array_equal(res[0][f"final_{key}"], res[1][f"final_{key}"])
