"""Shared bits of the worker scripts the integration tests run (each one a stock mxnet==1.9.1 worker)."""
import numpy as np


def rank_file(out: str, rank: int) -> str:
    return f"{out}.rank{rank}.npz"


def save(out: str, rank: int, results: dict) -> None:
    np.savez(rank_file(out, rank), **{k: np.asarray(v) for k, v in results.items()})


def load(out: str, rank: int) -> dict:
    with np.load(rank_file(out, rank), allow_pickle=False) as data:
        return {k: data[k] for k in data.files}


def tcp_bytes_sent(pid=None) -> int:
    """Bytes this process has sent over its open TCP sockets (kernel counters via iproute2's `ss -tinp`;
    /proc/<pid>/io's wchar does not count send() on sockets)."""
    from kvstore_lazy.node.procstats import tcp_bytes_sent as sent

    return sent(pid)
