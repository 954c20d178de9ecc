"""``kvstore-lazy <command>`` (kvstore_lazy.cli, run as ``python -m kvstore_lazy``): every command's --help, a real
inspect of a checkpoint and of a snapshot directory, a real densify, and what a bad path gives (one error line naming
it, a non-zero status). The console scripts of pyproject.toml name functions that exist."""
from __future__ import annotations

import importlib
import subprocess
import sys
import tomllib

import mxnet as mx
import numpy as np
import pytest

from cluster import ROOT
from kvstore_lazy.numerics.initializers import parse_initializer
from kvstore_lazy.persist import sidecar, snapshots
from kvstore_lazy.worker import save_rows

UNIFORM = mx.init.Uniform(0.07).dumps()
ROWS, DIM = 500, 4


def run(*args, module="kvstore_lazy") -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *map(str, args)], capture_output=True, text=True,
                          timeout=120, cwd=str(ROOT))


def checkpoint_file(path):
    """A lazy weight with rows 3, 17, 499 stored (key 9, seed 4) and a dense bias, as the patched savers write."""
    ids = np.array([3, 17, 499], np.int64)
    values = np.arange(len(ids) * DIM, dtype=np.float32).reshape(len(ids), DIM) - 50
    spec = {"key": 9, "rows": ROWS, "row_shape": [DIM], "dtype": "float32", "init": UNIFORM, "seed": 4}
    save_rows(str(path), {"emb": ((ROWS, DIM), ids, values), "bias": mx.nd.array([0.5, 1.5, 2.5])},
              specs={"emb": spec})
    return ids, values


def table(row_ids, dim=DIM, states=1):
    row_ids = np.asarray(row_ids, np.uint64)
    weights = np.arange(len(row_ids) * dim, dtype=np.float32).reshape(len(row_ids), dim)
    return {"row_ids": row_ids, "weights": weights, "states": [weights * 0 for _ in range(states)],
            "meta": {"kind": "lazy"}}


@pytest.mark.parametrize("command", [None, "server", "launch", "densify", "inspect", "ready"])
def test_every_command_has_help(command):
    done = run(*([command] if command else []), "--help")
    assert done.returncode == 0, done.stderr
    prog = "kvstore-lazy" if command is None else f"kvstore-lazy {command}"
    assert done.stdout.startswith(f"usage: {prog} "), done.stdout
    if command is None:
        for name in ("server", "launch", "densify", "inspect", "ready"):
            assert name in done.stdout


@pytest.mark.parametrize("args", [[], ["no-such-command"]])
def test_a_missing_or_unknown_command_is_a_usage_error(args):
    done = run(*args)
    assert done.returncode == 2 and done.stdout == ""
    assert "usage: kvstore-lazy " in done.stderr and "kvstore-lazy: error: " in done.stderr


@pytest.mark.parametrize("module", ["kvstore_lazy.server", "kvstore_lazy.launch"])
def test_the_python_m_forms_still_work(module):
    done = run("--help", module=module)
    assert done.returncode == 0 and done.stdout.startswith("usage: "), done.stderr


def test_inspect_a_checkpoint_and_its_sidecar(tmp_path):
    checkpoint_file(tmp_path / "model.params")
    done = run("inspect", tmp_path / "model.params")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == (f"{tmp_path / 'model.params'}: MXNet NDArray file, 2 entries; sidecar model.params.lazy.json: "
                        f"1 lazy parameters")
    assert f"  arg:emb: row_sparse ({ROWS}, {DIM}) float32, 3 rows stored; lazy: key 9, {ROWS:,} rows of ({DIM},) " \
           f"float32, init {UNIFORM}, seed 4" in lines
    assert "  arg:bias: default (3,) float32" in lines


def test_inspect_a_stock_file(tmp_path):
    mx.nd.save(str(tmp_path / "stock.params"), {"w": mx.nd.ones((2, 5))})
    done = run("inspect", tmp_path / "stock.params")
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [f"{tmp_path / 'stock.params'}: MXNet NDArray file, 1 entries; no sidecar "
                                        f"(a stock file)", "  w: default (2, 5) float32"]


def test_inspect_a_snapshot_directory_folds_the_deltas(tmp_path):
    snap = tmp_path / "snap"
    chain = snapshots.SnapshotChain(snap, 1, 2)
    chain.write({"tag": None}, {4: table([1, 5, 9]), 6: table([0], dim=2, states=0)}, delta=False)
    chain.write({"tag": None}, {4: dict(table([7, 11]), mode="delta")}, delta=True)
    snapshots.write_snapshot(snap, 0, 2, {4: table([2])})
    done = run("inspect", snap)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == f"{snap / 'rank0'}: server snapshot, rank 0 of 2, 1 keys"
    assert lines[1] == f"  key 4: lazy, 1 rows of ({DIM},) float32, 1 optimizer states"
    assert lines[2].startswith(f"{snap / 'rank1'}: server snapshot, rank 1 of 2, 2 keys, chain ")
    assert lines[2].endswith(": base + 1 deltas")
    assert lines[3:] == [f"  key 4: lazy, 5 rows of ({DIM},) float32, 1 optimizer states",
                         "  key 6: lazy, 1 rows of (2,) float32, 0 optimizer states"]
    # one rank's directory alone says the same about that rank
    assert run("inspect", snap / "rank1").stdout.splitlines() == lines[2:]


def test_densify_through_the_command(tmp_path):
    ids, values = checkpoint_file(tmp_path / "in.params")
    done = run("densify", tmp_path / "in.params", tmp_path / "out.params")
    assert done.returncode == 0, done.stderr
    assert f"arg:emb: {ROWS} of {ROWS} rows (3 stored, {ROWS - 3} initial values)" in done.stdout
    out = mx.nd.load(str(tmp_path / "out.params"))
    want = parse_initializer(UNIFORM).rows(4, 9, np.arange(ROWS, dtype=np.uint64), (ROWS, DIM), np.float32)
    want[ids] = values
    np.testing.assert_array_equal(out["arg:emb"].data.asnumpy(), want)
    np.testing.assert_array_equal(out["arg:bias"].asnumpy(), [0.5, 1.5, 2.5])
    assert not sidecar.sidecar_path(tmp_path / "out.params").exists()
    # the output is a stock file now: inspect says so
    assert "no sidecar (a stock file)" in run("inspect", tmp_path / "out.params").stdout


@pytest.mark.parametrize("case", ["missing", "empty-dir", "not-ndarray", "bad-sidecar"])
def test_inspect_a_bad_path_one_error_line_naming_it(tmp_path, case):
    path = tmp_path / ("missing.params" if case == "missing" else "thing")
    if case == "empty-dir":
        path.mkdir()
    elif case == "not-ndarray":
        path.write_bytes(b"not a checkpoint at all")
    elif case == "bad-sidecar":
        checkpoint_file(path)
        sidecar.sidecar_path(path).write_text("{")
    done = run("inspect", path)
    assert done.returncode == 1 and done.stdout == ""
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("inspect: error: ") and str(path) in lines[0], done.stderr


def test_densify_a_bad_path_one_error_line(tmp_path):
    done = run("densify", tmp_path / "missing.params", tmp_path / "out.params")
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.splitlines() == [f"densify: error: {tmp_path / 'missing.params'}: no such file"]
    assert list(tmp_path.iterdir()) == []


def test_ready_without_a_live_server_is_not_ready(tmp_path):
    done = run("ready", tmp_path / "status.json")
    assert done.returncode == 1 and done.stdout.startswith("not ready: "), (done.stdout, done.stderr)


def test_console_scripts_name_functions_that_exist():
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["kvstore-lazy"] == "kvstore_lazy.cli:main"
    assert scripts["kvstore-lazy-server"] == "kvstore_lazy.cli:server_main"
    for target in scripts.values():
        module, _, name = target.partition(":")
        assert callable(getattr(importlib.import_module(module), name))
