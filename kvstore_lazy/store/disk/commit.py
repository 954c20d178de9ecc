"""Durability: the commit of a store (its index file) and the loading of the last commit.

Owns: ``store.json`` written once and read back (:func:`write_layout`, :func:`read_layout`), :func:`commit` (into
the store's own directory, or into another one for a server snapshot) and :func:`load_index` with the checks of a
committed store (every segment it lists there and of full size, every location in a listed segment, no row twice;
a dense index's ids and locations read a piece at a time into the index, never whole).
Does not own: the file names and the atomic replacement (:mod:`.files`) or the records' checks (:mod:`.verify`).

The index file is the commit point: :func:`commit` fsyncs the segments written since the last commit, then writes
``index.npz`` atomically (temp file, fsync, rename, fsync of the directory; a dense index's ids and locations
written a piece at a time, ``store.npz``, never copied whole). A store opened again holds exactly
what the last commit held; records appended after it are unreferenced garbage (and segment files made after it
are deleted at the open). A segment a compaction emptied is deleted at once, unless this directory's committed
index refers to it (then at the next commit). A commit into another directory (``into``, for a server snapshot)
hard-links the segment files instead of copying them (a snapshot holding a segment keeps its own link when the
store deletes it): appends only ever write past the committed fill, and ``rewrite`` writes in place only into a
segment no other directory links (``st_nlink`` 1); one a snapshot shares gets the records appended anew
(copy-on-write). A record written in place is sealed again for its location, so a torn write is a failed check,
never wrong values (and the live directory is never what a restart recovers from: the snapshot is).
"""
from __future__ import annotations

import json
import zipfile
from pathlib import Path

import numpy as np

from kvstore_lazy.store.disk import index as disk_index
from kvstore_lazy.store.disk.errors import DiskError, SegmentError
from kvstore_lazy.store.disk.files import INDEX_FILE, SEGMENT_GLOB, STORE_FILE, atomic_write, fsync_path, link_or_copy
from kvstore_lazy.store.disk.index import EMPTY, LiveBits, RunIndex
from kvstore_lazy.store.disk.layout import FORMAT
from kvstore_lazy.store.disk.runfile import RUN_GLOB, TEMP_SUFFIX
from kvstore_lazy.store.disk.state import StoreState
from kvstore_lazy.store.npz import Member, savez
from kvstore_lazy.store.pieces import ascends_after

CONVERT_CHUNK = 1 << 16         # ids of an old hash index put into the runs at a time
DENSE_CHUNK = 1 << 15           # entries of a dense index's commit read at a time (12 bytes each)


def write_layout(store: StoreState) -> None:
    atomic_write(store.path / STORE_FILE, json.dumps(store.layout.to_json(store.rows)).encode())


def read_layout(path: Path) -> dict:
    """The ``store.json`` of the store in ``path`` (SegmentError if it is not one of ours; the caller turns other
    errors into one)."""
    layout = json.loads((path / STORE_FILE).read_text())
    if layout.get("format") != FORMAT:
        raise SegmentError(f"{path / STORE_FILE}: not a {FORMAT} store (format {layout.get('format')!r})")
    return layout


def load_index(store: StoreState, verify: bool) -> None:
    """Load the committed index into a store just made (empty), checking it against the segment files: a dense
    index from its ids and locations, a RunIndex from its manifest and the live bits, or (a store committed with
    the hash index of earlier versions: every id and location, no manifest) converted into runs."""
    where = store.path / INDEX_FILE
    try:
        with open(where, "rb") as handle, np.load(handle, allow_pickle=False) as z:   # (our handle: np.load leaks
            # its own when the zip is unreadable)
            meta = json.loads(bytes(z["meta"]).decode())
            kind = meta.get("index", {}).get("kind", "ids")
            if kind == "runs":
                ids, locs, bits = np.zeros(0, np.uint64), np.zeros(0, np.uint32), z["live"]
            elif kind == "dense":               # read in pieces by _load_dense
                ids, locs, bits = None, None, None
            else:
                ids, locs, bits = z["ids"].astype(np.uint64), z["locs"].astype(np.uint32), None
    except (OSError, ValueError, KeyError, zipfile.BadZipFile) as exc:
        raise SegmentError(f"{where}: cannot read the index: {exc}") from None
    store._next_number = int(meta["next_number"])
    segments = {int(slot): (str(name), int(fill)) for slot, name, fill in meta["segments"]}
    store._active = None if meta["active"] is None else int(meta["active"])
    store._live = np.zeros(max(segments, default=-1) + 1, np.int64)
    nbytes = store.layout.segment_bytes
    for slot, (name, fill) in segments.items():
        file = store.path / name
        size = file.stat().st_size if file.exists() else -1
        if size != nbytes:
            what = "is missing" if size < 0 else f"has {size} bytes, not {nbytes}"
            raise SegmentError(f"segment {file} {what}: the store is damaged")
        store._names[slot], store._fill[slot] = name, fill
    store._committed = set(store._names.values())
    for file in store.path.glob(SEGMENT_GLOB):     # made after the last commit: garbage
        if file.name not in store._names.values():
            file.unlink()
    if kind == "runs":
        _load_runs(store, meta["index"], bits, sorted(segments))
    elif kind == "dense":
        _load_dense(store, list(segments))
    else:
        _load_ids(store, ids, locs, list(segments))
    if verify:
        store.verify()


def _load_dense(store: StoreState, listed: list[int]) -> None:
    """A dense index's commit: its ids (ascending, as ``DenseIndex.items`` wrote them) and their locations read
    DENSE_CHUNK at a time straight into the index (never either whole: 12 bytes a stored row, and a sort's more),
    each piece checked: ids ascending and unique across pieces, every location in a listed segment, every id in
    the store's rows, both members whole (their zip CRCs)."""
    where = store.path / INDEX_FILE
    assert store.rows is not None, "a dense index's commit of a store without a dense row range"
    store._index = disk_index.new_index(store.rows, store.path, store.memtable_entries)
    known = np.zeros(len(store._live), bool)
    known[listed] = True
    last = -1
    try:
        with Member(where, "ids") as ids, Member(where, "locs") as locs:
            if len(ids.shape) != 1 or ids.shape != locs.shape or ids.dtype.kind not in "iu" or \
                    locs.dtype.kind not in "iu":
                raise SegmentError(f"{where}: ids {ids.shape} {ids.dtype} and locations {locs.shape} {locs.dtype} "
                                   f"of a dense index do not pair")
            empty = np.full(DENSE_CHUNK, EMPTY, np.uint32)
            loc_pieces = locs.pieces(DENSE_CHUNK)
            for part in ids.pieces(DENSE_CHUNK):
                part, at = part.astype(np.uint64, copy=False), next(loc_pieces).astype(np.uint32, copy=False)
                if not ascends_after(part, last):
                    raise SegmentError(f"{where}: the index lists a row twice (or its ids are not ascending)")
                slots = (at >> np.uint32(store._shift)).astype(np.int64)
                if int(slots.max()) >= len(known) or not known[slots].all():
                    raise SegmentError(f"{where}: refers to segments it does not list")
                store._live += np.bincount(slots, minlength=len(store._live))
                store._index.set(part, at, old=empty[:len(part)])
                last = int(part[-1])
            for _ in loc_pieces:            # (none left: its end, where its CRC is checked)
                pass
    except SegmentError:
        raise
    except (OSError, ValueError, KeyError, zipfile.BadZipFile) as exc:
        raise SegmentError(f"{where}: cannot read the index: {exc}") from None
    store._ensure_bits()


def _load_ids(store: StoreState, ids: np.ndarray, locs: np.ndarray, listed: list[int]) -> None:
    """Every id and its location, read whole (the hash index of earlier versions: converted into runs)."""
    where = store.path / INDEX_FILE
    if store.rows is None:                  # the old hash index: runs made from it, committed at the next commit
        for file in list(store.path.glob(RUN_GLOB)) + list(store.path.glob(RUN_GLOB + TEMP_SUFFIX)):
            file.unlink()                   # a conversion a killed process began: no commit lists them
    if len(ids):
        slots = (locs >> np.uint32(store._shift)).astype(np.int64)
        if not np.isin(slots, listed).all():
            raise SegmentError(f"{where}: refers to segments it does not list")
        store._live += np.bincount(slots, minlength=len(store._live))
        order = np.argsort(ids, kind="stable")
        ids, locs = ids[order], locs[order]
        if (ids[1:] == ids[:-1]).any():
            raise SegmentError(f"{where}: the index lists a row twice")
    try:
        store._index = disk_index.new_index(store.rows, store.path, store.memtable_entries)
        empty = np.full(min(len(ids), CONVERT_CHUNK), EMPTY, np.uint32)
        for lo in range(0, len(ids), CONVERT_CHUNK):
            part = ids[lo:lo + CONVERT_CHUNK]
            store._index.set(part, locs[lo:lo + CONVERT_CHUNK], old=empty[:len(part)])
    except ValueError as exc:
        raise SegmentError(f"{where}: {exc}") from None
    store._ensure_bits()


def _load_runs(store: StoreState, info: dict, bits: np.ndarray, listed: list[int]) -> None:
    """A RunIndex as the committed manifest names it, and the live bits of the listed segments."""
    where = store.path / INDEX_FILE
    live = LiveBits(store.segment_rows, store._shift)
    live.grow(len(store._live))
    if bits.dtype != np.uint8 or bits.shape != (len(listed), live.width):
        raise SegmentError(f"{where}: live bits of shape {bits.shape}, want ({len(listed)}, {live.width})")
    for slot, row in zip(listed, bits):
        live.load(slot, row)
    store._bits = live
    store._live[:] = live.counts()
    if store.rows is not None:
        raise SegmentError(f"{where}: a RunIndex for a store of a dense row range")
    store._index = RunIndex.open(store.path, info["manifest"], store.memtable_entries)
    if len(store._index) != int(store._live.sum()):
        raise SegmentError(f"{where}: {len(store._index)} rows indexed, {int(store._live.sum())} live records")


def commit(store: StoreState, into=None) -> None:
    """Make what is stored now durable: fsync the segments written since the last commit, flush the index's
    memtable into a run (a RunIndex), then write ``index.npz`` atomically. With ``into`` (another directory on the
    same file system, which must not exist), the committed store goes there instead, its segments and index runs
    hard-linked (this store's own commit is unchanged)."""
    store._writer.settle()
    try:
        live = set(store._names.values())
        for name in sorted(store._dirty & live):
            fsync_path(store.path / name)
        store._dirty.clear()
        listed = sorted(store._names)
        meta = {"next_number": store._next_number, "active": store._active,
                "segments": [[slot, store._names[slot], store._fill[slot]] for slot in listed]}
        manifest, runs = None, store._index if isinstance(store._index, RunIndex) else None
        if runs is not None:
            manifest = runs.commit()
            store._ensure_bits()
            meta["index"] = {"kind": "runs", "manifest": manifest}
            bits = store._bits
            width = (store.segment_rows + 7) // 8
            arrays: dict = {"live": np.array([bits.row(slot) if bits is not None else np.zeros(width, np.uint8)
                                        for slot in listed], np.uint8).reshape(len(listed), width)}
        else:
            arrays = {"ids": _Entries(store._index, 0, np.uint64), "locs": _Entries(store._index, 1, np.uint32)}
            meta["index"] = {"kind": "dense"}
        arrays["meta"] = np.frombuffer(json.dumps(meta).encode(), np.uint8)
        target = store.path if into is None else Path(into)
        if into is not None:
            target.mkdir(parents=True)
            for name in [store._names[s] for s in listed] + [STORE_FILE]:
                link_or_copy(store.path / name, target / name)
            if runs is not None and manifest is not None:
                _link_runs(store.path, manifest, target)
        atomic_write(target / INDEX_FILE, lambda f: savez(f, arrays))
        if into is not None and runs is not None and manifest is not None:
            runs.committed(manifest, elsewhere=True)      # (the snapshot's links keep them)
        if into is None:
            if runs is not None and manifest is not None:
                runs.committed(manifest)
            store._committed = set(store._names.values())
            for name in store._retired:
                (store.path / name).unlink(missing_ok=True)
            store._retired = []
    except OSError as exc:
        if isinstance(exc, DiskError):
            raise
        raise DiskError(exc.errno, f"disk tier {store.path}: commit failed: {exc.strerror or exc}") from exc


class _Entries:
    """The ids (``part`` 0) or the locations (1) of a dense index's stored rows, in id order, in pieces
    (``DenseIndex.items``): a commit writes them without a copy of either (12 bytes a stored row) in memory."""

    def __init__(self, index, part: int, dtype) -> None:
        self.index, self.part = index, part
        self.shape, self.dtype = (len(index),), np.dtype(dtype)

    def pieces(self):
        for entries in self.index.items():
            yield entries[self.part]


def _link_runs(directory: Path, manifest: dict, target) -> None:
    """Hard-link (or copy across file systems) the index runs ``manifest`` lists into ``target`` (a snapshot)."""
    try:
        for name, _ in manifest["runs"]:
            link_or_copy(directory / name, Path(target) / name)
    except OSError as exc:
        raise DiskError(exc.errno, f"disk tier {target}: cannot link the index runs: {exc.strerror or exc}") from exc
