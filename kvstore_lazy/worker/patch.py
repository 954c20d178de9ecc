"""Apply, revert or check kvstore_lazy's patches on the mxnet 1.9.1 of the Python that runs this.

    kvstore-lazy patch            # or: python -m kvstore_lazy.worker.patch          (make patch)
    kvstore-lazy patch --check    # exit 0 if that mxnet is patched, else 1 and the command that patches it
    kvstore-lazy patch --revert   # back to stock mxnet, byte for byte                (make unpatch)
    python scripts/patch_mxnet.py apply|revert|status [--target DIR]                  (a checkout's spelling)

Owns: the patches' application (:func:`run`), the check of every file against the stock mxnet 1.9.1 wheel's hashes
(:data:`ORIGINALS`, :func:`inspect`, :func:`state`), and where the diffs are read from (:data:`PATCH_DIR`).
Does not own: what the patched hooks do (``kvstore_lazy.worker.integration``), nor the switch module they add
(``patches/01-_kvstore_lazy_switch.diff``).

The mxnet is the package `import mxnet` would load in this interpreter (found without importing it: this module and
the package it is in never import mxnet, so a broken or half-patched mxnet can still be repaired), or ``--target
DIR``. Both directions are idempotent (apply twice = apply once; revert of a stock mxnet changes nothing) and
all-or-nothing: every file is checked first (sha256 of the stock 1.9.1 file, or the stock file plus exactly these
patches), and nothing is written if any file is neither, or if the package is not mxnet 1.9.1. Exit status: 0 done /
nothing to do (``--check``: patched), 1 refused (``--check``: not patched), 2 usage.

Where the diffs are: the top-level ``patches/`` folder of a checkout (plain unified diffs relative to site-packages:
``patch -p1 -d site-packages`` applies them too); a wheel carries the same files as ``kvstore_lazy/worker/patches/``
(setup.py's build_py copies them there), so ``pip install 'kvstore-lazy[worker]'`` can patch without a checkout.
The diffs are applied here, exactly (no fuzz), so no ``patch`` binary is needed.
"""
from __future__ import annotations

import argparse
import hashlib
import importlib.util
import os
import re
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

VERSION = "1.9.1"

def _patch_dir() -> Path:
    """The diffs of a wheel (beside this module), else the checkout's top-level patches/."""
    here = Path(__file__).resolve().parent
    shipped = here / "patches"
    return shipped if shipped.is_dir() else here.parents[1] / "patches"


PATCH_DIR = _patch_dir()

# sha256 of the files of the mxnet==1.9.1 wheel these patches apply to (as in its RECORD); None: file added.
ORIGINALS = {
    "mxnet/_kvstore_lazy_switch.py": None,
    "mxnet/kvstore/kvstore_server.py": "a03219412b6ef46c5a680237843ab8f4b607268002269d83fd620a44ead4d5d8",
    "mxnet/gluon/parameter.py": "53d9d11e28d842ca4195e68ce8299d691140ec746bd9f56034ff76d03d149644",
    "mxnet/gluon/trainer.py": "2eedc9a6825310e9d04aad10e5e11b0d44538a5193ed9b65d379b2a8c08dcb31",
    "mxnet/gluon/block.py": "58a084e71c23217cbd293f9b0b4500b0ae52372ba8704f36073d22bd5c850ba5",
    "mxnet/module/module.py": "acfe8fa9694f6f9f4048cf4203963fbdfd5e41376c439e6fe682f327959dc483",
    "mxnet/module/base_module.py": "9e9d6efbe4e0dbaa9e0781c5b28d1cf86846f690e4b02126794df635476dd091",
    "mxnet/model.py": "ecc9571ed4db9fe2b67cd94a4c7ad03b912e96e43825995a05ac832ddc490a68",
}


class PatchError(Exception):
    pass


# ----------------------------------------------------------------------------------------------------------------
# unified diffs

@dataclass
class Hunk:
    old_start: int          # as in "@@ -old_start,len(old) +new_start,len(new) @@" (1-based line numbers)
    new_start: int
    old: list[str] = field(default_factory=list)
    new: list[str] = field(default_factory=list)

    def start(self, reverse: bool) -> int:
        """0-based index where the hunk's lines begin in the file it applies to (an empty side names the line
        before it)."""
        line, lines = (self.new_start, self.new) if reverse else (self.old_start, self.old)
        return line if not lines else line - 1


@dataclass
class FilePatch:
    path: str               # relative to site-packages, e.g. mxnet/gluon/trainer.py
    new_file: bool
    hunks: list[Hunk]
    source: Path


_HUNK = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


def parse_diff(path: Path) -> list[FilePatch]:
    lines = path.read_text().splitlines(keepends=True)
    patches: list[FilePatch] = []
    i = 0
    while i < len(lines):
        if not lines[i].startswith("--- "):
            i += 1
            continue
        old_name = lines[i][4:].split("\t")[0].strip()
        if i + 1 >= len(lines) or not lines[i + 1].startswith("+++ "):
            raise PatchError(f"{path}: '---' line {i + 1} without '+++'")
        new_name = lines[i + 1][4:].split("\t")[0].strip()
        target = new_name[2:] if new_name.startswith("b/") else new_name
        current = FilePatch(target, old_name == "/dev/null", [], path)
        patches.append(current)
        i += 2
        while i < len(lines) and lines[i].startswith("@@"):
            m = _HUNK.match(lines[i])
            if not m:
                raise PatchError(f"{path}: bad hunk header {lines[i]!r}")
            old_len = int(m.group(2)) if m.group(2) is not None else 1
            new_len = int(m.group(4)) if m.group(4) is not None else 1
            hunk = Hunk(int(m.group(1)), int(m.group(3)))
            i += 1
            while len(hunk.old) < old_len or len(hunk.new) < new_len:
                if i >= len(lines):
                    raise PatchError(f"{path}: hunk at line {m.group(0)} is cut short")
                tag, text = lines[i][:1], lines[i][1:]
                if lines[i].startswith("\\"):   # "\ No newline at end of file": strip the previous newline
                    _strip_newline(hunk)
                    i += 1
                    continue
                if tag == " ":
                    hunk.old.append(text)
                    hunk.new.append(text)
                elif tag == "-":
                    hunk.old.append(text)
                elif tag == "+":
                    hunk.new.append(text)
                else:
                    raise PatchError(f"{path}: unexpected line in hunk: {lines[i]!r}")
                i += 1
            if i < len(lines) and lines[i].startswith("\\"):
                _strip_newline(hunk)
                i += 1
            current.hunks.append(hunk)
    return patches


def _strip_newline(hunk: Hunk) -> None:
    for block in (hunk.old, hunk.new):
        if block and block[-1].endswith("\n"):
            block[-1] = block[-1][:-1]


def apply_hunks(text: str, hunks: list[Hunk], reverse: bool = False) -> str:
    """Apply (or un-apply) hunks exactly where they say; raise PatchError on any mismatch."""
    lines = text.splitlines(keepends=True)
    out: list[str] = []
    at = 0       # next unconsumed line of `lines`
    for hunk in hunks:
        before, after = (hunk.new, hunk.old) if reverse else (hunk.old, hunk.new)
        start = hunk.start(reverse)
        if start < at or lines[start:start + len(before)] != before:
            raise PatchError(f"hunk @@ -{hunk.old_start} does not match")
        out += lines[at:start] + after
        at = start + len(before)
    return "".join(out + lines[at:])


# ----------------------------------------------------------------------------------------------------------------
# the installed package

def find_mxnet() -> Path:
    spec = importlib.util.find_spec("mxnet")   # finds the package without importing (running) it
    if spec is None or not spec.submodule_search_locations:
        raise PatchError("mxnet is not installed in this Python environment")
    return Path(list(spec.submodule_search_locations)[0])


def mxnet_version(package: Path) -> str | None:
    try:
        m = re.search(r'^__version__\s*=\s*["\']([^"\']+)["\']', (package / "libinfo.py").read_text(), re.M)
    except OSError:
        return None
    return m.group(1) if m else None


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@dataclass
class FileState:
    patch: FilePatch
    path: Path
    state: str              # "original" | "patched" | "modified"
    text: str | None        # current content (None: absent)
    original: str | None    # stock content, when known (None for an added file)


def load_patches() -> list[FilePatch]:
    diffs = sorted(PATCH_DIR.glob("*.diff"))
    if not diffs:
        raise PatchError(f"no patches in {PATCH_DIR}")
    patches = [fp for d in diffs for fp in parse_diff(d)]
    unknown = sorted({fp.path for fp in patches} - set(ORIGINALS))
    if unknown:
        raise PatchError(f"patches touch files without a known stock hash: {unknown}")
    return patches


def inspect(package: Path, patches: list[FilePatch]) -> list[FileState]:
    site = package.parent
    states = []
    for fp in patches:
        path = site / fp.path
        text = path.read_text() if path.exists() else None
        expected = ORIGINALS[fp.path]
        if fp.new_file:
            added = apply_hunks("", fp.hunks)
            state = "original" if text is None else ("patched" if text == added else "modified")
            states.append(FileState(fp, path, state, text, None))
            continue
        if text is None:
            states.append(FileState(fp, path, "modified", None, None))
            continue
        if sha256(text.encode()) == expected:
            states.append(FileState(fp, path, "original", text, text))
            continue
        try:
            original = apply_hunks(text, fp.hunks, reverse=True)
        except PatchError:
            original = None
        if original is not None and sha256(original.encode()) == expected:
            states.append(FileState(fp, path, "patched", text, original))
        else:
            states.append(FileState(fp, path, "modified", text, None))
    return states


def _write(path: Path, text: str | None, mode_from: Path | None = None) -> None:
    """Atomically replace `path` by `text` (None: remove it); drop its cached bytecode."""
    cache = path.parent / "__pycache__"
    if cache.is_dir():
        for pyc in cache.glob(path.stem + ".*.pyc"):
            pyc.unlink()
    if text is None:
        if path.exists():
            path.unlink()
        return
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        source = path if path.exists() else mode_from
        if source is not None and source.exists():
            os.chmod(tmp, source.stat().st_mode & 0o7777)
        else:
            os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def summary(states: list[FileState]) -> str:
    """One word for a package's files: patched, stock, partially patched, or modified (neither)."""
    kinds = {st.state for st in states}
    return ("patched" if kinds == {"patched"} else "stock" if kinds == {"original"}
            else "modified (neither stock nor patched)" if "modified" in kinds else "partially patched")


def state(package: Path) -> str:
    """What :func:`summary` says of `package` (an mxnet package directory), or why it cannot say: "not mxnet
    1.9.1 (...)"."""
    version = mxnet_version(package)
    if version != VERSION:
        return f"not mxnet {VERSION} ({version or 'unknown version'})"
    return summary(inspect(package, load_patches()))


def fix_command(python: str | None = None) -> str:
    """The command that patches the mxnet of `python` (default: this interpreter)."""
    return f"{python or sys.executable} -m kvstore_lazy.worker.patch"


def run(action: str, package: Path, out=sys.stdout) -> int:
    """`action` (apply, revert, status, check) on `package`; prints what it did; returns the exit status."""
    version = mxnet_version(package)
    if version != VERSION:
        print(f"refusing: {package} is mxnet {version or '(unknown version)'}; these patches are for mxnet "
              f"{VERSION} only", file=out)
        return 1
    states = inspect(package, load_patches())
    if action in ("status", "check"):
        return _report(action, package, version, states, out)
    bad = [st for st in states if st.state == "modified"]
    if bad:
        print("refusing: these files are neither stock mxnet 1.9.1 nor stock plus these patches (sha256 "
              "mismatch), nothing was changed:", file=out)
        for st in bad:
            print(f"  {st.path}", file=out)
        return 1
    todo: list[tuple[FileState, str | None]] = []
    for st in states:
        if action == "apply" and st.state == "original":
            new = apply_hunks(st.text or "", st.patch.hunks)
            if not st.patch.new_file:
                assert sha256(apply_hunks(new, st.patch.hunks, reverse=True).encode()) == ORIGINALS[st.patch.path]
            todo.append((st, new))
        elif action == "revert" and st.state == "patched":
            todo.append((st, st.original))
    if not todo:
        print(f"nothing to do: mxnet at {package} is already {'patched' if action == 'apply' else 'stock'}",
              file=out)
        return 0
    _write_all(todo)
    for st, _ in todo:
        print(f"{'patched' if action == 'apply' else 'reverted'} {st.patch.path}", file=out)
    return 0


def _report(action: str, package: Path, version: str, states: list[FileState], out) -> int:
    """status: each file's state and the package's (1 if a file is neither stock nor patched); check: the package's
    state, 0 only if patched, else 1 and the command that patches it."""
    word = summary(states)
    if action == "status":
        for st in states:
            label = {"original": "stock" if st.text is not None else "absent", "patched": "patched",
                     "modified": "MODIFIED"}[st.state]
            print(f"{label:9s} {st.patch.path}", file=out)
        print(f"mxnet {version} at {package}: {word}", file=out)
        return 1 if word.startswith("modified") else 0
    if word == "patched":
        print(f"mxnet {version} at {package}: patched", file=out)
        return 0
    print(f"mxnet {version} at {package}: {word}, so KVSTORE_LAZY=1 has no effect on it; patch it with "
          f"`{fix_command()}` (or `kvstore-lazy patch`)", file=out)
    return 1


def _write_all(todo: list[tuple[FileState, str | None]]) -> None:
    done = []
    try:
        for st, new in todo:
            _write(st.path, new, mode_from=st.path.parent / "__init__.py")
            done.append(st)
    except BaseException:
        for st in done:   # all or nothing
            _write(st.path, st.text, mode_from=st.path.parent / "__init__.py")
        raise


def _package(target: str | None) -> Path:
    package = Path(target).resolve() if target else find_mxnet()
    if not (package / "__init__.py").exists():
        raise PatchError(f"{package} is not a Python package directory")
    return package


def _target_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", metavar="DIR",
                        help="the mxnet package directory (default: the one `import mxnet` loads in this Python)")


def main(argv: list[str] | None = None, prog: str = "python -m kvstore_lazy.worker.patch") -> int:
    """``kvstore-lazy patch [--check | --revert] [--target DIR]``."""
    parser = argparse.ArgumentParser(
        prog=prog, description="Apply kvstore_lazy's Gluon/Module patches to the mxnet 1.9.1 of this Python (what "
                               "KVSTORE_LAZY=1 needs), check them, or revert them byte for byte. Refuses anything "
                               "but mxnet 1.9.1 with the stock files; idempotent.")
    what = parser.add_mutually_exclusive_group()
    what.add_argument("--check", action="store_true",
                      help="change nothing: exit 0 if that mxnet is patched, else 1 with the command that patches it")
    what.add_argument("--revert", action="store_true", help="restore the stock files")
    _target_option(parser)
    args = parser.parse_args(argv)
    return _main("check" if args.check else "revert" if args.revert else "apply", args.target)


def script_main(argv: list[str] | None = None) -> int:
    """``python scripts/patch_mxnet.py apply|revert|status [--target DIR]`` (``make patch``, ``make unpatch``)."""
    parser = argparse.ArgumentParser(prog="scripts/patch_mxnet.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("action", choices=["apply", "revert", "status"])
    _target_option(parser)
    args = parser.parse_args(argv)
    return _main(args.action, args.target)


def _main(action: str, target: str | None) -> int:
    try:
        return run(action, _package(target))
    except PatchError as exc:
        print(f"refusing: {exc}", file=sys.stdout)
        return 1


if __name__ == "__main__":
    sys.exit(main())
