"""A server node's life as states and allowed transitions, kept as data (as h11's ``_state.py`` keeps its own).

Owns: the names of the phases a server goes through and which phase may follow which. Everything else reads
``Life.state``; only ``session`` moves it.
Does not own: what happens in a phase (``session``: registration, barriers, rejoin, stop) or the loop (``node``).

A fresh server:   NEW -> REGISTERING -> STARTUP_BARRIER -> SERVING -> FINAL_BARRIER -> STOPPED
A recovered node (ps-lite's is_recovery; no startup barrier): REGISTERING -> SERVING
A rejoining server (KVSTORE_LAZY_RECOVERY=1: no registration): NEW -> REJOINING -> SERVING
Under PS_RESEND the final barrier may be released before this server asked (session.stop): SERVING -> STOPPED.
Any phase but STOPPED may end in FAILED (an exit status other than 0).
"""
from __future__ import annotations

NEW = "new"
REGISTERING = "registering"          # ADD_NODE sent; waiting for the scheduler's node list
REJOINING = "rejoining"              # bound at the old address; restoring the snapshot, replaying the journal
STARTUP_BARRIER = "startup barrier"  # registered; waiting for BARRIER(7)'s release
SERVING = "serving"
FINAL_BARRIER = "final barrier"      # kStopServer answered; waiting for the last BARRIER(7)'s release
STOPPED = "stopped"
FAILED = "failed"

TRANSITIONS: dict[str, frozenset[str]] = {
    NEW: frozenset({REGISTERING, REJOINING, FAILED}),
    REGISTERING: frozenset({STARTUP_BARRIER, SERVING, FAILED}),
    REJOINING: frozenset({SERVING, FAILED}),
    STARTUP_BARRIER: frozenset({SERVING, FAILED}),
    SERVING: frozenset({FINAL_BARRIER, STOPPED, FAILED}),
    FINAL_BARRIER: frozenset({STOPPED, FAILED}),
    STOPPED: frozenset(),
    FAILED: frozenset(),
}

# phases in which this server has an id and talks to the job (heartbeats, replies)
REGISTERED = frozenset({STARTUP_BARRIER, SERVING, FINAL_BARRIER, REJOINING})


class StateError(AssertionError):
    """A transition the table does not allow: a bug of this server, never a peer's doing."""


class Life:
    """The current phase and the phases it went through (for tests and the log)."""

    def __init__(self) -> None:
        self.state = NEW
        self.history = [NEW]

    def to(self, state: str) -> None:
        if state not in TRANSITIONS[self.state]:
            raise StateError(f"a server cannot go from {self.state!r} to {state!r}")
        self.state = state
        self.history.append(state)

    def fail(self) -> None:
        """Ending with an error: FAILED from any phase but STOPPED (already over)."""
        if FAILED in TRANSITIONS[self.state]:
            self.to(FAILED)
