"""The compiled loops of the disk index's runs (``store/kernels_runs.c``, in the kernels library) as numpy calls.

Owns: each call's argument checks (dtypes, shapes, lengths: the C loops index raw memory) and its one ctypes call
(the GIL released meanwhile). Does not own: the loops (kernels_runs.c), the library's loading and signatures
(:mod:`kvstore_lazy.store.kernels`), or what the runs are (:mod:`.runfile`, :mod:`.runs`).
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvstore_lazy.store.kernels import _addr, _lib      # (the library, loaded and checked, and its pointer helper)


def _u64(a) -> np.ndarray:
    return np.ascontiguousarray(a, np.uint64)


def runs_bloom_add(bloom: np.ndarray, ids: np.ndarray, seed: int) -> None:
    """Set the bits of ``ids`` in the split-block bloom filter ``bloom`` ((nblocks, 8) uint32, C-contiguous,
    writable; runfile's layout)."""
    if bloom.dtype != np.uint32 or bloom.ndim != 2 or bloom.shape[1] != 8 or not bloom.flags.c_contiguous \
            or not bloom.flags.writeable:
        raise ValueError(f"runs_bloom_add: a writable C-contiguous (n, 8) uint32 filter, got {bloom.dtype} "
                         f"{bloom.shape}")
    ids = _u64(ids)
    if len(ids) and len(bloom):
        _lib.runs_bloom_add(_addr(bloom), len(bloom), int(seed), _addr(ids), len(ids))


def runs_bloom_test(bloom: np.ndarray, ids: np.ndarray, seed: int) -> np.ndarray:
    """A mask of the ``ids`` the filter may hold (never False for an id added)."""
    bloom = np.ascontiguousarray(bloom, np.uint32)
    if bloom.ndim != 2 or bloom.shape[1] != 8:
        raise ValueError(f"runs_bloom_test: an (n, 8) uint32 filter, got {bloom.shape}")
    ids = _u64(ids)
    out = np.zeros(len(ids), np.uint8)
    if len(ids) and len(bloom):
        _lib.runs_bloom_test(_addr(bloom), len(bloom), int(seed), _addr(ids), len(ids), _addr(out))
    return out.view(bool)


def runs_probe(plan: tuple, after: int | None, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray,
                                                                          np.ndarray, int]:
    """The candidates of ``ids`` (uint64, ascending) in a group of runs: ``plan`` = (first, last, fence addresses,
    fence counts, filter addresses, filter block counts, seeds), one entry a run (uint64, int64 for the counts),
    ranges disjoint and ascending, every run non-empty; the caller keeps the fences and filters alive. Ids at or
    below ``after`` are not looked at (None: none). Returns (positions in ``ids`` of the candidates, the index of
    each one's block among the distinct blocks, the run and the block number of each distinct block, the ids in a
    run's range its filter refused)."""
    first, last, fences, nfences, blooms, nblooms, seeds = plan
    ids = _u64(ids)
    n = len(ids)
    cand, row, utable, ublock = (np.empty(max(n, 1), np.int64) for _ in range(4))
    counts = np.zeros(2, np.int64)
    nc = _lib.runs_probe(len(first), _addr(first), _addr(last), _addr(fences), _addr(nfences), _addr(blooms),
                         _addr(nblooms), _addr(seeds), after is not None, 0 if after is None else int(after),
                         _addr(ids), n, _addr(cand), _addr(row), _addr(utable), _addr(ublock), _addr(counts[:1]),
                         counts[1:].ctypes.data)
    nu = int(counts[0])
    return cand[:nc], row[:nc], utable[:nu], ublock[:nu], int(counts[1])


def runs_verify(buf: np.ndarray, per_block: int, mult: np.ndarray, numbers: np.ndarray, blocks: np.ndarray,
                entries: np.ndarray) -> int:
    """The index of the first block of ``buf`` ((n, block_bytes) uint8, C-contiguous) whose check (the record check
    with ``mult`` (uint32, a word each), its salt from ``numbers[i]`` (its run's) and ``blocks[i]`` (its own)) or
    count (``per_block``, or what ``entries[i]``, its run's, leaves for its last block) is wrong; -1 if none."""
    mult = np.ascontiguousarray(mult, np.uint32)
    numbers, blocks = _u64(numbers), np.ascontiguousarray(blocks, np.int64)
    entries = np.ascontiguousarray(entries, np.int64)
    n = len(buf)
    if buf.dtype != np.uint8 or buf.ndim != 2 or not buf.flags.c_contiguous or buf.shape[1] % 4 \
            or mult.shape != (buf.shape[1] // 4,) or not len(numbers) == len(blocks) == len(entries) == n:
        raise ValueError(f"runs_verify: blocks {buf.dtype} {buf.shape}, {len(mult)} weights, {len(numbers)} runs, "
                         f"{len(blocks)} numbers, {len(entries)} counts")
    if not n:
        return -1
    return int(_lib.runs_verify(_addr(buf), n, buf.shape[1], int(per_block), _addr(mult), _addr(numbers),
                                _addr(blocks), _addr(entries)))


def runs_read_search(of_runs: tuple, table: np.ndarray, block: np.ndarray, lo: int, hi: int, block_bytes: int,
                     per_block: int, mult: np.ndarray, row: np.ndarray, ids: np.ndarray, out: np.ndarray
                     ) -> tuple[int, int, int]:
    """Blocks ``lo`` to ``hi`` of a probe's distinct blocks (block ``block[u]`` of run ``table[u]``; ``of_runs``:
    the runs' descriptors (int32), numbers (uint64) and entry counts (int64)) read one at a time with pread,
    checked, and searched for the candidates whose ``row`` (ascending) is theirs: ``out[c]`` the location of
    ``ids[c]`` there, 0xFFFFFFFF if it does not hold it. Releases the GIL. Returns ``(0, -1, 0)``, or ``(1, u,
    errno)`` for a failed read (errno -1: the file ends early), ``(2, u, 0)`` for a damaged block."""
    fds, numbers, entries = of_runs
    table, block, row = (np.ascontiguousarray(a, np.int64) for a in (table, block, row))
    ids, mult = _u64(ids), np.ascontiguousarray(mult, np.uint32)
    n = len(ids)
    if (fds.dtype != np.int32 or numbers.dtype != np.uint64 or entries.dtype != np.int64
            or not len(fds) == len(numbers) == len(entries) or len(table) != len(block) or len(row) != n
            or out.dtype != np.uint32 or len(out) != n or not out.flags.c_contiguous or not 0 <= lo <= hi <= len(table)
            or mult.shape != (block_bytes // 4,) or (len(table) and (table.min() < 0 or table.max() >= len(fds)))):
        raise ValueError("runs_read_search: arrays of the wrong type or length")
    scratch = np.empty(block_bytes, np.uint8)
    failed = np.zeros(2, np.int64)
    code = _lib.runs_read_search(_addr(fds), _addr(numbers), _addr(entries), _addr(table), _addr(block), int(lo),
                                 int(hi), int(block_bytes), int(per_block), _addr(mult), _addr(row), _addr(ids), n,
                                 _addr(out), _addr(scratch), _addr(failed))
    return int(code), int(failed[0]), int(failed[1])


def runs_cache_get(cache_ids: np.ndarray, cache_locs: np.ndarray, shift: int, ids: np.ndarray) -> np.ndarray:
    """The location cached for each of ``ids`` (0xFFFFFFFF: none) in the direct-mapped cache of lookups
    (runwork.Recent: ``cache_ids`` uint64 and ``cache_locs`` uint32 of 2^(64 - ``shift``) slots)."""
    ids = _u64(ids)
    _cache_checked(cache_ids, cache_locs, shift)
    out = np.empty(len(ids), np.uint32)
    if len(ids):
        _lib.runs_cache_get(_addr(cache_ids), _addr(cache_locs), int(shift), _addr(ids), len(ids), _addr(out))
    return out


def runs_cache_put(cache_ids: np.ndarray, cache_locs: np.ndarray, shift: int, ids: np.ndarray,
                   locs: np.ndarray) -> None:
    """Put (``ids[i]``, ``locs[i]``) in their slots of the cache (see :func:`runs_cache_get`)."""
    ids, locs = _u64(ids), np.ascontiguousarray(locs, np.uint32)
    _cache_checked(cache_ids, cache_locs, shift)
    if len(ids) != len(locs):
        raise ValueError(f"runs_cache_put: {len(ids)} ids, {len(locs)} locations")
    if len(ids):
        _lib.runs_cache_put(_addr(cache_ids), _addr(cache_locs), int(shift), _addr(ids), _addr(locs), len(ids))


def _cache_checked(cache_ids: np.ndarray, cache_locs: np.ndarray, shift: int) -> None:
    slots = 1 << (64 - shift) if 0 < shift <= 64 else -1
    if (cache_ids.dtype != np.uint64 or cache_locs.dtype != np.uint32 or not cache_ids.flags.c_contiguous
            or not cache_locs.flags.c_contiguous or len(cache_ids) != slots or len(cache_locs) != slots):
        raise ValueError(f"runs cache: {cache_ids.dtype} {cache_ids.shape} ids, {cache_locs.dtype} "
                         f"{cache_locs.shape} locations, shift {shift}")


def runs_search(buf: np.ndarray, per_block: int, row: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """The location of each ``ids[c]`` in the block ``buf[row[c]]`` ((nblocks, block_bytes) uint8, C-contiguous:
    check, count, ids, locations), 0xFFFFFFFF where that block does not hold it."""
    if buf.dtype != np.uint8 or buf.ndim != 2 or not buf.flags.c_contiguous or 8 + 12 * per_block > buf.shape[1]:
        raise ValueError(f"runs_search: blocks {buf.dtype} {buf.shape} of {per_block} entries")
    row, ids = np.ascontiguousarray(row, np.int64), _u64(ids)
    if len(row) != len(ids) or (len(row) and (row.min() < 0 or row.max() >= len(buf))):
        raise ValueError(f"runs_search: {len(ids)} ids, {len(row)} rows of {len(buf)} blocks")
    out = np.empty(len(ids), np.uint32)
    if len(ids):
        _lib.runs_search(_addr(buf), buf.shape[1], int(per_block), _addr(row), _addr(ids), len(ids), _addr(out))
    return out


def runs_merge(chunks: Sequence[tuple[np.ndarray, np.ndarray]], drop_tombstones: bool
               ) -> tuple[np.ndarray, np.ndarray]:
    """The merge of sorted chunks ``[(ids uint64 ascending unique, locs uint32)]``, a later one newer: every id once
    with its newest location, ascending; those whose newest is the tombstone (0xFFFFFFFE) left out if asked."""
    chunks = [(_u64(i), np.ascontiguousarray(v, np.uint32)) for i, v in chunks]
    if any(len(i) != len(v) for i, v in chunks):
        raise ValueError("runs_merge: ids and locations of different lengths")
    total = sum(len(i) for i, _ in chunks)
    out_ids, out_locs = np.empty(max(total, 1), np.uint64), np.empty(max(total, 1), np.uint32)
    ids_at = np.array([i.ctypes.data for i, _ in chunks], np.uint64)
    locs_at = np.array([v.ctypes.data for _, v in chunks], np.uint64)
    lens = np.array([len(i) for i, _ in chunks], np.int64)
    m = _lib.runs_merge(len(chunks), _addr(ids_at), _addr(locs_at), _addr(lens), bool(drop_tombstones),
                        _addr(out_ids), _addr(out_locs))
    if m < 0:
        raise MemoryError("runs_merge: out of memory")
    return out_ids[:m], out_locs[:m]


def live_bits_apply(bits: np.ndarray, lens: np.ndarray, locs: np.ndarray, shift: int, on: bool) -> int:
    """Set (``on``) or clear the live bit of each of ``locs`` (uint32 ``slot << shift | record``, any order, repeats
    allowed) in the segments' bits: ``bits[s]`` the address of slot s's bytes (uint64), ``lens[s]`` how many (int64;
    the caller keeps those arrays alive and at least that long). Returns -1, or for a set the index in ``locs`` of
    the first location past its segment's bytes or slots (those before it are done)."""
    locs = np.ascontiguousarray(locs, np.uint32)
    _bits_checked(bits, lens, shift)
    if not len(locs):
        return -1
    return int(_lib.live_bits_apply(_addr(bits), _addr(lens), len(bits), _addr(locs), len(locs), int(shift),
                                    (1 << int(shift)) - 1, bool(on)))


def live_bits_test(bits: np.ndarray, lens: np.ndarray, locs: np.ndarray, shift: int) -> np.ndarray:
    """Whether the live bit of each of ``locs`` is set (False past its segment's bytes or the slots known); the
    arrays as for :func:`live_bits_apply`."""
    locs = np.ascontiguousarray(locs, np.uint32)
    _bits_checked(bits, lens, shift)
    out = np.zeros(len(locs), np.uint8)
    if len(locs):
        _lib.live_bits_test(_addr(bits), _addr(lens), len(bits), _addr(locs), len(locs), int(shift),
                            (1 << int(shift)) - 1, _addr(out))
    return out.view(bool)


def _bits_checked(bits: np.ndarray, lens: np.ndarray, shift: int) -> None:
    if (bits.dtype != np.uint64 or lens.dtype != np.int64 or len(bits) != len(lens) or not bits.flags.c_contiguous
            or not lens.flags.c_contiguous or not 0 < shift < 32):
        raise ValueError(f"live bits: {bits.dtype} {bits.shape} addresses, {lens.dtype} {lens.shape} lengths, "
                         f"shift {shift}")
