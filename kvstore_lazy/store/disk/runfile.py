"""One run file of the disk index (:mod:`.runs`): its format, its writer, its reader, and the merge of sorted runs.

Owns: the bytes of a run file (blocks, fences, bloom filter, footer, and their checks), writing one
(:class:`RunWriter`: temp file, fsync, rename, fsync of the directory), opening one (:func:`open_run`: every part
checked, :class:`~.errors.SegmentError` naming the file otherwise), reading blocks batched (:class:`Probe`: a batch of
ids in a set of runs of disjoint id ranges, :meth:`Run.chunks`), the split-block bloom filter, and the streaming
k-way merge of sorted (id, loc) chunk streams (:func:`merged`). The inner loops are compiled
(``store/kernels_runs.c``: the filter's bits, the probe, the search in a block, the merge); the numpy filter here
(:func:`_bloom_add`, :func:`_bloom_test`) is their reference. Does not own: which runs exist, the memtable, when to
flush or merge, or the manifest (:class:`~.runs.RunIndex`).

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
from kvstore_lazy.store.disk import runcalls
from kvstore_lazy.store.disk.errors import SegmentError
from kvstore_lazy.store.disk.files import fsync_path
from kvstore_lazy.store.disk.pools import executor
from kvstore_lazy.store.disk.reads import uring

TOMBSTONE = 0xFFFFFFFE              # a removed id, in the memtable and in runs
EMPTY = 0xFFFFFFFF                  # absent (never stored)
RUN_PREFIX, RUN_SUFFIX, TEMP_SUFFIX = paths.RUN_PREFIX, paths.RUN_SUFFIX, paths.TEMP_SUFFIX
RUN_GLOB = f"{RUN_PREFIX}*{RUN_SUFFIX}"
BLOCK_BYTES = 4096
CHUNK = 1 << 16                     # entries a run's bloom filter is built from at a time (read back)
READ_SPLIT = 256                    # a lookup of at least twice this many blocks reads half on a pool thread
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


def new_bloom(entries: int, bits: float) -> np.ndarray:
    """An empty filter for ``entries`` ids at ``bits`` bits each: (blocks, 8) uint32, at least one block."""
    return np.zeros((max(1, math.ceil(entries * bits / 256)), 8), np.uint32)


def _bloom_where(ids: np.ndarray, nblocks: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(block of each id, its (n, 8) uint32 bit masks: one bit in each word of the block)."""
    h = mix64(ids, seed)
    block = ((h >> np.uint64(32)) * np.uint64(nblocks)) >> np.uint64(32)       # fast range: high bits
    bits = (h.astype(np.uint32)[:, None] * _BLOOM_SALT[None, :]) >> np.uint32(27)    # low bits: 5 a word
    return block.astype(np.int64), np.left_shift(np.uint32(1), bits)


def _bloom_add(bloom: np.ndarray, ids: np.ndarray, seed: int) -> None:
    """Set the bits of ``ids`` (the numpy reference of ``runcalls.runs_bloom_add``, which writes the same bits). No
    sort: ids sharing a block in one assignment overwrite each other (one wins), so the losers go again until every
    id's bits are set; in pieces of at most 1/4 of the filter's blocks, so few do."""
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
    """The numpy reference of ``runcalls.runs_bloom_test``."""
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
        self.mult32 = self.mult.astype(np.uint32)               # (each below 2^32: runcalls.runs_verify's)

    def salts(self, number, blocks: np.ndarray) -> np.ndarray:
        """What a block's check mixes in: its run's number (one, or one a block) and its own."""
        runs = (np.asarray(number, np.uint64) * np.uint64(0x85EBCA77)) & _M32
        mixed = blocks.astype(np.uint64) * np.uint64(0x9E3779B1) + runs
        return (mixed & _M32).astype(np.uint32)

    def ids_locs(self, buf: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Views of (counts, ids, locs) of blocks in ``buf`` ((n, block_bytes) uint8)."""
        e = self.per_block
        return buf[:, 4:8].view(np.uint32)[:, 0], buf[:, 8:8 + 8 * e].view(np.uint64), \
            buf[:, 8 + 8 * e:8 + 12 * e].view(np.uint32)

    def seal(self, buf: np.ndarray, number: int, first_block: int) -> None:
        words = buf.view(np.uint32)
        kernels.record_seal(words, self.mult, self.salts(number, np.arange(first_block, first_block + len(buf))), 0)

    def bad(self, buf: np.ndarray, number, blocks: np.ndarray) -> np.ndarray:
        """Indexes (into ``buf``) of the blocks whose check fails (``number``: their run's, or one a block)."""
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
        """Free the fences and the bloom filter of a run no lookup asks any more (replaced by a merge; its blocks
        can still be read, in order, by :meth:`chunks`)."""
        self.fences, self.bloom = np.zeros(0, np.uint64), np.zeros((0, 8), np.uint32)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __del__(self) -> None:
        try:
            self.close()
        except (OSError, AttributeError):
            pass

    def read_blocks(self, blocks: np.ndarray) -> np.ndarray:
        """The blocks numbered ``blocks`` (ascending), read in one batched call and checked (SegmentError naming
        the file and the first bad block): (n, block_bytes) uint8. Consecutive blocks of one file are one read:
        no io_uring (a merge reads on the background thread, which ends when idle; a thread's ring outlives it)."""
        return read_blocks([self], np.zeros(len(blocks), np.int64), blocks, ring=False)

    def chunks(self, chunk: int, after=None) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """(ids, locs) of every entry (above ``after``, if given), ascending, about ``chunk`` entries at a time
        (whole blocks)."""
        step = max(1, chunk // self.fmt.per_block)
        first = 0
        if after is not None and self.blocks:
            if self.last <= after:
                return
            if len(self.fences) == self.blocks:         # (a retired run has none: read from its start)
                first = max(0, int(np.searchsorted(self.fences, np.uint64(after), side="right")) - 1)
        for lo in range(first, self.blocks, step):
            blocks = np.arange(lo, min(lo + step, self.blocks))
            ids, locs = self._entries(self.read_blocks(blocks), blocks)
            if after is not None and len(ids) and ids[0] <= after:
                cut = int(np.searchsorted(ids, np.uint64(after), side="right"))
                ids, locs = ids[cut:], locs[cut:]
            yield ids, locs

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
        if not self.blocks or not len(self.fences):
            return np.zeros(len(ids), bool)
        out = (ids >= self.fences[0]) & (ids <= self.last)
        at = np.flatnonzero(out)
        if len(at):
            out[at] = runcalls.runs_bloom_test(self.bloom, ids[at], self.seed)
        return out


def read_blocks(runs: list[Run], which: np.ndarray, blocks: np.ndarray, of_runs: tuple | None = None,
                ring: bool = True) -> np.ndarray:
    """Block ``blocks[i]`` of run ``runs[which[i]]`` for each i (ascending (run, block) pairs), read in one batched
    call (adjacent blocks of a file one read; through this thread's io_uring with `ring`, where there is one) and
    checked: (n, block_bytes) uint8; SegmentError naming the file and the first bad block. ``of_runs``: the runs'
    (descriptors, numbers, entry counts) as arrays, if made already."""
    fmt = runs[0].fmt if runs else None
    if fmt is None or not len(blocks):
        return np.empty((0, fmt.block_bytes if fmt else BLOCK_BYTES), np.uint8)
    fds, numbers, entries = of_runs if of_runs is not None else _of_runs(runs)
    buf = np.empty((len(blocks), fmt.block_bytes), np.uint8)
    err, row = kernels.pread_records(fds[which], blocks.astype(np.int64) * fmt.block_bytes, fmt.block_bytes, buf,
                                     ring and READ_RING and uring())
    if err:
        what = "the file ends early" if err < 0 else os.strerror(err)
        raise SegmentError(f"index run {runs[int(which[row])].path}: cannot read block {int(blocks[row])}: {what}")
    first = runcalls.runs_verify(buf, fmt.per_block, fmt.mult32, numbers[which], blocks, entries[which])
    if first >= 0:
        raise SegmentError(f"index run {runs[int(which[first])].path}: block {int(blocks[first])} is damaged "
                           "(failed check)")
    return buf


def _of_runs(runs: list[Run]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return (np.array([r.fd for r in runs], np.int32), np.array([r.number for r in runs], np.uint64),
            np.array([r.entries for r in runs], np.int64))


class Probe:
    """Lookups of batches in runs of disjoint id ranges, ascending (the runs of one flush or merge), through
    ``runcalls.runs_probe``: the arrays it takes (each run's range, the addresses of its fences and filter), made
    once for these runs (which must stay open and keep their filters while this is used)."""

    def __init__(self, runs: list[Run]) -> None:
        self.runs = [r for r in runs if r.blocks]
        rs = self.runs
        self.plan = (np.array([r.fences[0] for r in rs], np.uint64), np.array([r.last for r in rs], np.uint64),
                     np.array([r.fences.ctypes.data for r in rs], np.uint64),
                     np.array([len(r.fences) for r in rs], np.int64),
                     np.array([r.bloom.ctypes.data for r in rs], np.uint64),
                     np.array([len(r.bloom) for r in rs], np.int64), np.array([r.seed for r in rs], np.uint64))
        self.of_runs = _of_runs(rs)

    def __call__(self, ids: np.ndarray, after, counters: dict) -> tuple[np.ndarray, np.ndarray]:
        """(positions in ``ids`` (uint64, ascending) of the ids found, their locations, tombstones included); ids at
        or below ``after`` (None: no bound) are not looked at. Each distinct block is read once, checked and
        searched, one at a time by a compiled loop (``runcalls.runs_read_search``: one block's buffer, in cache while
        it is checked and searched; for a large batch, half the blocks on a pool thread meanwhile)."""
        if not self.runs or not len(ids):
            return np.zeros(0, np.int64), np.zeros(0, np.uint32)
        cand, row, table, block, refused = runcalls.runs_probe(self.plan, after, ids)
        counters["bloom_negatives"] += refused
        if not len(cand):
            return cand, np.zeros(0, np.uint32)
        locs = np.empty(len(cand), np.uint32)
        fmt = self.runs[0].fmt
        wanted = ids[cand]

        def search(start: int, end: int) -> None:          # blocks [start, end): read, checked, searched in C
            code, u, err = runcalls.runs_read_search(self.of_runs, table, block, start, end, fmt.block_bytes,
                                                    fmt.per_block, fmt.mult32, row, wanted, locs)
            if code:
                run, number = self.runs[int(table[u])], int(block[u])
                if code == 2:
                    raise SegmentError(f"index run {run.path}: block {number} is damaged (failed check)")
                what = "the file ends early" if err < 0 else os.strerror(err)
                raise SegmentError(f"index run {run.path}: cannot read block {number}: {what}")

        nblocks = len(table)
        if nblocks >= 2 * READ_SPLIT:                       # the second half on the pool's thread meanwhile
            other = executor("index", 1).submit(search, nblocks // 2, nblocks)
            try:
                search(0, nblocks // 2)
            finally:
                other.result()            # (joined even when this half failed: it reads the same descriptors)
        else:
            search(0, nblocks)
        counters["blocks_read"] += nblocks
        hit = locs != EMPTY
        counters["bloom_false"] += int(len(cand) - hit.sum())
        return cand[hit], locs[hit]


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
        """The whole blocks pending (with ``final``, the last part-filled one too) written, sealed."""
        e = self.fmt.per_block
        ids = np.concatenate([p[0] for p in self.pending]) if len(self.pending) > 1 else \
            self.pending[0][0] if self.pending else np.zeros(0, np.uint64)
        locs = np.concatenate([p[1] for p in self.pending]) if len(self.pending) > 1 else \
            self.pending[0][1] if self.pending else np.zeros(0, np.uint32)
        n = len(ids) if final else len(ids) // e * e
        nb, full = -(-n // e), n // e
        if nb:
            buf = np.zeros((nb, self.fmt.block_bytes), np.uint8)
            counts, bids, blocs = self.fmt.ids_locs(buf)
            bids[:full], blocs[:full] = ids[:full * e].reshape(full, e), locs[:full * e].reshape(full, e)
            if nb > full:                           # the run's last block, part-filled (zero padding after)
                bids[full, :n - full * e], blocs[full, :n - full * e] = ids[full * e:n], locs[full * e:n]
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
        bloom = new_bloom(self.entries, self.bloom_bits)
        for lo in range(0, self.blocks, max(1, CHUNK // fmt.per_block)):      # the blocks read back, in chunks
            nb = min(max(1, CHUNK // fmt.per_block), self.blocks - lo)
            buf = np.frombuffer(os.pread(self.fd, nb * fmt.block_bytes, lo * fmt.block_bytes), np.uint8)
            buf = buf.reshape(nb, fmt.block_bytes)
            _, ids, _ = fmt.ids_locs(buf)
            n = min(nb * fmt.per_block, self.entries - lo * fmt.per_block)
            runcalls.runs_bloom_add(bloom, ids.reshape(-1)[:n], _SEED)
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
            if blocks and not bloom_blocks:         # (every run with entries has a filter: a probe reads it)
                raise SegmentError(f"index run {path}: {blocks} blocks and no filter (damaged footer)")
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
    held: list[tuple[np.ndarray, np.ndarray] | None] = [_next_chunk(s) for s in sources]
    while True:
        live = [i for i, h in enumerate(held) if h is not None]
        if not live:
            return
        bound = min(held[i][0][-1] for i in live)
        pieces = []
        for i in live:
            h_ids, h_locs = held[i]
            cut = int(np.searchsorted(h_ids, bound, side="right"))
            pieces.append((h_ids[:cut], h_locs[:cut]))
            if cut < len(h_ids):
                held[i] = (h_ids[cut:], h_locs[cut:])
            else:
                held[i] = _next_chunk(sources[i])
        yield runcalls.runs_merge(pieces, drop_tombstones)       # (by id, the newest source's entry)


def _next_chunk(source: Iterator[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray] | None:
    """The next non-empty chunk of ``source``, or None at its end."""
    for ids, locs in source:
        if len(ids):
            return ids, locs
    return None


def rechunk(stream: Iterator[tuple[np.ndarray, np.ndarray]], chunk: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    for ids, locs in stream:
        for lo in range(0, len(ids), chunk):
            yield ids[lo:lo + chunk], locs[lo:lo + chunk]
