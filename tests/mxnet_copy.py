"""A private copy of the venv's mxnet package for tests that patch it: the shared venv is never modified (only
`make patch` patches it). The Python files are copied, the shared libraries (libmxnet.so, 150 MB) symlinked; put
the returned directory first on PYTHONPATH of a job's processes to run them on the copy."""
from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PATCH_SCRIPT = ROOT / "scripts" / "patch_mxnet.py"


def installed_mxnet() -> Path:
    spec = importlib.util.find_spec("mxnet")
    assert spec is not None and spec.submodule_search_locations, "mxnet is not installed"
    return Path(list(spec.submodule_search_locations)[0])


def copy_mxnet(dest: Path) -> Path:
    """Copy the installed mxnet package into `dest`/mxnet; returns `dest` (the PYTHONPATH entry)."""
    source = installed_mxnet()
    target = dest / "mxnet"

    def ignore(directory, names):
        return [n for n in names if n == "__pycache__" or ".so" in n]

    shutil.copytree(source, target, ignore=ignore)
    for path in source.rglob("*.so*"):
        link = target / path.relative_to(source)
        link.parent.mkdir(parents=True, exist_ok=True)
        os.symlink(path, link)
    return dest


def patch_script(action: str, package: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(PATCH_SCRIPT), action, "--target", str(package)],
                          capture_output=True, text=True, timeout=120)


def patched_copy(dest: Path) -> Path:
    path = copy_mxnet(dest)
    done = patch_script("apply", path / "mxnet")
    assert done.returncode == 0, done.stdout + done.stderr
    return path


def job_env(copy: Path, lazy: bool, extra: dict | None = None) -> dict:
    """mode_env for a cluster.Job whose processes import mxnet from `copy` (KVSTORE_LAZY on or off)."""
    env = {"PYTHONPATH": f"{copy}{os.pathsep}{ROOT}", "KVSTORE_LAZY": "1" if lazy else "0"}
    env.update(extra or {})
    return env
