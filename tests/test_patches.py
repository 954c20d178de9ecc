"""scripts/patch_mxnet.py and patches/: applied to a private copy of the venv's mxnet 1.9.1 (never the venv itself),
idempotent both ways, reverted byte for byte, refusing other versions and files it does not know; the patched
package with the switch off imports nothing of kvstore_lazy and initializes row_sparse weights as stock. (The
jobs comparing stock, patched-with-the-switch-off and lazy training are in test_gluon_lazy.py/test_module_lazy.py.)
"""
import filecmp
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from mxnet_copy import PATCH_SCRIPT, copy_mxnet, installed_mxnet, patch_script

pytestmark = pytest.mark.integration

sys.path.insert(0, str(PATCH_SCRIPT.parent))
import patch_mxnet  # noqa: E402

TOUCHED = sorted(patch_mxnet.ORIGINALS)


def tree(package):
    """Every file of the package but bytecode: relative path -> bytes (shared libraries are symlinks)."""
    return {str(p.relative_to(package)): (p.read_bytes() if not p.is_symlink() else str(p.resolve()))
            for p in sorted(package.rglob("*")) if p.is_file() and "__pycache__" not in p.parts}


def test_apply_is_idempotent_and_revert_restores_every_byte(tmp_path):
    package = copy_mxnet(tmp_path) / "mxnet"
    before = tree(package)
    assert patch_script("status", package).stdout.strip().endswith(": stock")

    done = patch_script("apply", package)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("patched mxnet/") == len(TOUCHED)
    patched = tree(package)
    assert (package / "_kvstore_lazy_switch.py").exists()
    changed = sorted(name for name in set(before) | set(patched) if before.get(name) != patched.get(name))
    assert changed == sorted(t[len("mxnet/"):] for t in TOUCHED)
    assert patch_script("status", package).stdout.strip().endswith(": patched")
    # every hook reads the switch through the one helper module
    for name in changed:
        if name != "_kvstore_lazy_switch.py":
            assert "_kvstore_lazy_switch" in (package / name).read_text(), name

    again = patch_script("apply", package)
    assert again.returncode == 0 and "nothing to do" in again.stdout
    assert tree(package) == patched

    reverted = patch_script("revert", package)
    assert reverted.returncode == 0, reverted.stdout + reverted.stderr
    assert tree(package) == before
    for name in changed:   # and identical to the installed (stock) files
        if (installed_mxnet() / name).exists():
            assert filecmp.cmp(package / name, installed_mxnet() / name, shallow=False), name
    again = patch_script("revert", package)
    assert again.returncode == 0 and "nothing to do" in again.stdout
    assert tree(package) == before


def test_refuses_another_version_or_an_unknown_file_and_changes_nothing(tmp_path):
    package = copy_mxnet(tmp_path) / "mxnet"
    (package / "model.py").write_text((package / "model.py").read_text() + "# a local edit\n")
    before = tree(package)
    refused = patch_script("apply", package)
    assert refused.returncode == 1
    assert "refusing" in refused.stdout and "model.py" in refused.stdout
    assert tree(package) == before

    (package / "model.py").write_bytes((installed_mxnet() / "model.py").read_bytes())
    libinfo = package / "libinfo.py"
    libinfo.write_text(libinfo.read_text().replace('__version__ = "1.9.1"', '__version__ = "1.9.0"'))
    before = tree(package)
    refused = patch_script("apply", package)
    assert refused.returncode == 1 and "mxnet 1.9.0" in refused.stdout and "1.9.1 only" in refused.stdout
    assert tree(package) == before


@pytest.mark.skipif(shutil.which("patch") is None, reason="no patch(1) on this machine")
def test_the_diffs_are_plain_unified_diffs(tmp_path):
    """GNU patch applies them too (patch -p1 from site-packages), to the same result as the script."""
    ours = copy_mxnet(tmp_path / "ours") / "mxnet"
    theirs = copy_mxnet(tmp_path / "theirs")
    assert patch_script("apply", ours).returncode == 0
    for diff in sorted(patch_mxnet.PATCH_DIR.glob("*.diff")):
        subprocess.run(["patch", "-p1", "--quiet", "--forward", "-d", str(theirs), "-i", str(diff)], check=True,
                       timeout=60)
    for name in TOUCHED:
        assert (ours.parent / name).read_bytes() == (theirs / name).read_bytes(), name


def test_switch_off_is_stock_and_switch_on_outside_a_dist_job_too(tmp_path):
    """With the patches applied: KVSTORE_LAZY unset -> `import mxnet` and a row_sparse weight's initialization never
    touch kvstore_lazy and the weight holds every row; KVSTORE_LAZY=1 in a process that is not a dist worker (no
    DMLC_ROLE=worker) -> still stock; in a worker whose kvstore turns out local, the weight is initialized then."""
    copy = copy_mxnet(tmp_path)
    assert patch_script("apply", copy / "mxnet").returncode == 0
    check = textwrap.dedent("""
        import os, sys
        import mxnet as mx
        from mxnet.gluon.contrib.nn import SparseEmbedding
        assert mx.__file__.startswith(sys.argv[1]), mx.__file__

        def rows():
            emb = SparseEmbedding(50, 4)
            emb.initialize(mx.init.Uniform(0.1))
            return emb.weight._data[0].indices.shape[0]

        assert rows() == 50
        assert not any(m.startswith("kvstore_lazy") for m in sys.modules), sorted(sys.modules)
        os.environ["KVSTORE_LAZY"] = "1"
        assert rows() == 50
        # a dist worker defers the weight to the servers; if its Trainer's kvstore is not dist after all, the
        # skipped initialization happens when the kvstore is set up
        os.environ["DMLC_ROLE"] = "worker"
        emb = SparseEmbedding(50, 4)
        emb.initialize(mx.init.Uniform(0.1))
        assert emb.weight._data[0].indices.shape[0] == 0
        mx.gluon.Trainer(emb.collect_params(), "sgd", kvstore="local")
        got = emb.weight.row_sparse_data(mx.nd.array([1, 2]))
        assert got.indices.asnumpy().tolist() == [1, 2] and (got.data.asnumpy() != 0).all()
        print("ok")
    """)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DMLC_", "KVSTORE_LAZY"))}
    env["PYTHONPATH"] = f"{copy}:{patch_mxnet.PATCH_DIR.parent}"
    done = subprocess.run([sys.executable, "-c", check, str(copy)], env=env, capture_output=True, text=True,
                          timeout=180)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stdout + done.stderr


def test_the_switch_reads_on_off_words_and_refuses_others(tmp_path):
    """KVSTORE_LAZY=false is off (it used to count as on: anything but unset, empty or 0), the usual spellings of on
    and off are understood in any case, and a value that is neither is refused naming the variable."""
    copy = copy_mxnet(tmp_path)
    assert patch_script("apply", copy / "mxnet").returncode == 0
    check = textwrap.dedent("""
        import importlib.util, os, sys
        spec = importlib.util.spec_from_file_location("switch", sys.argv[1])
        switch = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(switch)
        out = []
        for value in ["", "0", "false", "No", "OFF", "1", "true", "Yes", "on", "maybe"]:
            os.environ["KVSTORE_LAZY"] = value
            try:
                out.append(str(switch.switch_on()))
            except ValueError as exc:
                out.append(str(exc))
        print("|".join(out))
    """)
    done = subprocess.run([sys.executable, "-c", check, str(copy / "mxnet" / "_kvstore_lazy_switch.py")],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    got = done.stdout.strip().split("|")
    assert got[:9] == ["False"] * 5 + ["True"] * 4
    assert got[9].startswith("KVSTORE_LAZY='maybe': use 1/0, true/false, yes/no or on/off")
