"""Issue 28, "no silent traps on a user's path": each numbered trap of the issue has a test here that fails on the
code before the fix. Real processes where the trap needs them: a server started as an operator starts it, the
launcher as a user runs it, workers on a private patched copy of the venv's mxnet (tests/mxnet_copy.py, never the
shared venv), the patch tool from a wheel built of this checkout.
(Trap 6, ``KVSTORE_LAZY=false`` switching lazy mode on, is tests/test_patches.py's
test_the_switch_reads_on_off_words_and_refuses_others.)
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from mxnet_copy import patched_copy

ROOT = Path(__file__).resolve().parents[1]
SERVER_BASE = {"DMLC_ROLE": "server", "DMLC_PS_ROOT_URI": "127.0.0.1", "DMLC_PS_ROOT_PORT": "1",
               "DMLC_NUM_WORKER": "1", "DMLC_NUM_SERVER": "1"}


def clean_env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DMLC_", "KVSTORE_LAZY", "PS_"))}
    env.update(extra)
    return env


def run_server(**env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvstore_lazy.server"], env=clean_env(**SERVER_BASE, **env),
                          capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def patched_mxnet(tmp_path_factory) -> Path:
    """A private patched copy of the venv's mxnet (the PYTHONPATH entry that holds it)."""
    return patched_copy(tmp_path_factory.mktemp("mxnet"))


def lines(text: str, level: str) -> list[str]:
    return [line for line in text.splitlines() if f" {level} " in line]


# ---- trap 3: a misspelled variable is ignored silently, and the servers do not log their settings

def test_trap3_a_misspelled_variable_is_named_with_the_one_meant_and_the_settings_are_logged():
    # the start then fails at the bind (an address this host does not have), after the configuration was read
    done = run_server(KVSTORE_LAZY_MATERIALISE="touch", KVSTORE_LAZY_STATS_INTERVAL="5",
                      DMLC_NODE_HOST="kvl-server-0.kvl-server", KVSTORE_LAZY_BIND="192.0.2.1")
    assert done.returncode == 2, done.stderr
    warnings = lines(done.stderr, "WARNING")
    assert any("KVSTORE_LAZY_MATERIALISE is not a kvstore_lazy setting and is ignored: did you mean "
               "KVSTORE_LAZY_MATERIALIZE?" in line for line in warnings), done.stderr
    settings = [line for line in lines(done.stderr, "INFO") if "settings: " in line]
    assert len(settings) == 1, done.stderr
    assert "KVSTORE_LAZY_STATS_INTERVAL=5" in settings[0] and "KVSTORE_LAZY_BIND=192.0.2.1" in settings[0]


# ---- trap 4: a bad value is named badly (neither the variable nor the value), and only after registration

@pytest.mark.parametrize("env, says", [
    ({"KVSTORE_LAZY_MATERIALIZE": "pull"}, "KVSTORE_LAZY_MATERIALIZE='pull': use push or touch"),
    ({"KVSTORE_LAZY_JOURNAL": "maybe"}, "KVSTORE_LAZY_JOURNAL='maybe': use 1/0, true/false, yes/no or on/off"),
    ({"KVSTORE_LAZY_STATS_INTERVAL": "10s"}, "KVSTORE_LAZY_STATS_INTERVAL='10s' is not a number"),
    ({"KVSTORE_LAZY_CHECK_ADDRESS": "nope"}, "KVSTORE_LAZY_CHECK_ADDRESS='nope': use 1/0"),
    ({"KVSTORE_LAZY_LOG_LEVEL": "LOUD"}, "KVSTORE_LAZY_LOG_LEVEL='LOUD': use DEBUG, INFO, WARNING or ERROR"),
])
def test_trap4_a_bad_value_stops_the_server_with_one_line_naming_variable_and_value(env, says):
    done = run_server(**env)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    errors = lines(done.stderr, "ERROR")
    assert len(errors) == 1 and says in errors[0], done.stderr
    assert "registered" not in done.stderr and "scheduler" not in errors[0]


# ---- jobs through the launcher, as a user runs them: on the venv's stock mxnet, or on a private patched copy

LAUNCH_TIMEOUT = 240


def launch(args: list[str], copy: Path | None = None, **env: str) -> subprocess.CompletedProcess:
    """``python -m kvstore_lazy.launch ARGS`` from a directory outside the checkout; `copy`: the workers' and
    servers' mxnet is the patched copy there (first on PYTHONPATH)."""
    full = clean_env(PYTHONPATH=f"{copy}{os.pathsep}{ROOT}" if copy else str(ROOT), **env)
    return subprocess.run([sys.executable, "-m", "kvstore_lazy.launch", "--timeout", str(LAUNCH_TIMEOUT)] + args,
                          env=full, cwd=str(ROOT / "tests" / "workers"), capture_output=True, text=True,
                          timeout=LAUNCH_TIMEOUT + 60)


def node_lines(output: str, prefix: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith(f"[{prefix}")]


# ---- trap 2: an unpatched mxnet with KVSTORE_LAZY=1 runs the job as stock, and nothing says the switch did nothing

def test_trap2_the_switch_on_an_unpatched_mxnet_is_refused_with_the_command_that_patches_it():
    """The venv's mxnet is stock (only `make patch` patches it): the launcher refuses before starting anything."""
    done = launch(["-n", "1", "-s", "1", sys.executable, "-c", "print('a worker')"], KVSTORE_LAZY="1")
    assert done.returncode == 2, done.stdout + done.stderr
    assert "started" not in done.stdout and not node_lines(done.stdout, "worker"), done.stdout
    errors = done.stderr.strip().splitlines()
    assert len(errors) == 1, done.stderr
    assert "KVSTORE_LAZY=1 but the mxnet the workers import" in errors[0]
    assert ") is stock: the switch would have no effect" in errors[0]
    assert f"{sys.executable} -m kvstore_lazy.worker.patch" in errors[0]


# ---- trap 5: KVSTORE_LAZY_SEED=abc ends in a raw traceback at the first forward

def test_trap5_a_bad_seed_is_refused_by_name_by_the_launcher_and_by_the_worker(patched_mxnet):
    done = launch(["-n", "1", "-s", "1", sys.executable, "-c", "print('a worker')"], KVSTORE_LAZY="1",
                  KVSTORE_LAZY_SEED="abc")
    assert done.returncode == 2 and "KVSTORE_LAZY_SEED='abc' is not an integer" in done.stderr, done.stderr
    assert "started" not in done.stdout
    # a worker started another way: its first hook (initialize(), before any kvstore or forward) refuses the seed
    script = textwrap.dedent("""
        import mxnet as mx
        from kvstore_lazy.config import ConfigError
        emb = mx.gluon.contrib.nn.SparseEmbedding(50, 4)
        try:
            emb.initialize()
        except ConfigError as exc:
            print("refused:", exc)
        else:
            print("initialized")
    """)
    env = clean_env(PYTHONPATH=f"{patched_mxnet}{os.pathsep}{ROOT}", KVSTORE_LAZY="1", DMLC_ROLE="worker",
                    KVSTORE_LAZY_SEED="abc")
    got = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert got.stdout.strip() == "refused: KVSTORE_LAZY_SEED='abc' is not an integer", got.stdout + got.stderr
    env["KVSTORE_LAZY_SEED"] = str(1 << 64)
    got = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert "must be at most 18446744073709551615" in got.stdout, got.stdout + got.stderr


# ---- traps 1, 7 and 9: one Gluon job three ways at once (tests/workers/traps_gluon.py)

GLUON = ["-n", "2", "-s", "2"]


@pytest.fixture(scope="module")
def gluon_runs(patched_mxnet, tmp_path_factory) -> dict:
    """kind -> (launcher result, per-rank results, checkpoint path): `lazy` (KVSTORE_LAZY=1, kvstore_lazy servers);
    `stock_env` (trap 1: KVSTORE_LAZY=1 in the launcher's environment, --server stock); `stock_init` (trap 9, the
    manual's way to run the job on stock servers from the lazy initial values: --server stock, the switch on for
    the workers only)."""
    root = tmp_path_factory.mktemp("gluon")
    kinds = {"lazy": ([], {"KVSTORE_LAZY": "1"}),
             "stock_env": (["--server", "stock"], {"KVSTORE_LAZY": "1"}),
             "stock_init": (["--server", "stock", "--env-worker", "KVSTORE_LAZY:1"], {})}
    procs = {}
    for kind, (options, env) in kinds.items():
        out = root / kind
        out.mkdir()
        full = clean_env(PYTHONPATH=f"{patched_mxnet}{os.pathsep}{ROOT}", **env)
        procs[kind] = subprocess.Popen(
            [sys.executable, "-m", "kvstore_lazy.launch", "--timeout", str(LAUNCH_TIMEOUT)] + GLUON + options +
            [sys.executable, "traps_gluon.py", "--out", str(out), "--save", str(out / "emb.params")],
            env=full, cwd=str(ROOT / "tests" / "workers"), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    runs = {}
    for kind, proc in procs.items():
        output, _ = proc.communicate(timeout=LAUNCH_TIMEOUT + 60)
        out = root / kind
        results = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)
                   if (out / f"rank{r}.json").exists()]
        runs[kind] = (proc.returncode, output, results, out / "emb.params")
    return runs


def test_trap1_server_stock_means_stock_servers_whatever_kvstore_lazy_says(gluon_runs):
    code, output, results, _ = gluon_runs["stock_env"]
    assert code == 0 and len(results) == 2, output
    banner = [line for line in output.splitlines() if line.startswith("[launch") and "servers (local)" in line]
    assert len(banner) == 1 and "2 stock MXNet servers" in banner[0], output
    assert "KVSTORE_LAZY=1 with stock servers" in banner[0]
    servers = node_lines(output, "server")
    assert not any("kvstore_lazy" in line for line in servers), servers   # MXNet's own C++ servers
    lazy_code, lazy_output, _, _ = gluon_runs["lazy"]
    assert lazy_code == 0 and any("kvstore_lazy server" in line for line in node_lines(lazy_output, "server"))
    assert "2 kvstore_lazy servers" in lazy_output


def test_trap9_stock_servers_start_from_the_lazy_initial_values(gluon_runs):
    """--server stock with the switch on for the workers: the same rows, the same initial values, the same losses as
    the lazy run (no key id looked up anywhere); the workers shipped full weights, so nothing lazy is saved."""
    lazy, stock = gluon_runs["lazy"], gluon_runs["stock_init"]
    assert lazy[0] == 0 and stock[0] == 0, lazy[1] + stock[1]
    assert not any("kvstore_lazy" in line for line in node_lines(stock[1], "server"))
    for rank in range(2):
        want, got = lazy[2][rank], stock[2][rank]
        assert got["hooks"] and want["hooks"]
        assert got["rows"] == want["rows"]
        np.testing.assert_array_equal(np.float32(got["init"]), np.float32(want["init"]))
        assert np.float32(want["init"]).any()
        np.testing.assert_allclose(got["losses"], want["losses"], rtol=0, atol=1e-6)
    # the stock servers held every row: the stock checkpoint has them all, the untrained ones with the lazy
    # initial values the lazy run's sidecar describes
    from kvstore_lazy.persist import checkpoint, ndfile

    (spec,) = checkpoint.lazy_params(lazy[3]).values()
    assert not Path(f"{stock[3]}.lazy.json").exists()
    (entry,) = ndfile.read_index(stock[3])
    assert entry.stype == "row_sparse" and entry.shape == (2000, 4)
    ids, values = checkpoint_rows(stock[3])
    np.testing.assert_array_equal(ids, np.arange(2000))
    untrained = np.setdiff1d(np.arange(2000), [3, 17, 400, 1999])
    np.testing.assert_array_equal(values[untrained], checkpoint.lazy_rows(spec, untrained, np.zeros(0, np.int64),
                                                                          np.zeros((0, 4), np.float32)))


def checkpoint_rows(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """(row ids, values) of the one row_sparse entry of an mx.nd.save file, read with stock mxnet."""
    import mxnet as mx

    (value,) = mx.nd.load(str(path)).values()
    return value.indices.asnumpy(), value.data.asnumpy()


def test_trap7_a_lazy_checkpoint_loads_with_every_row_whether_or_not_the_switch_is_set(gluon_runs, patched_mxnet,
                                                                                        tmp_path):
    """The lazy run's checkpoint holds the rows trained; loaded by the patched Gluon with KVSTORE_LAZY unset, the
    rows it does not hold come back with the initial values its sidecar describes (they used to load as zeros)."""
    from kvstore_lazy.persist import checkpoint

    path = gluon_runs["lazy"][3]
    (spec,) = checkpoint.lazy_params(path).values()
    script = textwrap.dedent("""
        import sys
        import mxnet as mx
        import numpy as np
        net = mx.gluon.contrib.nn.SparseEmbedding(2000, 4, prefix="emb_")
        net.load_parameters(sys.argv[1])
        weight = net.weight._data[0]
        np.save(sys.argv[2], weight.tostype("default").asnumpy())
        print(weight.indices.shape[0])
    """)
    for switch in ("", "0"):
        env = clean_env(PYTHONPATH=f"{patched_mxnet}{os.pathsep}{ROOT}", KVSTORE_LAZY=switch)
        got = subprocess.run([sys.executable, "-c", script, str(path), str(tmp_path / "w.npy")], env=env,
                             capture_output=True, text=True, timeout=120)
        assert got.returncode == 0 and got.stdout.strip().splitlines()[-1] == "2000", got.stdout + got.stderr
        weight = np.load(tmp_path / "w.npy")
        absent = np.setdiff1d(np.arange(2000), [3, 17, 400, 1999])
        want = checkpoint.lazy_rows(spec, absent, np.zeros(0, np.int64), np.zeros((0, 4), np.float32))
        np.testing.assert_array_equal(weight[absent], want)
        assert np.abs(weight[absent]).min() > 0


# ---- trap 8: 'kvstore-lazy[worker]' promised the patches, but the wheel shipped neither them nor the tool

def checkout_copy(dest: Path) -> Path:
    """The checkout's tracked files as they are now (what an sdist or a clone holds), without build products."""
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True,
                           timeout=60).stdout.decode().split("\0")
    for name in filter(None, files):
        source = ROOT / name
        if source.is_file():
            target = dest / name
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(source.read_bytes())
    return dest


def test_trap8_the_wheel_ships_the_patches_and_one_command_applies_checks_and_reverts_them(tmp_path):
    from mxnet_copy import copy_mxnet
    from test_patches import tree

    source = checkout_copy(tmp_path / "src")
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path / "dist"),
                            str(source)], capture_output=True, text=True, timeout=900)
    assert built.returncode == 0, built.stdout + built.stderr
    (wheel,) = (tmp_path / "dist").glob("kvstore_lazy-*.whl")
    site = tmp_path / "site"
    installed = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site),
                                str(wheel)], capture_output=True, text=True, timeout=300)
    assert installed.returncode == 0, installed.stdout + installed.stderr
    shipped = sorted(p.name for p in (site / "kvstore_lazy" / "worker" / "patches").glob("*.diff"))
    assert shipped == sorted(p.name for p in (ROOT / "patches").glob("*.diff"))

    copy = copy_mxnet(tmp_path / "mxnet")
    stock = tree(copy / "mxnet")
    # the installed package alone (no checkout on the path), the mxnet `import mxnet` finds in that Python
    env = clean_env(PYTHONPATH=f"{copy}{os.pathsep}{site}")

    def patch(*args: str, module: str = "kvstore_lazy.worker.patch") -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", module, *args], env=env, cwd=str(tmp_path), capture_output=True,
                              text=True, timeout=120)

    check = patch("--check")
    assert check.returncode == 1 and "stock, so KVSTORE_LAZY=1 has no effect" in check.stdout, check.stdout
    assert f"{sys.executable} -m kvstore_lazy.worker.patch" in check.stdout
    done = patch()
    assert done.returncode == 0 and done.stdout.count("patched mxnet/") == 8, done.stdout + done.stderr
    where = subprocess.run([sys.executable, "-c", "import kvstore_lazy.worker.patch as p; print(p.PATCH_DIR)"],
                           env=env, cwd=str(tmp_path), capture_output=True, text=True, timeout=60)
    assert where.stdout.strip() == str(site / "kvstore_lazy" / "worker" / "patches"), where.stdout + where.stderr
    again = patch("patch", module="kvstore_lazy")   # kvstore-lazy patch: the same command, idempotent
    assert again.returncode == 0 and "nothing to do" in again.stdout, again.stdout + again.stderr
    assert patch("--check").returncode == 0
    assert patch("patch", "--check", module="kvstore_lazy").returncode == 0
    reverted = patch("--revert")
    assert reverted.returncode == 0 and reverted.stdout.count("reverted mxnet/") == 8, reverted.stdout
    assert tree(copy / "mxnet") == stock


# ---- trap 10: MXNet's batch-size trap on this path, and the manual's fix (docs/guides/existing-jobs.md)

def test_trap10_the_manuals_fix_for_the_batch_size_warning(gluon_runs, patched_mxnet, tmp_path):
    """trainer.step(batch_size) after a row_sparse_data pull raises MXNet's UserWarning on a dist kvstore; the
    manual's rescale_grad=1/batch_size with step(1) (what every run of gluon_runs does) trains without it."""
    guide = (ROOT / "docs" / "guides" / "existing-jobs.md").read_text()
    assert '"rescale_grad": 1.0 / batch_size}' in guide and "trainer.step(1)" in guide
    assert all(run[0] == 0 for run in gluon_runs.values())
    done = launch(["-n", "1", "-s", "1", sys.executable, "traps_gluon.py", "--out", str(tmp_path), "--step-by-batch"],
                  copy=patched_mxnet, KVSTORE_LAZY="1")
    assert done.returncode != 0 and "Possible change in the `batch_size` from previous `step`" in done.stdout, \
        done.stdout + done.stderr
