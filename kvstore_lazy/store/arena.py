"""An anonymous memory mapping of fixed-size rows that grows in place: the storage of a row table's arenas.

Owns: :class:`Arena` (a growable array of rows in its own ``mmap``: ``mremap`` growth that copies nothing, the
rows' gather and scatter as opaque blocks, and which pages of unused rows go back to the kernel: :meth:`Arena.clear`
and :meth:`Arena.release`, ``KEEP_SHARE``; :func:`release_free_memory`, the malloc heap's free pages). Does not own:
which rows are in use or where (``store.rows``: the table and its index keep ``len`` and the slots; an arena only
knows the rows it was told are unused).
"""
from __future__ import annotations

import mmap

import numpy as np

KEEP_SHARE = 16       # Arena.clear keeps (zeroed) a freed tail of at most 1/16 of the rows before it


class Arena:
    """A growable array of ``capacity`` rows of ``row_shape`` in an anonymous memory mapping; rows start zero.

    ``array`` is the numpy view (rebound by :meth:`grow`: don't keep it across a growth), ``take``/``put`` gather
    and scatter whole rows.
    """

    array: np.ndarray       # rows as ``(capacity,) + row_shape`` of dtype (unbound while the mapping grows)
    _rows: np.ndarray       # the same memory, one np.void item per row

    def __init__(self, row_shape: tuple[int, ...], dtype, capacity: int) -> None:
        self.row_shape = tuple(int(d) for d in row_shape)
        self.dtype = np.dtype(dtype)
        self.row_items = int(np.prod(self.row_shape, dtype=np.int64))
        self.row_bytes = self.row_items * self.dtype.itemsize
        if self.row_bytes <= 0:
            raise ValueError(f"rows of shape {self.row_shape} hold no bytes")
        self._void = np.dtype((np.void, self.row_bytes))
        self._map = self._new_map(max(int(capacity), 1))
        self._bind()
        self.top = 0            # rows below it may be resident: the most used since clear last gave pages back

    def __len__(self) -> int:
        return self.capacity

    def take(self, slots: np.ndarray) -> np.ndarray:
        """Copy of the rows at ``slots`` (checked by the caller), shape ``(len(slots),) + row_shape``."""
        return self._rows.take(slots).view(self.dtype).reshape((len(slots),) + self.row_shape)

    def put(self, slots: np.ndarray, values) -> None:
        """Write ``values`` (broadcast to ``(len(slots),) + row_shape``) to the rows at ``slots``."""
        values = np.broadcast_to(np.asarray(values, self.dtype), (len(slots),) + self.row_shape)
        values = np.ascontiguousarray(values).reshape(len(slots), self.row_items)
        np.put(self._rows, slots, values.view(self._void).reshape(-1))

    def grow(self, capacity: int, used: int) -> None:
        """Make room for ``capacity`` rows, keeping the first ``used``; rows past ``used`` must be zero (unwritten)."""
        if capacity <= self.capacity:
            return
        del self.array, self._rows      # no view of the mapping may stay for mremap
        try:
            self._map.resize(capacity * self.row_bytes)   # mremap: moves page tables, copies and touches nothing
        except (BufferError, OSError, SystemError, ValueError):  # a view escaped, or no mremap: copy the used rows
            self._bind()
            old = self._rows[:used]
            self._map = self._new_map(capacity)
            self._bind()
            self._rows[:used] = old
            return
        self._bind()

    def clear(self, lo: int, hi: int, keep: bool = True) -> None:
        """Zero rows ``[lo, hi)`` (the rows past ``lo`` are then unused); the whole pages of the unused rows go back
        to the kernel (they read as zero again), unless those are a small tail (at most 1/KEEP_SHARE of the rows
        before them): then the rows are written with zeros and kept, since the table soon grows into them again (a
        budget pass removes a few percent of the rows that the next rounds' new rows take back). Returned, every one
        of them would be a page fault and a page the kernel zeroes on the next touch (the same zeros, plus the
        fault), and each return a flush of the pages' translations on every core the server's threads run on. The
        tail counted is every row kept so (``top``: the most rows used since pages last went back), not this call's
        alone: kept call after call, a table's memory would stay that of its largest size ever (under a budget with
        a disk tier, the rows that fit before its disk index grew: 35 MiB above the budget at 20M rows)."""
        top = max(self.top, min(hi, self.capacity))
        start, end = lo * self.row_bytes, min(hi, self.capacity) * self.row_bytes
        if keep and top * self.row_bytes - start <= start // KEEP_SHARE:
            if end > start:
                self._rows[lo:min(hi, self.capacity)].view(np.uint8)[:] = 0
            self.top = top
            return
        end = top * self.row_bytes          # (rows [hi, top) are zero already: their pages go back too)
        self.top = lo
        first, last = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE, end // mmap.PAGESIZE * mmap.PAGESIZE
        if last <= first:
            self._map[start:end] = bytes(end - start)
            return
        self._map[start:first] = bytes(first - start)
        self._map[last:end] = bytes(end - last)
        try:
            self._map.madvise(mmap.MADV_DONTNEED, first, last - first)
        except (AttributeError, OSError):      # no madvise here: write the zeros instead
            for at in range(first, last, 1 << 24):
                self._map[at:min(last, at + (1 << 24))] = bytes(min(last, at + (1 << 24)) - at)

    def release(self, used: int) -> None:
        """Give back the pages of the zeroed rows kept past the first ``used`` (see :meth:`clear`), whatever their
        number: for a phase that adds no rows (a checkpoint's reads), where the table will not grow into them."""
        if self.top > used:
            self.clear(used, used, keep=False)

    def nbytes(self, used: int) -> int:
        """Bytes of memory the first ``used`` rows occupy (whole pages)."""
        return -(-used * self.row_bytes // mmap.PAGESIZE) * mmap.PAGESIZE

    def _new_map(self, capacity: int) -> mmap.mmap:
        return mmap.mmap(-1, capacity * self.row_bytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)

    def _bind(self) -> None:
        self.capacity = len(self._map) // self.row_bytes
        self._rows = np.frombuffer(self._map, self._void, self.capacity)
        self.array = self._rows.view(self.dtype).reshape((self.capacity,) + self.row_shape)


def release_free_memory() -> None:
    """Return the free pages of every malloc arena to the kernel (glibc's ``malloc_trim(0)``; elsewhere nothing).
    glibc keeps the heap freed temporaries leave behind (holes under live blocks; only a free top above
    TRIM_THRESHOLD goes back by itself): after a round's demotions and the pieces of a checkpoint, 15-40 MiB the
    server no longer uses, which the next large reply (a mapping of its own) comes on top of. Called where a phase
    of large temporaries begins (a checkpoint's LAZY_ROWS, a snapshot) and after a background job of the disk
    index, not per request: a trim takes about a millisecond (and the arenas' locks), and every page it returns is a
    page fault when the heap grows into it again."""
    if not _TRIM:
        try:
            import ctypes
            _TRIM.append(ctypes.CDLL(None).malloc_trim)
        except (OSError, AttributeError):
            _TRIM.append(None)
    if _TRIM[0] is not None:
        _TRIM[0](0)


_TRIM: list = []
