"""Whether the scheduler is still there: a server without its scheduler can only end (status 3, ``SchedulerLost``).

Owns: the rules that declare the scheduler lost, in every phase: its connection closed and stayed closed for the
grace (a process that died), or KVSTORE_LAZY_SCHEDULER_TIMEOUT passed since a heartbeat it did not answer (a host
or a process that hangs), or this server dropped it (it stopped reading). The heartbeats themselves are sent by
``session``; any admitted message from the scheduler counts as an answer (``guard``).
Does not own: the socket monitor that sees the connection (``transport``: ``Van.watch``/``link``).
"""
from __future__ import annotations

from kvstore_lazy.node.errors import SchedulerLost
from kvstore_lazy.transport.van import Van

SCHEDULER_GRACE = 1.0           # s a closed connection to the scheduler may stay down before this server exits


class SchedulerWatch:
    """The scheduler (node `scheduler_id`, at `where`) as this server sees it through `van`."""

    def __init__(self, van: Van, scheduler_id: int, where: str, timeout: float) -> None:
        self.van = van
        self.scheduler_id = scheduler_id
        self.where = where
        self.timeout = timeout          # KVSTORE_LAZY_SCHEDULER_TIMEOUT (0: heartbeats are not awaited)
        self.grace = SCHEDULER_GRACE     # how long the scheduler's link may stay down (see session.rejoin)
        self.asked: float | None = None  # monotonic time of the first heartbeat the scheduler has not answered

    def heartbeat_sent(self, now: float) -> None:
        if self.asked is None:
            self.asked = now

    def heard(self) -> None:
        """A message from the scheduler was admitted: it answers."""
        self.asked = None

    def check(self, now: float) -> None:
        """Raise SchedulerLost once the scheduler is gone: its connection closed and stayed closed for
        the grace (SCHEDULER_GRACE: a process that died), or KVSTORE_LAZY_SCHEDULER_TIMEOUT passed since a heartbeat
        it did not answer (a host or a process that hangs). Messages already received are read first (they may be
        the scheduler's last ones, e.g. the final barrier's release), unless that takes 5x longer still."""
        where = f"the scheduler at {self.where}"
        if self.scheduler_id in self.van.dropped:
            raise SchedulerLost(f"{where} stopped reading: {self.van.dropped[self.scheduler_id]}")
        grace = self.grace
        link = self.van.link(self.scheduler_id)
        if link is not None and link.ever_up and not link.up:
            down = now - link.changed
            if down > grace and (down > 5 * grace or not self.van.incoming()):
                raise SchedulerLost(f"lost {where}: its connection closed {down:.1f}s ago and did not come back")
        timeout, asked = self.timeout, self.asked
        if timeout > 0:
            timeout = max(timeout, grace)
        if timeout > 0 and asked is not None and now - asked > timeout and (
                now - asked > 5 * timeout or not self.van.incoming()):
            raise SchedulerLost(f"lost {where}: no answer to heartbeats for {now - asked:.1f}s "
                                f"(KVSTORE_LAZY_SCHEDULER_TIMEOUT={timeout:g})")
