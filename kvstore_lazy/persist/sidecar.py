"""What a checkpoint of lazy rows needs to rebuild the rows it does not hold: the sidecar beside the file.

Owns: the sidecar format and path, reading and checking it against the file it describes (:func:`lazy_params`),
writing it in the crash-safe order of a checkpoint save (:func:`checkpoint_path`, :func:`write_checkpoint`), and
the value of any row of a lazy parameter (:func:`lazy_rows`). numpy only (never mxnet: the server imports this
module); MXNet's NDArray files are read by ``ndfile``.
Does not own: the atomic write itself (``atomic``), or densifying a checkpoint (``densify``).

A checkpoint (``mx.nd.save`` format) holds a lazy parameter as a RowSparseNDArray of the rows
that exist; what the absent rows are is said beside it, in ``<file>.lazy.json``, not in the file: stock readers
must keep loading the file unchanged, and an extra entry breaks two of them (Gluon ``load_parameters`` refuses a
name it has no parameter for unless ``ignore_extra``, and so does ``SymbolBlock.imports``; ``BaseModule.load_params``
refuses a name that is not ``arg:``/``aux:``; only ``mx.nd.load`` and ``mx.model.load_checkpoint`` ignore one)::

    {"format": "kvstore_lazy.checkpoint/1",
     "versions": [{"sha256": "<hex of the whole file>", "bytes": <its size>,
                   "params": {"<entry name>": {"key": <kv key id>, "rows": <full rows>, "row_shape": [...],
                                               "dtype": "float32", "init": "<Initializer.dumps()>", "seed": <seed>},
                              ...}},
                  ...]}

A row absent from the file has the value ``parse_initializer(init).rows(seed, key, [row], (rows,) + row_shape,
dtype)``: the function the servers computed it with. Each version names the exact file it describes (sha256 and
size), so a sidecar is never applied to a file it was not written for. Order of a save (:func:`checkpoint_path`): the
new file is written and fsynced under a temp name, the sidecar is rewritten (atomically) with the new version first
and the version describing the file still in place second, then the file is renamed over the old one. A crash at
any point leaves a file whose version the sidecar holds.
"""
from __future__ import annotations

import json
import os
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Callable

import numpy as np

from kvstore_lazy.numerics.initializers import InitializerError, parse_initializer
from kvstore_lazy.persist.atomic import atomic_path, atomic_write, file_digest
from kvstore_lazy.persist.ndfile import read_index

# the on-disk format of every sidecar written so far: files already written carry it, it must not change
SIDECAR_FORMAT = "kvstore_lazy.checkpoint/1"
SIDECAR_SUFFIX = ".lazy.json"
_SPEC_FIELDS = ("key", "rows", "row_shape", "dtype", "init", "seed")
_LAZY_DTYPES = ("float16", "float32", "float64")


class CheckpointError(ValueError):
    """A checkpoint or its sidecar that cannot be used as asked (the message names the file and the reason)."""


def sidecar_path(path: str | os.PathLike) -> Path:
    return Path(f"{os.fspath(path)}{SIDECAR_SUFFIX}")


def lazy_spec(declaration: dict) -> dict:
    """What a sidecar records of a LAZY_DECLARE body (kvstore_lazy.worker.lazy_spec_body): key, full shape, dtype,
    initializer and seed."""
    return {name: declaration[name] for name in _SPEC_FIELDS}


def _read_sidecar(side: Path) -> list[dict]:
    try:
        doc = json.loads(side.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{side}: unreadable ({exc})") from None
    if not isinstance(doc, dict) or doc.get("format") != SIDECAR_FORMAT or not isinstance(doc.get("versions"), list):
        raise CheckpointError(f"{side}: not a kvstore_lazy checkpoint sidecar (format {SIDECAR_FORMAT})")
    return doc["versions"]



class SidecarUpdate:
    """The companion (kvstore_lazy.persist.atomic.Companion) of a checkpoint save: `lazy` (entry name ->
    declaration of the lazy parameter it holds) writes the sidecar describing the new file before the rename; an
    empty dict removes, after it, a sidecar left by an older version of the file."""

    def __init__(self, lazy: dict) -> None:
        self.lazy = lazy

    def before_rename(self, path: Path, new_file: str) -> None:
        if self.lazy:
            _write_sidecar(path, new_file, self.lazy)

    def after_rename(self, path: Path) -> None:
        if not self.lazy:
            sidecar_path(path).unlink(missing_ok=True)


def checkpoint_path(path: str | os.PathLike, lazy: dict | None = None) -> AbstractContextManager[str]:
    """:func:`~kvstore_lazy.persist.atomic.atomic_path` of a checkpoint: `lazy` (entry name -> declaration) also
    writes the sidecar describing the new file, in the crash-safe order of the module docstring; an empty dict
    removes a sidecar left by an older version of `path`; None leaves sidecars alone (files that are not
    checkpoints)."""
    return atomic_path(path, None if lazy is None else SidecarUpdate(lazy))


def write_checkpoint(path: str | os.PathLike, write: Callable, mode: str = "wb", lazy: dict | None = None) -> None:
    """:func:`~kvstore_lazy.persist.atomic.atomic_write` of a checkpoint, its sidecar as :func:`checkpoint_path`
    says."""
    atomic_write(path, write, mode, None if lazy is None else SidecarUpdate(lazy))


def _write_sidecar(path: Path, new_file: str, lazy: dict) -> None:
    """Describe `new_file` (about to be renamed to `path`) first and whatever `path` is now second."""
    digest, size = file_digest(new_file)
    versions = [{"sha256": digest, "bytes": size, "params": {name: lazy_spec(spec) for name, spec in lazy.items()}}]
    side = sidecar_path(path)
    try:
        old = _read_sidecar(side) if side.exists() else []
    except CheckpointError:
        old = []   # overwritten: it described no file this save keeps
    if old and path.exists():
        current_size = path.stat().st_size
        if any(v.get("bytes") == current_size for v in old):
            current = file_digest(path)
            versions += [v for v in old if (v.get("sha256"), v.get("bytes")) == current][:1]
    atomic_write(side, lambda fh: fh.write(json.dumps({"format": SIDECAR_FORMAT, "versions": versions}, indent=1)),
                 mode="w")


def _checked_spec(side: Path, name: str, spec) -> dict:
    try:
        out: dict = {"key": int(spec["key"]), "rows": int(spec["rows"]),
               "row_shape": [int(d) for d in spec["row_shape"]], "dtype": np.dtype(spec["dtype"]).name,
               "init": str(spec["init"]), "seed": int(spec["seed"])}
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"{side}: bad entry for {name!r} ({exc!r})") from None
    if out["rows"] <= 0 or not out["row_shape"] or min(out["row_shape"]) <= 0 or out["dtype"] not in _LAZY_DTYPES:
        raise CheckpointError(f"{side}: bad shape or dtype for {name!r}: {spec}")
    try:
        parse_initializer(out["init"])
    except InitializerError as exc:
        raise CheckpointError(f"{side}: the initializer of {name!r} cannot be computed: {exc}") from None
    return out


def lazy_params(path: str | os.PathLike) -> dict[str, dict] | None:
    """The lazy parameters of checkpoint `path`, by entry name, from its sidecar: None if it has none (a stock
    file). CheckpointError if the sidecar is unreadable, describes another version of the file, or disagrees with
    the file (an entry missing, not row_sparse, or of another shape or dtype)."""
    path = Path(path)
    side = sidecar_path(path)
    if not side.exists():
        return None
    versions = _read_sidecar(side)
    current = file_digest(path)
    found = [v for v in versions if isinstance(v, dict) and (v.get("sha256"), v.get("bytes")) == current]
    if not found or not isinstance(found[0].get("params"), dict):
        raise CheckpointError(f"{side} does not describe {path} (written for another version of that file, e.g. one "
                              f"saved by code without kvstore_lazy); remove it to read {path.name} as a stock file")
    params = {name: _checked_spec(side, name, spec) for name, spec in found[0]["params"].items()}
    entries = {entry.name: entry for entry in read_index(path)}
    for name, spec in params.items():
        entry = entries.get(name)
        shape = (spec["rows"],) + tuple(spec["row_shape"])
        if entry is None or entry.stype != "row_sparse" or entry.shape != shape or entry.dtype != spec["dtype"]:
            got = "absent" if entry is None else f"{entry.stype} {entry.shape} {entry.dtype}"
            raise CheckpointError(f"{path}: {name!r} is {got}, its sidecar says row_sparse {shape} {spec['dtype']}")
    return params


def lazy_rows(spec: dict, row_ids: np.ndarray, stored_ids: np.ndarray, stored_values: np.ndarray) -> np.ndarray:
    """The values of rows `row_ids` (int64) of the lazy parameter `spec`: a row's stored value where `stored_ids`
    (sorted, with `stored_values` in that order) holds it, else the initial value the servers compute for it.
    Shape (len(row_ids),) + row_shape."""
    row_shape = tuple(spec["row_shape"])
    dtype = np.dtype(spec["dtype"])
    row_ids = np.asarray(row_ids, np.int64)
    out = np.empty((len(row_ids),) + row_shape, dtype)
    pos = np.minimum(np.searchsorted(stored_ids, row_ids), max(len(stored_ids) - 1, 0))
    hit = stored_ids[pos] == row_ids if len(stored_ids) else np.zeros(len(row_ids), bool)
    out[hit] = stored_values[pos[hit]]
    absent = row_ids[~hit]
    if len(absent):
        values = parse_initializer(spec["init"]).rows(spec["seed"], spec["key"], absent.astype(np.uint64),
                                                      (spec["rows"],) + row_shape, dtype)
        out[~hit] = values.reshape((len(absent),) + row_shape)
    return out

