"""Shared bits of the worker scripts the integration tests run (each one a stock mxnet==1.9.1 worker)."""
import os

import numpy as np


def rank_file(out: str, rank: int) -> str:
    return f"{out}.rank{rank}.npz"


def save(out: str, rank: int, results: dict) -> None:
    np.savez(rank_file(out, rank), **{k: np.asarray(v) for k, v in results.items()})


def load(out: str, rank: int) -> dict:
    with np.load(rank_file(out, rank), allow_pickle=False) as data:
        return {k: data[k] for k in data.files}


def tcp_bytes_sent(pid=None) -> int:
    """Bytes this process has sent over its open TCP sockets (kernel counters via iproute2's `ss -tinp`).

    /proc/<pid>/io's wchar does not count send() on sockets, so this is how a worker measures what a call put on
    the wire.
    """
    import re
    import subprocess

    pid = os.getpid() if pid is None else pid
    out = subprocess.run(["ss", "-tinpH"], capture_output=True, text=True, timeout=30, check=True).stdout
    total, mine = 0, False
    for line in out.splitlines():
        if not line.startswith(("\t", " ")):
            mine = f"pid={pid}," in line
        elif mine:
            m = re.search(r"bytes_sent:(\d+)", line)
            total += int(m.group(1)) if m else 0
    return total
