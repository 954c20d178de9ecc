"""The process's named thread pools (the disk tier's read pool, its writer thread, the demotion's helper).

Owns: :func:`executor`, one ``ThreadPoolExecutor`` per name, made on first use and kept for the process (its
size is the one asked for first). Does not own: what runs on them.
"""
from __future__ import annotations

from concurrent import futures

_EXECUTORS: dict[str, futures.ThreadPoolExecutor] = {}


def executor(name: str, threads: int = 1) -> futures.ThreadPoolExecutor:
    """The process's thread pool ``name`` (thread names ``kvstore-lazy-<name>``), made on first use and kept."""
    if name not in _EXECUTORS:
        _EXECUTORS[name] = futures.ThreadPoolExecutor(threads, thread_name_prefix=f"kvstore-lazy-{name}")
    return _EXECUTORS[name]
