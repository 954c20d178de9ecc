"""One run file of the disk index (:mod:`.runs`): its format, its writer, its reader, and the merge of sorted runs.

Owns: the bytes of a run file (blocks, fences, bloom filter, footer, and their checks), writing one
(:class:`RunWriter`: temp file, fsync, rename, fsync of the directory), opening one (:func:`open_run`: every part
checked, :class:`~.errors.SegmentError` naming the file otherwise), reading its blocks batched (:meth:`Run.probe`,
:meth:`Run.chunks`), the split-block bloom filter, and the streaming k-way merge of sorted (id, loc) chunk
streams (:func:`merged`). Does not own: which runs exist, the memtable, when to flush or merge, or the manifest
(:class:`~.runs.RunIndex`).

A run file (``idx-000001.run``, written once as ``idx-000001.run.tmp``, fsynced, renamed, the directory fsynced)::

    data blocks      block_bytes each (4 KiB): check u32 | count u32 | ids u64[E] | locs u32[E] | zero pad,
                     E = (block_bytes - 8) // 12 = 340 entries; ascending ids across blocks; every block full but
                     the last. The check is the record check of :mod:`.layout` over the block's 32-bit words (the
                     check word weighted 0), the run's number and the block's number mixed in: a damaged block, a
                     block read from another place or another run fails it.
    fences           the first id of each block (u64), zero-padded to a whole block
    bloom            the split-block bloom filter, zero-padded to a whole block: 32-byte blocks of eight u32
                     words; an id sets (and a probe tests) one bit in each word of one block, from splitmix64
                     of the id (the block from the high 32 bits, the bits from the low 32 times Parquet's salts)
    footer           one block: check | magic "KVLZRUN1" | number, entries, tombstones, blocks, bloom blocks,
                     block bytes, last id, hash seed, crc32 of the fences and of the bloom (u64 each)
"""
from __future__ import annotations

import math
import os
import zlib
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from kvstore_lazy import paths
from kvstore_lazy.store import kernels
from kvstore_lazy.store.disk.errors import SegmentError
from kvstore_lazy.store.disk.files import fsync_path
from kvstore_lazy.store.disk.reads import uring

TOMBSTONE = 0xFFFFFFFE              # a removed id, in the memtable and in runs
RUN_PREFIX, RUN_SUFFIX, TEMP_SUFFIX = paths.RUN_PREFIX, paths.RUN_SUFFIX, paths.TEMP_SUFFIX
RUN_GLOB = f"{RUN_PREFIX}*{RUN_SUFFIX}"
BLOCK_BYTES = 4096
CHUNK = 1 << 16                     # entries a run's bloom filter is built from at a time (read back)
READ_BLOCKS = 1024                  # blocks a lookup reads per batched call (4 MiB)
READ_RING = True                    # through an io_uring where the kernel has one (kernels.pread_records)
_MAGIC = np.frombuffer(b"KVLZRUN1", np.uint64)[0]
_FOOTER = np.dtype([("check", "<u4"), ("zero", "<u4"), ("magic", "<u8"), ("number", "<u8"), ("entries", "<u8"),
                    ("tombstones", "<u8"), ("blocks", "<u8"), ("bloom_blocks", "<u8"), ("block_bytes", "<u8"),
                    ("last", "<u8"), ("seed", "<u8"), ("fences_crc", "<u8"), ("bloom_crc", "<u8")])
_SEED = 0x5BD1E9955BD1E995
_BLOOM_SALT = np.array([0x47B6137B, 0x44974D91, 0x8824AD5B, 0xA2B7289D, 0x705495C7, 0x2DF1424B, 0x9EFC4947,
                        0x5C6BFB31], np.uint32)     # Parquet's split-block bloom filter salts
_M32 = np.uint64(0xFFFFFFFF)
_ROW = np.dtype("V32")              # one block of the bloom filter as one item

def run_name(number: int) -> str:
    """The file name of the ``number``-th run an index wrote (numbers are not reused within a commit's life)."""
    return paths.index_run(".", number).name


def mix64(ids: np.ndarray, seed: int) -> np.ndarray:
    """splitmix64's finalizer of ``ids ^ seed``: the bloom filter's hash (uint64 wrap-around is the point)."""
    x = ids ^ np.uint64(seed)
    x ^= x >> np.uint64(30)
    x *= np.uint64(0xBF58476D1CE4E5B9)
    x ^= x >> np.uint64(27)
    x *= np.uint64(0x94D049BB133111EB)
    x ^= x >> np.uint64(31)
    return x


def _bloom_where(ids: np.ndarray, nblocks: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(block of each id, its (n, 8) uint32 bit masks: one bit in each word of the block)."""
    h = mix64(ids, seed)
    block = ((h >> np.uint64(32)) * np.uint64(nblocks)) >> np.uint64(32)       # fast range: high bits
    bits = (h.astype(np.uint32)[:, None] * _BLOOM_SALT[None, :]) >> np.uint32(27)    # low bits: 5 a word
    return block.astype(np.int64), np.left_shift(np.uint32(1), bits)


def _bloom_add(bloom: np.ndarray, ids: np.ndarray, seed: int) -> None:
    """Set the bits of ``ids``. No sort: ids sharing a block in one assignment overwrite each other (one wins),
    so the losers go again until every id's bits are set; in pieces of at most 1/4 of the filter's blocks, so few do."""
    step = min(max(256, len(bloom) // 4), 1 << 14)     # (a piece's temporaries: ~100 bytes an id)
    rows = bloom.view(_ROW).reshape(-1)                 # a block as one item: gathered and put as a whole
    for lo in range(0, len(ids), step):
        block, masks32 = _bloom_where(ids[lo:lo + step], len(bloom), seed)
        masks = masks32.view(np.uint64)
        while len(block):
            words = rows[block].view(np.uint64).reshape(-1, 4)
            words |= masks
            rows[block] = words.view(_ROW).reshape(-1)
            short = ((rows[block].view(np.uint64).reshape(-1, 4) & masks) != masks).any(axis=1)
            block, masks = block[short], masks[short]


def _bloom_test(bloom: np.ndarray, ids: np.ndarray, seed: int) -> np.ndarray:
    block, masks = _bloom_where(ids, len(bloom), seed)
    words = bloom.view(_ROW).reshape(-1)[block].view(np.uint64).reshape(-1, 4)
    return ((words & masks.view(np.uint64)) == masks.view(np.uint64)).all(axis=1)


class Format:
    """The sizes of blocks of ``block_bytes`` and their check (the record check of :mod:`.layout`)."""

    def __init__(self, block_bytes: int) -> None:
        if block_bytes < 64 or block_bytes % 8:
            raise ValueError(f"block_bytes must be a multiple of 8 of at least 64, got {block_bytes}")
        self.block_bytes = int(block_bytes)
        self.per_block = (self.block_bytes - 8) // 12           # E: entries a block
        self.words = self.block_bytes // 4
        self.mult = (np.arange(self.words, dtype=np.uint64) * np.uint64(2) + np.uint64(0x2545F491)) & _M32
        self.mult[0] = 0                                        # the check word itself

    def salts(self, number: int, blocks: np.ndarray) -> np.ndarray:
        """What a block's check mixes in: its run's number and its own."""
        mixed = blocks.astype(np.uint64) * np.uint64(0x9E3779B1) + np.uint64((number * 0x85EBCA77) & 0xFFFFFFFF)
        return (mixed & _M32).astype(np.uint32)

    def ids_locs(self, buf: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Views of (counts, ids, locs) of blocks in ``buf`` ((n, block_bytes) uint8)."""
        e = self.per_block
        return buf[:, 4:8].view(np.uint32)[:, 0], buf[:, 8:8 + 8 * e].view(np.uint64), \
            buf[:, 8 + 8 * e:8 + 12 * e].view(np.uint32)

    def seal(self, buf: np.ndarray, number: int, first_block: int) -> None:
        words = buf.view(np.uint32)
        kernels.record_seal(words, self.mult, self.salts(number, np.arange(first_block, first_block + len(buf))), 0)

    def bad(self, buf: np.ndarray, number: int, blocks: np.ndarray) -> np.ndarray:
        """Indexes (into ``buf``) of the blocks whose check fails."""
        words = buf.view(np.uint32)
        return np.flatnonzero(kernels.record_checks(words, self.mult, self.salts(number, blocks)) != words[:, 0])


class Run:
    """One run file, open: its counts, fences and bloom filter in RAM, a file descriptor for reads."""

    def __init__(self, path: Path, fmt: Format, footer: np.ndarray, fences: np.ndarray, bloom: np.ndarray) -> None:
        self.path, self.name, self.fmt = path, path.name, fmt
        self.number, self.entries = int(footer["number"]), int(footer["entries"])
        self.tombstones, self.blocks = int(footer["tombstones"]), int(footer["blocks"])
        self.last, self.seed = np.uint64(footer["last"]), int(footer["seed"])
        self.fences, self.bloom = fences, bloom
        self.file_bytes = (self.blocks + _pad_blocks(8 * self.blocks, fmt.block_bytes)
                           + _pad_blocks(bloom.nbytes, fmt.block_bytes) + 1) * fmt.block_bytes
        self.fd = os.open(path, os.O_RDONLY)

    def ram_bytes(self) -> int:
        return self.fences.nbytes + self.bloom.nbytes

    def drop_filter(self) -> None:
        """Free the bloom filter (a merge reads the run whole and needs none; its output's takes the room)."""
        self.bloom = np.zeros((0, 8), np.uint32)

    def load_filter(self) -> None:
        """The bloom filter read back from the file (checked), after :meth:`drop_filter`."""
        again = open_run(self.path, self.fmt)
        again.close()
        self.bloom = again.bloom

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def read_blocks(self, blocks: np.ndarray) -> np.ndarray:
        """The blocks numbered ``blocks`` (ascending), read in one batched call and checked (SegmentError naming
        the file and the first bad block): (n, block_bytes) uint8."""
        fmt = self.fmt
        buf = np.empty((len(blocks), fmt.block_bytes), np.uint8)
        err, row = kernels.pread_records(np.full(len(blocks), self.fd, np.int32),
                                         blocks.astype(np.int64) * fmt.block_bytes, fmt.block_bytes, buf,
                                         READ_RING and uring())
        if err:
            what = "the file ends early" if err < 0 else os.strerror(err)
            raise SegmentError(f"index run {self.path}: cannot read block {int(blocks[row])}: {what}")
        bad = fmt.bad(buf, self.number, blocks)
        counts = fmt.ids_locs(buf)[0]
        want = np.minimum(fmt.per_block, self.entries - blocks.astype(np.int64) * fmt.per_block)
        wrong = np.flatnonzero(counts != want)
        if len(bad) or len(wrong):
            first = min(np.concatenate([bad, wrong]))
            raise SegmentError(f"index run {self.path}: block {int(blocks[first])} is damaged (failed check)")
        return buf

    def chunks(self, chunk: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """(ids, locs) of every entry, ascending, about ``chunk`` entries at a time (whole blocks)."""
        step = max(1, chunk // self.fmt.per_block)
        for lo in range(0, self.blocks, step):
            blocks = np.arange(lo, min(lo + step, self.blocks))
            yield self._entries(self.read_blocks(blocks), blocks)

    def _entries(self, buf: np.ndarray, blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(ids, locs) of the blocks in ``buf`` (ascending numbers), concatenated: sorted; the last block's padding
        cut when it is there."""
        _, ids, locs = self.fmt.ids_locs(buf)
        n = len(blocks) * self.fmt.per_block
        if len(blocks) and blocks[-1] == self.blocks - 1:
            n -= self.blocks * self.fmt.per_block - self.entries
        return ids.reshape(-1)[:n], locs.reshape(-1)[:n]

    def may_hold(self, ids: np.ndarray) -> np.ndarray:
        """A mask of the ``ids`` this run may hold (its id range and bloom filter, in RAM: no read; never False
        for an id it holds)."""
        out = (ids >= self.fences[0]) & (ids <= self.last) if self.blocks else np.zeros(len(ids), bool)
        at = np.flatnonzero(out)
        if len(at):
            out[at] = _bloom_test(self.bloom, ids[at], self.seed)
        return out

    def probe(self, ids: np.ndarray, counters: dict) -> tuple[np.ndarray, np.ndarray]:
        """(mask of ``ids`` (ascending) found here, their locations, tombstones included)."""
        found = np.zeros(len(ids), bool)
        at = np.flatnonzero((ids >= self.fences[0]) & (ids <= self.last))
        if len(at):
            passed = _bloom_test(self.bloom, ids[at], self.seed)
            counters["bloom_negatives"] += int(len(at) - passed.sum())
            at = at[passed]
        if not len(at):
            return found, np.zeros(0, np.uint32)
        want = ids[at]
        blk = np.searchsorted(self.fences, want, side="right") - 1
        unique = np.unique(blk)
        locs = np.zeros(len(at), np.uint32)
        hit = np.zeros(len(at), bool)
        for lo in range(0, len(unique), READ_BLOCKS):
            blocks = unique[lo:lo + READ_BLOCKS]
            a, b = np.searchsorted(blk, blocks[0], "left"), np.searchsorted(blk, blocks[-1], "right")
            hit[a:b], locs[a:b] = self._search(self.read_blocks(blocks), blocks, blk[a:b], want[a:b])
            counters["blocks_read"] += len(blocks)
        counters["bloom_false"] += int(len(at) - hit.sum())
        found[at[hit]] = True
        return found, locs[hit]


    def _search(self, buf: np.ndarray, blocks: np.ndarray, blk: np.ndarray, want: np.ndarray
                ) -> tuple[np.ndarray, np.ndarray]:
        """(found, location) of each id ``want[i]`` in its block ``blk[i]`` (one of ``blocks``, read into
        ``buf``): a binary search in every block at once, in place in ``buf`` (no copy of the blocks' ids)."""
        counts, ids, locs = self.fmt.ids_locs(buf)
        row = np.searchsorted(blocks, blk)
        lo, hi = np.zeros(len(want), np.int64), counts[row].astype(np.int64)
        for _ in range(self.fmt.per_block.bit_length()):
            mid = (lo + hi) >> 1
            less = ids[row, np.minimum(mid, self.fmt.per_block - 1)] < want
            open_ = lo < hi
            lo = np.where(open_ & less, mid + 1, lo)
            hi = np.where(open_ & ~less, mid, hi)
        at = np.minimum(lo, self.fmt.per_block - 1)
        return (lo < counts[row]) & (ids[row, at] == want), locs[row, at]


def _pad_blocks(nbytes: int, block_bytes: int) -> int:
    return -(-nbytes // block_bytes)


def write_all(fd: int, data) -> None:
    """os.write until every byte is written (the one place a run's bytes go out: a test fails it)."""
    view = memoryview(data)
    if not view.nbytes:      # nothing left to write (a run whose entries filled its last write exactly)
        return
    view = view.cast("B")
    while len(view):
        view = view[os.write(fd, view):]


class RunWriter:
    """A run being written: entries added in ascending id order, whole blocks written as they fill; at
    :meth:`finish` the fences, the bloom filter (built from the blocks read back: sized by the exact count) and the
    footer, then fsync, rename, fsync of the directory."""

    WRITE_BLOCKS = 256          # blocks a write (1 MiB)

    def __init__(self, directory: Path, number: int, fmt: Format, bloom_bits: float) -> None:
        self.directory, self.number, self.fmt, self.bloom_bits = directory, number, fmt, bloom_bits
        self.path = directory / run_name(number)
        self.tmp = self.path.with_name(self.path.name + TEMP_SUFFIX)
        self.fd = os.open(self.tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        self.pending: list[tuple[np.ndarray, np.ndarray]] = []
        self.npending = self.entries = self.tombstones = self.blocks = 0
        self.fences: list[np.ndarray] = []
        self.last = np.uint64(0)

    def add(self, ids: np.ndarray, locs: np.ndarray) -> None:
        if not len(ids):
            return
        self.pending.append((ids, locs))
        self.npending += len(ids)
        self.entries += len(ids)
        self.tombstones += int((locs == TOMBSTONE).sum())
        self.last = ids[-1]
        if self.npending >= self.WRITE_BLOCKS * self.fmt.per_block:
            self._write(final=False)

    def _write(self, final: bool) -> None:
        e = self.fmt.per_block
        ids = np.concatenate([p[0] for p in self.pending]) if self.pending else np.zeros(0, np.uint64)
        locs = np.concatenate([p[1] for p in self.pending]) if self.pending else np.zeros(0, np.uint32)
        n = len(ids) if final else len(ids) // e * e
        nb = -(-n // e)
        buf = np.zeros((nb, self.fmt.block_bytes), np.uint8)
        counts, bids, blocs = self.fmt.ids_locs(buf)
        flat_ids, flat_locs = np.zeros(nb * e, np.uint64), np.zeros(nb * e, np.uint32)
        flat_ids[:n], flat_locs[:n] = ids[:n], locs[:n]
        bids[:] = flat_ids.reshape(nb, e)
        blocs[:] = flat_locs.reshape(nb, e)
        counts[:] = np.minimum(e, n - np.arange(nb) * e)
        self.fmt.seal(buf, self.number, self.blocks)
        write_all(self.fd, buf)
        self.fences.append(ids[:n:e].copy())
        self.blocks += nb
        self.pending = [(ids[n:], locs[n:])] if n < len(ids) else []
        self.npending = len(ids) - n

    def finish(self) -> Run:
        fmt = self.fmt
        self._write(final=True)
        fences = np.concatenate(self.fences) if self.fences else np.zeros(0, np.uint64)
        bloom = np.zeros((max(1, math.ceil(self.entries * self.bloom_bits / 256)), 8), np.uint32)
        for lo in range(0, self.blocks, max(1, CHUNK // fmt.per_block)):      # the blocks read back, in chunks
            nb = min(max(1, CHUNK // fmt.per_block), self.blocks - lo)
            buf = np.frombuffer(os.pread(self.fd, nb * fmt.block_bytes, lo * fmt.block_bytes), np.uint8)
            buf = buf.reshape(nb, fmt.block_bytes)
            _, ids, _ = fmt.ids_locs(buf)
            n = min(nb * fmt.per_block, self.entries - lo * fmt.per_block)
            _bloom_add(bloom, ids.reshape(-1)[:n], _SEED)
        for part in (fences, bloom):
            raw = part.view(np.uint8).reshape(-1)
            write_all(self.fd, raw)
            write_all(self.fd, bytes(-len(raw) % fmt.block_bytes))
        footer = np.zeros(1, _FOOTER)
        footer["magic"], footer["number"], footer["entries"] = _MAGIC, self.number, self.entries
        footer["tombstones"], footer["blocks"], footer["bloom_blocks"] = self.tombstones, self.blocks, len(bloom)
        footer["block_bytes"], footer["last"], footer["seed"] = fmt.block_bytes, self.last, _SEED
        footer["fences_crc"], footer["bloom_crc"] = zlib.crc32(fences.data), zlib.crc32(bloom.data)
        block = np.zeros((1, fmt.block_bytes), np.uint8)
        block[0, :_FOOTER.itemsize] = footer.view(np.uint8)
        _seal_footer(block, fmt, self.number)
        write_all(self.fd, block)
        os.fsync(self.fd)
        os.close(self.fd)
        self.fd = -1
        os.replace(self.tmp, self.path)
        fsync_path(self.directory)
        return Run(self.path, fmt, footer[0], fences, bloom)

    def abort(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        self.tmp.unlink(missing_ok=True)


def _seal_footer(block: np.ndarray, fmt: Format, number: int) -> None:
    words = block.view(np.uint32)
    kernels.record_seal(words, fmt.mult, np.array([(~number) & 0xFFFFFFFF], np.uint32), 0)


def _read_into(f, array: np.ndarray) -> np.ndarray:
    """``array`` filled from the file's position on, without a copy (SegmentError-worthy OSError if it ends)."""
    view = array.data.cast("B")
    while len(view):
        got = f.readinto(view)
        if not got:
            raise OSError(0, "the file ends early")
        view = view[got:]
    return array


def open_run(path: Path, fmt: Format) -> Run:
    """A run file opened and checked (footer, fences, bloom filter, size): SegmentError naming it otherwise."""
    bb = fmt.block_bytes
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            if size < bb or size % bb:
                raise SegmentError(f"index run {path} has {size} bytes, not a whole number of {bb}-byte blocks")
            f.seek(size - bb)
            block = np.frombuffer(f.read(bb), np.uint8).reshape(1, bb).copy()
            footer = block[0, :_FOOTER.itemsize].view(_FOOTER)[0]
            number = int(footer["number"])
            words = block.view(np.uint32)
            if (footer["magic"] != _MAGIC or int(footer["block_bytes"]) != bb
                    or kernels.record_checks(words, fmt.mult, np.array([(~number) & 0xFFFFFFFF], np.uint32))[0]
                    != words[0, 0]):
                raise SegmentError(f"index run {path}: damaged or foreign footer")
            blocks, bloom_blocks = int(footer["blocks"]), int(footer["bloom_blocks"])
            want = (blocks + _pad_blocks(8 * blocks, bb) + _pad_blocks(32 * bloom_blocks, bb) + 1) * bb
            if size != want:
                raise SegmentError(f"index run {path} has {size} bytes, its footer says {want}")
            f.seek(blocks * bb)
            fences = _read_into(f, np.empty(blocks, np.uint64))
            f.seek((blocks + _pad_blocks(8 * blocks, bb)) * bb)
            bloom = _read_into(f, np.empty((bloom_blocks, 8), np.uint32))
    except OSError as exc:
        raise SegmentError(f"index run {path}: cannot read it: {exc.strerror or exc}") from None
    if zlib.crc32(fences.data) != int(footer["fences_crc"]):
        raise SegmentError(f"index run {path}: damaged fences (failed check)")
    if zlib.crc32(bloom.data) != int(footer["bloom_crc"]):
        raise SegmentError(f"index run {path}: damaged bloom filter (failed check)")
    return Run(path, fmt, footer, fences, bloom)


def merged(sources: list[Iterator[tuple[np.ndarray, np.ndarray]]], drop_tombstones: bool
            ) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """A k-way merge of sorted chunk streams (``sources`` oldest first; ids unique within each): (ids, locs)
    ascending, each id once with its newest location, tombstones dropped if asked. Holds one chunk per source: each
    step emits every entry up to the smallest last id of the chunks held, so at least one chunk is used up."""
    held: list[tuple[np.ndarray, np.ndarray] | None] = [next(s, None) for s in sources]
    while True:
        live = [i for i, h in enumerate(held) if h is not None]
        if not live:
            return
        bound = min(held[i][0][-1] for i in live)
        ids, locs, rank = [], [], []
        for i in live:
            h_ids, h_locs = held[i]
            cut = int(np.searchsorted(h_ids, bound, side="right"))
            ids.append(h_ids[:cut])
            locs.append(h_locs[:cut])
            rank.append(np.full(cut, i, np.int32))
            if cut < len(h_ids):
                held[i] = (h_ids[cut:], h_locs[cut:])
            else:
                nxt = next(sources[i], None)
                while nxt is not None and not len(nxt[0]):
                    nxt = next(sources[i], None)
                held[i] = nxt
        all_ids, all_locs, all_rank = np.concatenate(ids), np.concatenate(locs), np.concatenate(rank)
        order = np.lexsort((-all_rank, all_ids))        # by id, the newest source first
        all_ids, all_locs = all_ids[order], all_locs[order]
        first = np.concatenate(([True], all_ids[1:] != all_ids[:-1])) if len(all_ids) else np.zeros(0, bool)
        if drop_tombstones:
            first &= all_locs != TOMBSTONE
        yield all_ids[first], all_locs[first]


def rechunk(stream: Iterator[tuple[np.ndarray, np.ndarray]], chunk: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    for ids, locs in stream:
        for lo in range(0, len(ids), chunk):
            yield ids[lo:lo + chunk], locs[lo:lo + chunk]
