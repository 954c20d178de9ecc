"""The per-key log of the float32 scalars each update of a key computed with: what a row that missed steps needs.

Owns: :class:`StepLog`, the scalars of every update (step) of one key, run-length encoded (a run is a stretch of
consecutive steps whose scalars are bit-identical), and its round trip through plain arrays (for snapshots).
Does not own: which scalars an optimizer's zero-gradient step needs (each rule's ``scalars``), rows or their last
steps (the server's row table), when a row is brought up to date (``replay.py``, ``closed.py``).

Steps are the key's update counts (``Optimizer.update_count(key)`` after the update): step k holds the scalars of
the update that made the count k. A row whose "last step" is s holds the values stock holds after step s; bringing
it to step t applies steps s+1 .. t. Why run-length: with a constant lr (or a factor schedule) every step of a key
has the same scalars, so the log is a handful of runs however long the job; a cosine or poly schedule (and Adam's
bias correction, until it rounds to 1 in float32) changes them every step: then a run is one step, 4 bytes per
scalar per step (Adam: 9 scalars, 36 bytes a step, 360 KB per 10k steps per key).
"""
from __future__ import annotations

from collections.abc import Iterator

import numpy as np

_f32 = np.float32


class StepLog:
    """The scalars of steps ``first .. last`` of one key; ``width`` float32 scalars a step."""

    __slots__ = ('width', '_starts', '_values', 'last', '_table')

    def __init__(self, width: int) -> None:
        self.width = width
        self._starts: list[int] = []          # first step of each run
        self._values: list[np.ndarray] = []   # its scalars (float32, width)
        self.last = -1                        # the last step recorded (-1: none)
        self._table: tuple[np.ndarray, np.ndarray, int] | None = None   # the runs as arrays (see table)

    @property
    def first(self) -> int:
        """The first step recorded (-1 when empty)."""
        return self._starts[0] if self._starts else -1

    def __len__(self) -> int:
        return 0 if not self._starts else self.last - self.first + 1

    def runs(self) -> int:
        return len(self._starts)

    def record(self, step: int, scalars: np.ndarray) -> None:
        """The scalars of `step`, the step after the last recorded one (the first record may start anywhere)."""
        values = np.asarray(scalars, dtype=_f32).reshape(-1)
        if values.size != self.width:
            raise ValueError(f'a step has {self.width} scalars, not {values.size}')
        if self._starts and step != self.last + 1:
            raise ValueError(f'step {step} does not follow step {self.last}')
        if self._values and self._values[-1].tobytes() == values.tobytes():
            self.last = step
            return
        self._starts.append(step)
        self._values.append(values.copy())
        self.last = step

    def table(self) -> tuple[np.ndarray, np.ndarray]:
        """``(starts, values)``: the first step of each run (int64) and its scalars (float32, runs x width), as
        views of arrays that grow by doubling and are filled as runs are added (asking after every record costs
        O(1) a new run, not a copy of the log)."""
        n = len(self._starts)
        if self._table is None:
            self._table = (np.zeros(16, np.int64), np.zeros((16, self.width), _f32), 0)
        starts, values, filled = self._table
        if n > len(starts):
            capacity = max(2 * len(starts), n)
            grown_s, grown_v = np.zeros(capacity, np.int64), np.zeros((capacity, self.width), _f32)
            grown_s[:filled], grown_v[:filled] = starts[:filled], values[:filled]
            starts, values = grown_s, grown_v
        if n > filled:
            starts[filled:n] = self._starts[filled:n]
            values[filled:n] = np.stack(self._values[filled:n])
        self._table = (starts, values, n)
        return starts[:n], values[:n]

    def covers(self, after: int, upto: int) -> bool:
        """Whether steps ``after+1 .. upto`` are all recorded (trivially so when upto <= after)."""
        return upto <= after or (bool(self._starts) and self.first <= after + 1 and upto <= self.last)

    def spans(self, after: int, upto: int) -> Iterator[tuple[int, int, np.ndarray]]:
        """``(first, last, scalars)`` for the runs of steps ``after+1 .. upto``, clipped to that range, in order."""
        if upto <= after:
            return
        if not self.covers(after, upto):
            raise KeyError(f'steps {after + 1}..{upto} are not all in the log ({self.first}..{self.last})')
        i = max(int(np.searchsorted(self._starts, after + 1, side='right')) - 1, 0)
        while i < len(self._starts) and self._starts[i] <= upto:
            end = self._starts[i + 1] - 1 if i + 1 < len(self._starts) else self.last
            lo, hi = max(self._starts[i], after + 1), min(end, upto)
            if lo <= hi:
                yield lo, hi, self._values[i]
            i += 1

    def scalars_at(self, step: int) -> np.ndarray:
        """The scalars of one step."""
        for _, _, values in self.spans(step - 1, step):
            return values
        raise KeyError(step)

    # -- snapshots --
    def to_arrays(self) -> dict[str, np.ndarray]:
        """The log as arrays: ``starts`` (int64, one per run), ``values`` (float32, runs x width), ``last``."""
        values = np.stack(self._values) if self._values else np.zeros((0, self.width), _f32)
        return {'starts': np.asarray(self._starts, dtype=np.int64), 'values': values,
                'last': np.asarray([self.last], dtype=np.int64)}

    @classmethod
    def from_arrays(cls, arrays: dict[str, np.ndarray]) -> StepLog:
        values = np.asarray(arrays['values'], dtype=_f32)
        starts = [int(s) for s in np.asarray(arrays['starts'], dtype=np.int64)]
        last = int(np.asarray(arrays['last']).reshape(-1)[0])
        if values.ndim != 2 or len(starts) != len(values) or any(b <= a for a, b in zip(starts, starts[1:])) \
                or (starts and last < starts[-1]) or (not starts and last != -1):
            raise ValueError('not a step log: runs must start at increasing steps, up to the last step')
        log = cls(values.shape[1])
        log._starts, log._values, log.last = starts, [v.copy() for v in values], last
        return log
