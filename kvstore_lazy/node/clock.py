"""The server's two clocks, as one object a test can replace.

Owns: ``Clock`` (what the node asks of time: ``monotonic`` for timers, deadlines and durations, ``time`` for the
wall clock of journaled clock ticks and restart timestamps, ``sleep`` for the few waits that are not a receive),
the real one (``SystemClock``) and ``FakeClock``, which moves only when told (``advance``), so a test can drive
heartbeats, resends and a silent scheduler's timeout in no time at all.
Does not own: the timers (``timers``) or what waits on the transport (a van's ``recv`` timeout).
"""
from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    def monotonic(self) -> float: ...

    def time(self) -> float: ...

    def sleep(self, seconds: float) -> None: ...


class SystemClock:
    """The process's clocks."""

    def monotonic(self) -> float:
        return time.monotonic()

    def time(self) -> float:
        return time.time()

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)


class FakeClock:
    """A clock that stands still until :meth:`advance` (or :meth:`sleep`) moves it; the wall clock moves with it."""

    def __init__(self, start: float = 1000.0, wall: float = 1_700_000_000.0) -> None:
        self.now = start
        self.wall_offset = wall - start

    def monotonic(self) -> float:
        return self.now

    def time(self) -> float:
        return self.now + self.wall_offset

    def sleep(self, seconds: float) -> None:
        self.advance(seconds)

    def advance(self, seconds: float) -> None:
        if seconds > 0:
            self.now += seconds
