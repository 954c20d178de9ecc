"""kvstore_lazy.persist.checkpoint: atomic files, the checkpoint sidecar (.lazy.json) and densify.

- a save that fails leaves the previous file and no temp file; files get the mode open() would give them;
- why a sidecar and not an extra entry: stock Gluon load_parameters and Module.load_params refuse a file with an
  extra entry; the sidecar leaves every stock reader (mx.nd.load, mx.model.load_checkpoint, Gluon
  load_parameters) loading the file unchanged;
- MXNet's NDArray::Save writes a row_sparse array's storage shape before it waits for the array, so an array a
  pending copyto is giving fewer rows (Module.get_params of a lazy weight) is saved with a stale row count there:
  ndfile reads such a file as mx.nd.load does (by the row ids' length), and a save waits for pending writes to its
  arrays first, so checkpoints never have one (a flake of test_lazy_eval under load);
- the sidecar describes exactly one version of the file: a crash between writing it and renaming the new file in
  leaves a pair that still matches, a file rewritten by other code is refused, a sidecar that disagrees with the
  file is refused;
- densify: every row (or the stored and asked-for rows) with their stored or initial values, other entries byte
  for byte, read back by mx.nd.load; bad input gives one error line, exit 1 and no file; it never imports mxnet;
  memory does not grow with the parameter (measured on a 1e7 x 8 parameter).
"""
import json
import os
import stat
import struct
import subprocess
import sys
import time
from pathlib import Path

import mxnet as mx
import numpy as np
import pytest

from cluster import ROOT
from kvstore_lazy.persist import atomic, sidecar
from kvstore_lazy.persist import ndfile
from kvstore_lazy.numerics.initializers import parse_initializer
from kvstore_lazy.worker import save_ndarrays, save_rows

UNIFORM = mx.init.Uniform(0.07).dumps()
ROWS, DIM = 1000, 3


def spec(rows=ROWS, seed=5, key=7, init=UNIFORM, dim=DIM):
    return {"key": key, "rows": rows, "row_shape": [dim], "dtype": "float32", "init": init, "seed": seed}


def lazy_file(path, seed=5, ids=(2, 40, 999), prefix="arg:", name="emb", bias=True):
    """A checkpoint as the patched Module writes one: a lazy weight with `ids` stored, a dense bias."""
    ids = np.asarray(ids, np.int64)
    values = np.arange(len(ids) * DIM, dtype=np.float32).reshape(len(ids), DIM) + 100
    arrays = {name: ((ROWS, DIM), ids, values)}
    if bias:
        arrays["bias"] = mx.nd.array([1.5, -2.0])
    save_rows(str(path), arrays, prefix=prefix, specs={name: spec(seed=seed)})
    return ids, values


def initial(ids, seed=5, key=7):
    return parse_initializer(UNIFORM).rows(seed, key, np.asarray(ids, np.uint64), (ROWS, DIM), np.float32)


def leftovers(directory):
    return [p.name for p in directory.iterdir() if p.name.endswith(".tmp")]


# ----------------------------------------------------------------------------------------------------------------
# atomic files

def test_failed_save_leaves_the_previous_file_and_no_temp_file(tmp_path):
    path = tmp_path / "f.params"
    atomic.atomic_write(path, lambda fh: fh.write(b"old"))

    def fail(fh):
        fh.write(b"half of the new")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        atomic.atomic_write(path, fail)
    assert path.read_bytes() == b"old" and leftovers(tmp_path) == []
    atomic.atomic_write(path, lambda fh: fh.write(b"new"))
    assert path.read_bytes() == b"new" and leftovers(tmp_path) == []


def test_files_get_the_mode_open_would_give_them(tmp_path):
    old = os.umask(0o022)
    try:
        lazy_file(tmp_path / "m.params")
    finally:
        os.umask(old)
    for name in ("m.params", "m.params.lazy.json"):
        assert stat.S_IMODE((tmp_path / name).stat().st_mode) == 0o644, name


class _Slow(mx.operator.CustomOp):
    """Copies its input 0.5 s after the engine runs it: a write still pending when the caller goes on."""

    def forward(self, is_train, req, in_data, out_data, aux):
        time.sleep(0.5)
        self.assign(out_data[0], req[0], in_data[0])

    def backward(self, req, out_grad, in_data, out_data, in_grad, aux):
        raise NotImplementedError


@mx.operator.register("kvstore_lazy_test_slow")
class _SlowProp(mx.operator.CustomOpProp):
    def __init__(self):
        super().__init__(need_top_grad=False)

    def list_arguments(self):
        return ["data"]

    def list_outputs(self):
        return ["output"]

    def infer_shape(self, in_shape):
        return in_shape, in_shape, []

    def create_operator(self, ctx, shapes, dtypes):
        return _Slow()


PENDING_IDS = np.array([2, 40, 999], np.int64)


def pending_weight():
    """What Module.get_params leaves in a lazy job: a row_sparse weight holding every row (the executor's copy), and
    a copyto still pending that leaves it holding only PENDING_IDS (the rows the servers hold), with values."""
    weight = mx.nd.sparse.row_sparse_array((np.ones((ROWS, DIM), np.float32), np.arange(ROWS)), shape=(ROWS, DIM))
    dense = np.zeros((ROWS, DIM), np.float32)
    dense[PENDING_IDS] = np.arange(1, 1 + len(PENDING_IDS) * DIM, dtype=np.float32).reshape(-1, DIM)
    mx.nd.Custom(mx.nd.array(dense), op_type="kvstore_lazy_test_slow").tostype("row_sparse").copyto(weight)
    return weight, dense[PENDING_IDS]


def header_storage_shape(path) -> tuple:
    """The storage shape the header of the file's first array (row_sparse) states: bytes 32.. (after the list
    header, the array's magic and storage type)."""
    ndim, rows, cols = struct.unpack_from("<iqq", Path(path).read_bytes(), 32)
    assert ndim == 2
    return rows, cols


def test_a_stock_save_of_an_array_being_written_is_read_as_mx_nd_load_reads_it(tmp_path):
    """The cause of the flake, in stock MXNet: NDArray::Save writes the storage shape of every row before it waits,
    then the 3 rows the pending copy leaves. mx.nd.load goes by the row ids' length, so does ndfile."""
    path = tmp_path / "stock.params"
    weight, values = pending_weight()
    mx.nd.save(str(path), {"arg:emb": weight})
    assert header_storage_shape(path) == (ROWS, DIM)
    loaded = mx.nd.load(str(path))["arg:emb"]
    np.testing.assert_array_equal(loaded.indices.asnumpy(), PENDING_IDS)
    np.testing.assert_array_equal(loaded.data.asnumpy(), values)
    (entry,) = ndfile.read_index(path)
    assert (entry.name, entry.rows_stored, entry.end) == ("arg:emb", 3, path.stat().st_size - 8 - 8 - len("arg:emb"))
    np.testing.assert_array_equal(ndfile.read_row_ids(path, entry), PENDING_IDS)
    np.testing.assert_array_equal(ndfile.read_values(path, entry), values)


def test_save_ndarrays_waits_for_pending_writes_to_its_arrays(tmp_path):
    """So a checkpoint's header states the rows it holds: byte for byte what a save of the settled arrays writes."""
    path, settled = tmp_path / "job-0001.params", tmp_path / "settled.params"
    weight, values = pending_weight()
    arrays = {"arg:emb": weight, "arg:bias": mx.nd.array([1.5])}
    save_ndarrays(str(path), arrays, lazy={"arg:emb": spec()})
    assert header_storage_shape(path) == (3, DIM)
    mx.nd.save(str(settled), arrays)
    assert path.read_bytes() == settled.read_bytes()
    assert sidecar.lazy_params(path) == {"arg:emb": spec()}
    np.testing.assert_array_equal(mx.nd.load(str(path))["arg:emb"].data.asnumpy(), values)


# ----------------------------------------------------------------------------------------------------------------
# the sidecar and stock readers

class GluonNet(mx.gluon.Block):
    def __init__(self):
        super().__init__(prefix="net_")
        with self.name_scope():
            self.emb = mx.gluon.contrib.nn.SparseEmbedding(ROWS, DIM, prefix="emb_")


def test_sidecar_keeps_every_stock_reader_working_an_extra_entry_would_not(tmp_path):
    ids, values = lazy_file(tmp_path / "job-0001.params")
    assert sidecar.lazy_params(tmp_path / "job-0001.params") == {"arg:emb": spec()}
    loaded = mx.nd.load(str(tmp_path / "job-0001.params"))
    assert sorted(loaded) == ["arg:bias", "arg:emb"]
    np.testing.assert_array_equal(loaded["arg:emb"].indices.asnumpy(), ids)
    arg_params, aux_params = mx.model.load_params(str(tmp_path / "job"), 1)
    assert sorted(arg_params) == ["bias", "emb"] and aux_params == {}
    lazy_file(tmp_path / "gluon.params", prefix="", name="emb.weight", bias=False)   # Gluon's names: dotted
    net = GluonNet()
    net.load_parameters(str(tmp_path / "gluon.params"), ignore_extra=False)
    np.testing.assert_array_equal(net.emb.weight._data[0].data.asnumpy(), values)

    # the alternative, metadata as an extra entry of the file: mx.nd.load and load_checkpoint would cope, but
    # Gluon's load_parameters and Module.load_params refuse the file
    extra = dict(mx.nd.load(str(tmp_path / "gluon.params")), **{"kvstore_lazy:meta": mx.nd.zeros(1)})
    mx.nd.save(str(tmp_path / "extra.params"), extra)
    with pytest.raises(ValueError, match="kvstore_lazy:meta"):
        GluonNet().load_parameters(str(tmp_path / "extra.params"))
    mx.nd.save(str(tmp_path / "extra-0001.params"), dict(loaded, **{"kvstore_lazy:meta": mx.nd.zeros(1)}))
    assert sorted(mx.model.load_params(str(tmp_path / "extra"), 1)[0]) == ["bias", "emb"]
    module = mx.mod.Module(mx.sym.Variable("x"), data_names=["x"], label_names=None)
    with pytest.raises(ValueError, match="Invalid param file"):
        module.load_params(str(tmp_path / "extra-0001.params"))


def test_a_crash_before_the_rename_leaves_a_matching_pair(tmp_path, monkeypatch):
    path = tmp_path / "c.params"
    lazy_file(path, seed=1)
    before = path.read_bytes()
    real_replace = os.replace

    def crash(src, dst):
        if str(dst) == str(path):
            raise KeyboardInterrupt("killed between the sidecar and the rename")
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(KeyboardInterrupt):
        lazy_file(path, seed=2, ids=(1, 2, 3, 4))
    monkeypatch.setattr(os, "replace", real_replace)
    assert path.read_bytes() == before and leftovers(tmp_path) == []
    versions = json.loads(sidecar.sidecar_path(path).read_text())["versions"]
    assert [v["params"]["arg:emb"]["seed"] for v in versions] == [2, 1]   # the new one, and the file's
    assert sidecar.lazy_params(path)["arg:emb"]["seed"] == 1
    lazy_file(path, seed=3)
    assert sidecar.lazy_params(path)["arg:emb"]["seed"] == 3


def test_a_sidecar_is_never_applied_to_another_file(tmp_path):
    path = tmp_path / "s.params"
    lazy_file(path)
    mx.nd.save(str(path), dict(mx.nd.load(str(path)), **{"arg:bias": mx.nd.array([3.0])}))   # rewritten by stock code
    with pytest.raises(sidecar.CheckpointError, match="does not describe"):
        sidecar.lazy_params(path)

    lazy_file(path)
    side = sidecar.sidecar_path(path)
    doc = json.loads(side.read_text())
    doc["versions"][0]["params"]["arg:emb"]["rows"] = 2000
    side.write_text(json.dumps(doc))
    with pytest.raises(sidecar.CheckpointError, match=r"'arg:emb' is row_sparse \(1000, 3\) float32, its sidecar "
                                                         r"says row_sparse \(2000, 3\)"):
        sidecar.lazy_params(path)
    side.write_text("{not json")
    with pytest.raises(sidecar.CheckpointError, match="unreadable"):
        sidecar.lazy_params(path)
    save_rows(str(path), {"emb": ((ROWS, DIM), [1], np.ones((1, DIM), np.float32))})   # no specs: a stock file
    assert not side.exists() and sidecar.lazy_params(path) is None


def test_save_rows_refuses_specs_that_do_not_fit_and_writes_nothing(tmp_path):
    with pytest.raises(ValueError, match=r"specs\['other'\].*missing"):
        save_rows(str(tmp_path / "x.params"), {"emb": ((ROWS, DIM), [1], np.ones((1, DIM)))},
                  specs={"other": spec()})
    with pytest.raises(ValueError, match=r"shape \(2000, 3\)"):
        save_rows(str(tmp_path / "x.params"), {"emb": ((ROWS, DIM), [1], np.ones((1, DIM)))},
                  specs={"emb": spec(rows=2000)})
    assert list(tmp_path.iterdir()) == []


# ----------------------------------------------------------------------------------------------------------------
# densify

def densify(*args, cwd=ROOT):
    return subprocess.run([sys.executable, "-m", "kvstore_lazy.persist.checkpoint", "densify", *map(str, args)],
                          capture_output=True, text=True, timeout=120, cwd=str(cwd))


def test_densify_all_rows(tmp_path):
    ids, values = lazy_file(tmp_path / "in.params")
    done = densify(tmp_path / "in.params", tmp_path / "out.params")
    assert done.returncode == 0, done.stderr
    assert "arg:emb: 1,000 of 1,000 rows (3 stored, 997 initial values)" in done.stdout
    out = mx.nd.load(str(tmp_path / "out.params"))
    assert sorted(out) == ["arg:bias", "arg:emb"] and out["arg:emb"].stype == "row_sparse"
    np.testing.assert_array_equal(out["arg:emb"].indices.asnumpy(), np.arange(ROWS))
    want = initial(np.arange(ROWS))
    want[ids] = values
    np.testing.assert_array_equal(out["arg:emb"].data.asnumpy(), want)
    np.testing.assert_array_equal(out["arg:bias"].asnumpy(), [1.5, -2.0])
    src = {e.name: e for e in ndfile.read_index(tmp_path / "in.params")}["arg:bias"]
    dst = {e.name: e for e in ndfile.read_index(tmp_path / "out.params")}["arg:bias"]
    assert (tmp_path / "in.params").read_bytes()[src.start:src.end] == \
        (tmp_path / "out.params").read_bytes()[dst.start:dst.end]
    assert not sidecar.sidecar_path(tmp_path / "out.params").exists()   # a plain stock file


def test_densify_requested_rows_keeps_a_lazy_checkpoint(tmp_path):
    ids, values = lazy_file(tmp_path / "in.params")
    (tmp_path / "rows.txt").write_text("5\n40, 7\n5\n")
    done = densify(tmp_path / "in.params", tmp_path / "some.params", "--rows", tmp_path / "rows.txt")
    assert done.returncode == 0, done.stderr
    out = mx.nd.load(str(tmp_path / "some.params"))["arg:emb"]
    want_ids = np.array([2, 5, 7, 40, 999])
    np.testing.assert_array_equal(out.indices.asnumpy(), want_ids)
    np.testing.assert_array_equal(out.data.asnumpy()[[1, 2]], initial([5, 7]))
    np.testing.assert_array_equal(out.data.asnumpy()[[0, 3, 4]], values)
    # the other rows are still absent, so the output has a sidecar: densifying it gives what densifying the input does
    assert sidecar.lazy_params(tmp_path / "some.params") == {"arg:emb": spec()}
    assert densify(tmp_path / "some.params", tmp_path / "all-a.params").returncode == 0
    assert densify(tmp_path / "in.params", tmp_path / "all-b.params").returncode == 0
    assert (tmp_path / "all-a.params").read_bytes() == (tmp_path / "all-b.params").read_bytes()


@pytest.mark.parametrize("case,message", [
    ("missing", "missing.params: no such file"),
    ("stock", "is not a kvstore_lazy checkpoint (no stock.params.lazy.json beside it)"),
    ("out-of-range", "row id 1000 in {rows} is out of range for 'arg:emb' (1,000 rows: 0 to 999)"),
    ("not-a-number", "{rows}: '3.5' is not a row id"),
    ("negative", "{rows}: row id -4 is negative"),
    ("no-rows-file", "{rows}: cannot read the rows file"),
    ("same", "the output must not be the input"),
    ("not-ndarray", "not an MXNet NDArray file"),
])
def test_densify_bad_input_one_error_line_nonzero_exit_nothing_written(tmp_path, case, message):
    lazy_file(tmp_path / "in.params")
    mx.nd.save(str(tmp_path / "stock.params"), {"a": mx.nd.ones(2)})
    rows = tmp_path / "rows.txt"
    rows.write_text({"out-of-range": "3 1000", "not-a-number": "1 3.5", "negative": "7 -4"}.get(case, "1"))
    if case == "no-rows-file":
        rows.unlink()
    if case == "not-ndarray":
        (tmp_path / "in.params").write_bytes(b"garbage")
        (tmp_path / "in.params.lazy.json").write_text(json.dumps({"format": sidecar.SIDECAR_FORMAT, "versions": [
            {"sha256": atomic.file_digest(tmp_path / "in.params")[0], "bytes": 7, "params": {}}]}))
    src = {"missing": tmp_path / "missing.params", "stock": tmp_path / "stock.params"}.get(case, tmp_path / "in.params")
    dst = src if case == "same" else tmp_path / "out" / "out.params"
    before = sorted(p.name for p in tmp_path.iterdir())
    done = densify(src, dst, *(["--rows", rows] if case in ("out-of-range", "not-a-number", "negative",
                                                             "no-rows-file") else []))
    assert done.returncode == 1 and done.stdout == ""
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("densify: error: "), done.stderr
    assert message.format(rows=rows) in lines[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == before   # no output, no temp file, no directory


def test_densify_never_imports_mxnet(tmp_path):
    lazy_file(tmp_path / "in.params")
    code = ("import sys; from kvstore_lazy.persist.checkpoint import main; rc = main(sys.argv[1:]); "
            "assert 'mxnet' not in sys.modules, 'mxnet imported'; sys.exit(rc)")
    done = subprocess.run([sys.executable, "-c", code, "densify", str(tmp_path / "in.params"),
                           str(tmp_path / "out.params")], capture_output=True, text=True, timeout=120, cwd=str(ROOT))
    assert done.returncode == 0, done.stderr


def test_densify_memory_does_not_grow_with_the_parameter(tmp_path):
    """1e7 x 8 float32 (305 MiB of values; the output file is 381 MiB) with 1000 stored rows: the densify process
    peaks far below one copy of the parameter (written in chunks of at most CHUNK_VALUES values and CHUNK_ROWS rows;
    measured 55 MiB peak for 2e7 x 8)."""
    rows = 10_000_000
    ids = np.sort(np.random.RandomState(0).choice(rows, 1000, replace=False))
    save_rows(str(tmp_path / "big.params"), {"emb": ((rows, 8), ids, np.ones((1000, 8), np.float32))},
              specs={"emb": spec(rows=rows, dim=8)})
    # VmHWM, not getrusage's ru_maxrss: that one keeps the peak of the forked parent (this pytest, with mxnet)
    code = ("import sys; from kvstore_lazy.persist.checkpoint import main; rc = main(sys.argv[1:]); "
            "print('VmHWM_kb', [l.split()[1] for l in open('/proc/self/status') if l.startswith('VmHWM')][0]); "
            "sys.exit(rc)")
    done = subprocess.run([sys.executable, "-c", code, "densify", str(tmp_path / "big.params"),
                           str(tmp_path / "dense.params")], capture_output=True, text=True, timeout=300, cwd=str(ROOT))
    assert done.returncode == 0, done.stderr
    peak = int(done.stdout.split("VmHWM_kb")[1]) * 1024
    assert peak < rows * 8 * 4 / 3, f"densify peaked at {peak >> 20} MiB"
    entry = {e.name: e for e in ndfile.read_index(tmp_path / "dense.params")}["arg:emb"]
    assert (entry.shape, entry.rows_stored) == ((rows, 8), rows)
    got = ndfile.read_values(tmp_path / "dense.params", entry)
    np.testing.assert_array_equal(got[ids], np.ones((1000, 8), np.float32))
    probe = np.array([0, 1, rows // 2 + 1, rows - 1])
    probe = probe[~np.isin(probe, ids)]
    np.testing.assert_array_equal(got[probe], parse_initializer(UNIFORM).rows(5, 7, probe.astype(np.uint64),
                                                                               (rows, 8), np.float32))
