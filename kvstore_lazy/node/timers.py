"""The node's one table of timers: (due, period, action) entries, run in the order they were added.

Owns: when each periodic job of the server runs (heartbeats, resends, the stats line, snapshots, clock ticks, the
membership record's refresh, the metrics, the checks run on every pass) and how long the loop may wait for a
message before the next one is due.
Does not own: what the jobs do (each action belongs to its room) or the clock (passed in as ``now``).

Two kinds of entries, as the loop always had them:
- a *waking* entry bounds the receive's wait (``poll_timeout``): it runs close to its due time;
- a *passive* one (``wakes=False``) runs at the first pass of the loop after its due time, and never makes the loop
  wake up for it (the record's refresh, clock ticks, checks on every pass: period 0).
An action that returns ``False`` did not run (a condition it checks was not met): it stays due for the next pass.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

INFINITY = float("inf")
MAX_WAIT = 1.0      # s: the loop never waits longer than this for a message (its checks run at least this often)


@dataclass
class Timer:
    name: str
    due: float
    period: float
    action: Callable[[float], bool | None]
    wakes: bool = True


class Timers:
    """Entries by name; :meth:`run` runs every due one in order."""

    def __init__(self) -> None:
        self.entries: dict[str, Timer] = {}

    def every(self, name: str, period: float, action: Callable[[float], bool | None], first: float,
              wakes: bool = True) -> Timer:
        """Run `action(now)` at `first`, then `period` seconds after each run (period 0: on every pass)."""
        timer = self.entries[name] = Timer(name, first, period, action, wakes)
        return timer

    def cancel(self, name: str) -> None:
        self.entries.pop(name, None)

    def due(self, name: str) -> float:
        timer = self.entries.get(name)
        return timer.due if timer is not None else INFINITY

    def run(self, now: float) -> None:
        for timer in list(self.entries.values()):
            if now >= timer.due and timer.action(now) is not False:
                timer.due = now + timer.period

    def poll_timeout(self, now: float) -> int:
        """Milliseconds the loop may wait for a message before a waking entry is due (0..1000)."""
        nearest = min((t.due for t in self.entries.values() if t.wakes), default=INFINITY)
        return max(0, int(min(MAX_WAIT, nearest - now) * 1000))
