"""One row range of a snapshot's key, read by seeking: a server restored from another job's snapshots
(KVSTORE_LAZY_RESTORE_FROM) reads the rows of its own range, not the whole files of the source ranks it overlaps.

Owns: reading members of a key file (``key<k>.npz``) by seeking (:class:`NpzMembers`), one key of one source rank
restricted to a span of stored row ids with its deltas folded (:func:`key_range`), and counting the bytes read
(:class:`Counter`).
Does not own: the snapshot format and the full checks of a whole snapshot (``persist.snapshots``), the re-cut
(``persist.reshard``), the disk tier store (``store.segments``).

Why seeking works: ``np.savez`` stores each member uncompressed (ZIP_STORED) as an ``.npy`` file, so a member's
rows lie at a fixed offset: the member's local zip header (30 bytes + its name + its extra field), then the npy
header, then the rows in C order. ``row_ids`` is sorted, so the span's rows are ``searchsorted`` over it.

What is verified (a slice cannot be checked against the whole file's sha256 nor a member's zip CRC):

- the manifests, as always (format, ranks); ``row_ids`` and ``pending_ids`` are read whole and checked against
  their zip CRC, and must be sorted and unique;
- a key read whole (a dense key: no span): every member against its zip CRC;
- every sliced member (``weights``, ``state<i>``, ``col_*``, ``pending_count``/``pending_last``): ZIP_STORED, its
  npy header (C order, no objects), its row count equal to its id array's and to the manifest's, its size in the
  zip equal to header + rows. The values of the rows read are not checksummed: a flipped bit inside them is not
  seen here (it is by the offline form, ``kvstore-lazy reshard``, which reads and checks every file whole);
- a delta's key files are read whole and checked against their sha256 (deltas hold changed rows only), the chain
  of deltas as ``snapshots.load_snapshot`` checks it;
- disk tier rows: only the records of the span are read, each checked by its own record check on read.
"""
from __future__ import annotations

import os
import struct
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvstore_lazy import paths
from kvstore_lazy.persist import snapshots
from kvstore_lazy.persist.atomic import file_digest
from kvstore_lazy.persist.snapshots import SnapshotError

_LOCAL = struct.Struct("<4s5H3L2H")      # a zip local file header (30 bytes)
_ID_ARRAYS = ("row_ids", "pending_ids")


@dataclass
class Counter:
    """Bytes a restore read from the source, by what they were."""

    manifests: int = 0
    ids: int = 0
    rows: int = 0
    deltas: int = 0
    whole: int = 0            # members read whole (dense keys, arrays not per row)

    @property
    def total(self) -> int:
        return self.manifests + self.ids + self.rows + self.deltas + self.whole


class NpzMembers:
    """The members of one ``.npz`` written by ``np.savez``, read by seeking (the zip's central directory once)."""

    def __init__(self, path: Path, counter: Counter) -> None:
        self.path, self.counter = path, counter
        try:
            self.file = open(path, "rb")
            size = self.file.seek(0, os.SEEK_END)
            with zipfile.ZipFile(self.file) as archive:
                self.infos = {i.filename[:-4] if i.filename.endswith(".npy") else i.filename: i
                              for i in archive.infolist()}
                counter.ids += size - archive.start_dir     # the central directory and its end record
        except (OSError, zipfile.BadZipFile) as exc:
            raise SnapshotError(f"{path}: unreadable ({exc}); refusing to restore from it") from None

    def close(self) -> None:
        self.file.close()

    def __enter__(self) -> "NpzMembers":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _damaged(self, name: str, why: str) -> SnapshotError:
        return SnapshotError(f"{self.path}: member {name!r} {why}; refusing to restore from it")

    def header(self, name: str) -> tuple[int, tuple, np.dtype]:
        """(offset of the first row's bytes, shape, dtype) of member `name`."""
        info = self.infos.get(name)
        if info is None:
            raise self._damaged(name, "is missing")
        if info.compress_type != zipfile.ZIP_STORED:
            raise self._damaged(name, "is compressed (not written by np.savez)")
        self.file.seek(info.header_offset)
        head = self.file.read(_LOCAL.size)
        fields = _LOCAL.unpack(head) if len(head) == _LOCAL.size else None
        if fields is None or fields[0] != b"PK\x03\x04":
            raise self._damaged(name, "has no zip local header where the directory says")
        start = info.header_offset + _LOCAL.size + fields[9] + fields[10]
        self.file.seek(start)
        try:
            version = np.lib.format.read_magic(self.file)
            read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
            shape, fortran, dtype = read(self.file)
        except ValueError as exc:
            raise self._damaged(name, f"has no npy header ({exc})") from None
        offset = self.file.tell()
        self.counter.ids += offset - info.header_offset
        if fortran or dtype.hasobject or not shape:
            raise self._damaged(name, "is not a C-ordered array of numbers")
        if offset - start + int(np.prod(shape)) * dtype.itemsize != info.file_size:
            raise self._damaged(name, f"holds {info.file_size} bytes, not its header and {shape} {dtype}")
        return offset, tuple(shape), dtype

    def rows(self, name: str, lo: int, hi: int, expect: int, kind: str = "rows") -> np.ndarray:
        """Rows [lo, hi) of member `name`, which must hold `expect` rows."""
        offset, shape, dtype = self.header(name)
        if shape[0] != expect:
            raise self._damaged(name, f"holds {shape[0]} rows, its ids {expect}")
        row = int(np.prod(shape[1:])) * dtype.itemsize
        out = np.empty((hi - lo, *shape[1:]), dtype)
        self.file.seek(offset + lo * row)
        got = self.file.readinto(out.data.cast("B")) if out.nbytes else 0
        if got != out.nbytes:
            raise self._damaged(name, "is truncated")
        setattr(self.counter, kind, getattr(self.counter, kind) + out.nbytes)
        return out

    def checked(self, name: str, kind: str = "ids") -> np.ndarray:
        """Member `name` read whole and checked against its zip CRC."""
        offset, shape, dtype = self.header(name)
        info = self.infos[name]
        nbytes = int(np.prod(shape)) * dtype.itemsize
        self.file.seek(offset + nbytes - info.file_size)        # the member's first byte: its npy magic
        raw = self.file.read(info.file_size)
        if len(raw) != info.file_size or zlib.crc32(raw) & 0xFFFFFFFF != info.CRC:
            raise self._damaged(name, "is corrupted (its zip CRC differs)")
        setattr(self.counter, kind, getattr(self.counter, kind) + len(raw))
        return np.frombuffer(raw, dtype, offset=len(raw) - nbytes).reshape(shape).copy()


# ----------------------------------------------------------------------------------------------------------------
# one key of one source rank, restricted to a span of stored ids


def _span(ids: np.ndarray, span: tuple[int, int] | None) -> tuple[int, int]:
    if span is None:
        return 0, len(ids)
    return (int(np.searchsorted(ids, np.uint64(max(span[0], 0)))),
            int(np.searchsorted(ids, np.uint64(max(span[1], 0)))))


def _ids(npz: NpzMembers, name: str) -> np.ndarray:
    ids = npz.checked(name)
    if ids.ndim != 1 or (len(ids) > 1 and not bool(np.all(ids[1:] > ids[:-1]))):
        raise npz._damaged(name, "is not sorted and unique")
    return ids


def base_range(path: Path, info: dict, span: tuple[int, int] | None, counter: Counter) -> dict:
    """The table of base key file `path` (manifest entry `info`) holding only the rows, and ids waiting for
    admission, whose stored id is in `span` ([lo, hi); None: all)."""
    with NpzMembers(path, counter) as npz:
        ids = _ids(npz, "row_ids")
        if len(ids) != int(info["rows"]):
            raise npz._damaged("row_ids", f"holds {len(ids)} ids, the manifest says {info['rows']}")
        a, b = _span(ids, span)

        def take(name: str, lo: int, hi: int, count: int) -> np.ndarray:
            """A slice by seeking; a whole member (no span) read whole and checked against its zip CRC."""
            if span is None:
                whole = npz.checked(name, "rows")
                if whole.shape[0] != count:
                    raise npz._damaged(name, f"holds {whole.shape[0]} rows, its ids {count}")
                return whole
            return npz.rows(name, lo, hi, count)

        weights = take("weights", a, b, len(ids))
        states = [take(f"state{i}", a, b, len(ids)) for i in range(int(info.get("num_states", 0)))]
        if any(s.shape[1:] != weights.shape[1:] for s in states):
            raise npz._damaged("state0", "has rows of another shape than the weights")
        names = list(info.get("arrays", []))
        pending = _ids(npz, "pending_ids") if "pending_ids" in names else np.zeros(0, np.uint64)
        pa, pb = _span(pending, span)
        arrays = {"pending_ids": pending[pa:pb]} if "pending_ids" in names else {}
        for name in names:
            if name.startswith("col_"):
                arrays[name] = take(name, a, b, len(ids))
            elif name.startswith("pending_") and name not in _ID_ARRAYS + ("pending_dead",):
                arrays[name] = take(name, pa, pb, len(pending))
            elif name not in arrays:
                arrays[name] = npz.checked(name, "whole")
    return {"row_ids": ids[a:b], "weights": weights, "states": states, "arrays": arrays, "meta": info}


def dense_size(path: Path, counter: Counter) -> int:
    """Elements of the weights of a key file, from its npy header."""
    with NpzMembers(path, counter) as npz:
        return int(np.prod(npz.header("weights")[1]))


def key_range(directory: Path, rank: int, key: int, manifest: dict, span: tuple[int, int] | None,
              counter: Counter) -> dict:
    """Key `key` of source rank `rank` (`manifest` its base manifest): the base's rows of `span` read by seeking,
    its deltas folded (read whole, checked as ``snapshots.load_snapshot`` checks them: rows outside `span` they
    carry are left for the caller to drop), its disk tier store (``disk``, with ``disk_span``: only the span's
    records are to be read)."""
    live = snapshots.live_dir(directory, rank)
    info = manifest["keys"][str(key)]
    table = base_range(paths.key_file(live, key), info, span, counter)
    disk = snapshots._disk_of(live, str(key), info)
    chain = snapshots._base_chain(live, manifest)
    deltas = sorted((int(m.group(1)), p) for p in live.iterdir()
                    if p.is_dir() and (m := snapshots._DELTA_DIR.fullmatch(p.name)))
    if deltas and chain is None:
        raise SnapshotError(f"{live}: deltas {deltas[0][1].name}... beside a base that starts no chain")
    mode, changed = "", None
    for seq, path in deltas:
        assert chain is not None
        delta_manifest, sha = snapshots._checked_delta(path, seq, chain)
        counter.deltas += paths.manifest(path).stat().st_size
        chain = dict(chain, seq=seq, sha256=sha)
        entry = delta_manifest["keys"].get(str(key))
        if entry is None:
            continue
        file = paths.key_file(path, key)
        if not file.exists() or file_digest(file)[0] != entry.get("sha256"):
            raise SnapshotError(f"{file}: missing or corrupted (checksum differs from its manifest); refusing to "
                                f"restore from it")
        counter.deltas += file.stat().st_size
        new = dict(snapshots._read_key(file, entry), meta=entry)
        disk = snapshots._disk_of(path, str(key), entry)
        if entry.get("mode") != "delta":
            mode, changed = "full", new
        elif changed is not None:
            changed = snapshots._fold(changed, new, base=mode == "full")
        else:
            mode, changed = "delta", new
    if changed is not None:
        table = snapshots._fold(table, changed, base=True) if mode == "delta" else changed
        table["meta"] = {k: v for k, v in dict(table["meta"], rows=len(table["row_ids"])).items() if k != "mode"}
    if disk is not None:
        table["disk"], table["disk_span"] = disk, span
    return table
