"""The ways a server process ends, and the exit status of each.

Owns: the two errors that end a server (``StartupError``, ``SchedulerLost``) and the exit statuses the launcher and
the operators read. A disk tier that fails raises ``store.tier.DiskTierFailure`` (owned there) and ends with
``EXIT_DISK``.
Does not own: which code raises them (everywhere in ``node``) or the one place that maps them to a status
(``runtime.ServerNode.run``).
"""
from __future__ import annotations

EXIT_OK = 0
EXIT_STARTUP = 2          # a setting, an address, a snapshot or a node list this server cannot use
EXIT_SCHEDULER_LOST = 3   # the scheduler is gone: the job cannot go on
EXIT_DISK = 4             # a full or failing disk under the disk tier


class StartupError(RuntimeError):
    pass


class SchedulerLost(RuntimeError):
    """The scheduler is gone (its connection closed, or it stopped answering heartbeats): the job cannot go on."""
