"""Process measurements for demos and benchmarks: resident memory of a pid, a background sampler of the peak
memory of a set of pids, and the bytes a pid has sent over TCP.

Owns nothing of the server. Linux only (``/proc/<pid>/status`` and iproute2's ``ss``); no mxnet import, so a demo
driver can measure its jobs without loading MXNet.
"""
from __future__ import annotations

import os
import re
import subprocess
import threading

__all__ = ["proc_status", "rss", "peak_rss", "RssSampler", "tcp_bytes_sent"]

_KB = 1024


def proc_status(pid: int) -> dict[str, int] | None:
    """The ``kB`` fields of ``/proc/<pid>/status`` (VmRSS, VmHWM, ...) in bytes; None once the process is gone.

    A zombie (exited, not yet reaped) still has the file but no Vm* fields: the dict is then empty."""
    try:
        with open(f"/proc/{pid}/status", "rb") as fh:
            text = fh.read().decode(errors="replace")
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    fields = {}
    for line in text.splitlines():
        name, _, value = line.partition(":")
        parts = value.split()
        if len(parts) == 2 and parts[1] == "kB" and parts[0].isdigit():
            fields[name] = int(parts[0]) * _KB
    return fields


def rss(pid: int) -> int | None:
    """Current resident set size of `pid` in bytes (VmRSS), or None if unknown (gone, or a zombie)."""
    status = proc_status(pid)
    return None if not status else status.get("VmRSS")


def peak_rss(pid: int) -> int | None:
    """Peak resident set size of `pid` in bytes so far (VmHWM, kept by the kernel), or None if unknown."""
    status = proc_status(pid)
    return None if not status else status.get("VmHWM")


class RssSampler:
    """Samples the memory of `pids` every `interval` seconds in a daemon thread, until :meth:`stop`.

    Per pid it keeps the first and last RSS seen and the peak: the larger of the kernel's VmHWM (exact, but only
    readable while the process lives) and the largest VmRSS sampled. ``max_total`` is the largest sum of the
    pids' RSS at one sampling instant (a lower bound of the true simultaneous peak).
    Use as a context manager, or call :meth:`start` / :meth:`stop`.
    """

    def __init__(self, pids, interval: float = 0.1) -> None:
        self.pids = [int(p) for p in pids]
        self.interval = interval
        self.first: dict[int, int] = {}
        self.last: dict[int, int] = {}
        self.peak: dict[int, int] = {}
        self.max_total = 0
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)
        self._lock = threading.Lock()

    def start(self) -> "RssSampler":
        self.sample()
        self._thread.start()
        return self

    def stop(self) -> "RssSampler":
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        self.sample()
        return self

    def __enter__(self) -> "RssSampler":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    def sample(self) -> None:
        total = 0
        with self._lock:
            for pid in self.pids:
                status = proc_status(pid)
                if not status or "VmRSS" not in status:
                    continue
                now = status["VmRSS"]
                total += now
                self.first.setdefault(pid, now)
                self.last[pid] = now
                self.peak[pid] = max(self.peak.get(pid, 0), now, status.get("VmHWM", 0))
            self.max_total = max(self.max_total, total)
            self.samples += 1

    def peak_sum(self) -> int:
        """Sum over the pids of each one's peak RSS (bytes)."""
        with self._lock:
            return sum(self.peak.values())

    def first_sum(self) -> int:
        """Sum over the pids of the first RSS sampled (bytes): the baseline, e.g. right after start-up."""
        with self._lock:
            return sum(self.first.values())


def tcp_bytes_sent(pid: int | None = None) -> int:
    """Bytes `pid` (default: this process) has sent over its currently open TCP sockets, from the kernel's
    per-socket counters (iproute2's ``ss -tinpH``).

    ``/proc/<pid>/io`` (wchar) does not count ``send()`` on sockets, so this is how a process measures what a call
    put on the wire: read it before and after. Sockets closed in between drop out of the sum.
    """
    pid = os.getpid() if pid is None else int(pid)
    out = subprocess.run(["ss", "-tinpH"], capture_output=True, text=True, timeout=30, check=True).stdout
    total, mine = 0, False
    tag = f"pid={pid},"
    for line in out.splitlines():
        if not line.startswith(("\t", " ")):
            mine = tag in line
        elif mine:
            m = re.search(r"\bbytes_sent:(\d+)", line)
            total += int(m.group(1)) if m else 0
    return total


if __name__ == "__main__":  # python -m kvstore_lazy.node.procstats PID...: print RSS, peak RSS and TCP bytes sent
    import sys

    for arg in sys.argv[1:] or [str(os.getpid())]:
        p = int(arg)
        print(f"pid {p}: rss {rss(p)} peak {peak_rss(p)} tcp_bytes_sent {tcp_bytes_sent(p)}")
