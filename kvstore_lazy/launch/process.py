"""One started process of a job, and what the launcher says about how it ended.

Owns: :class:`Node` (a node's role, start-order rank, process, placement and what the launcher learnt of it),
the wording of an exit status, ending a process group by its id, and :class:`LineSink` (a Job output that wants
whole lines). Every process the launcher starts is in its own process group (and, where ``setpriv`` exists, dies
with the launcher); it is ended by PID when the job ends.
Does not own: starting processes or deciding when to end them (``job``, ``supervise``).
"""
from __future__ import annotations

import os
import signal
import subprocess
import threading
from dataclasses import dataclass

from kvstore_lazy.launch.placement import Placement


@dataclass
class Node:
    role: str
    rank: int
    popen: subprocess.Popen
    placement: Placement
    argv: list[str]
    env: dict
    thread: threading.Thread | None = None
    started: float = 0.0
    restarts: int = 0
    ended: float | None = None
    incarnation: int = 0
    ps_rank: int | None = None    # the rank ps-lite's scheduler gives it, once known (see kvstore_lazy.launch.ranks)

    @property
    def name(self) -> str:
        """Start order: "worker 1" is the second worker started (DMLC_TASK_ID=1)."""
        return self.role if self.role == "scheduler" else f"{self.role} {self.rank}"

    @property
    def label(self) -> str:
        """The prefix of its output lines: the name, and ps-lite's rank once known."""
        return self.name if self.ps_rank is None else f"{self.name}, rank {self.ps_rank}"

    @property
    def pid(self) -> int:
        return self.popen.pid


def describe_status(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"


class LineSink:
    """Base for a Job's ``out`` that wants whole lines: subclasses implement :meth:`on_line`. Thread-safe (every
    node's reader thread writes to it); text without a newline waits for the rest of its line, or for close()."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.buffer = ""

    def write(self, text: str) -> None:
        with self.lock:
            self.buffer += text
            while "\n" in self.buffer:
                line, self.buffer = self.buffer.split("\n", 1)
                self.on_line(line)

    def flush(self) -> None:
        pass

    def close(self) -> None:
        with self.lock:
            if self.buffer:
                self.on_line(self.buffer)
                self.buffer = ""

    def on_line(self, line: str) -> None:
        raise NotImplementedError



def killpg(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass
