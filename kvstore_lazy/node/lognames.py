"""The ``%(node)s`` field of the server's log lines ("server ?" until the rank is known, then "server 1").

Owns: that one process-wide label and the filter that puts it on every record (``cli`` installs the filter).
"""
from __future__ import annotations

import logging

_node_label = "server ?"


class NodeLogFilter(logging.Filter):
    """Adds ``%(node)s`` ("server 1" once the rank is known) to log records."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.node = _node_label
        return True


def set_label(rank: int) -> None:
    global _node_label
    _node_label = f"server {rank}"
