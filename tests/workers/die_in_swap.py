"""A kvstore_lazy server that dies (SIGKILL, by its own hand) inside a base snapshot's directory swap: right after
the rename that moves its base ``<snapshot dir>/rank<r>`` aside, in the Nth swap that does so
(``CRASH_SWAP``, default 2: the job's 3rd base, the first having nothing to move). Only one server of the job dies,
once: the one that first creates ``CRASH_MARKER`` (exclusively); a restarted server finds it and runs normally.

2a90f8e's swap renamed ``rank<r>`` to ``.rank<r>.old`` and then the temp directory to ``rank<r>``: dying between the
two left no base, and every restart refused ("no journaled snapshot"). Run as the launcher's server command."""
from __future__ import annotations

import os
import signal
from pathlib import Path

SNAP = Path(os.environ["KVSTORE_LAZY_SNAPSHOT_DIR"]).resolve()
AT = int(os.environ.get("CRASH_SWAP", "2"))
MARKER = os.environ["CRASH_MARKER"]
moves = 0


def _moves_the_base(src) -> bool:
    path = Path(os.fspath(src))
    return path.name.startswith("rank") and path.name[4:].isdigit() and path.parent.resolve() == SNAP


def _die_after(real):
    def rename(src, dst, *args, **kwargs):
        global moves
        real(src, dst, *args, **kwargs)
        if _moves_the_base(src):
            moves += 1
            if moves == AT:
                try:
                    os.close(os.open(MARKER, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
                except FileExistsError:
                    return
                os.kill(os.getpid(), signal.SIGKILL)
    return rename


os.rename, os.replace = _die_after(os.rename), _die_after(os.replace)

from kvstore_lazy.cli import server_main  # noqa: E402

raise SystemExit(server_main())
