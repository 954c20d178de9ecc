"""Which ps-lite rank each node of a job got: the launcher names nodes by start order, ps-lite numbers them by address.

Names and ranks. The launcher names nodes by start order ("worker 1": the second worker started, DMLC_TASK_ID=1),
but ps-lite's scheduler numbers them by address: it sorts the nodes by hostname (descending, bytewise) and port
(ascending) and gives ranks in that order, servers and workers separately (van.cc, ProcessAddNodeCommandAtScheduler;
the comparator ``(a.hostname.compare(b.hostname) | (a.port < b.port)) > 0``). So once a node's rank is known its
prefix carries both, "[worker 1, rank 0] ...", as do the launcher's lines about it. A kvstore_lazy server's rank
comes from its "registered as server rank N" line; on this machine and in network namespaces every node's rank is
also computed from the listening port of each node's process (/proc) once all nodes of a role have bound theirs.
Over ssh a stock server's or a worker's rank stays unknown (its prefix is then its start-order name only).

Owns: ps-lite's rank order, reading a process tree's listening ports from /proc, and :class:`RankDiscovery`, which
records each node's ``ps_rank`` and says when it differs from the start order.
Does not own: the nodes themselves (``process``, ``job``).
"""
from __future__ import annotations

import os
import re
import threading
import time
from typing import Callable

from kvstore_lazy.launch.placement import SshPlacement
from kvstore_lazy.launch.process import Node

REGISTERED = re.compile(r"registered as server rank (\d+)")   # kvstore_lazy.node.runtime's line once it has its rank
SERVER_PREFIX = r"\[server (\d+)(?:, rank \d+)?\]"             # a server's output prefix; group 1: its start index


def pslite_rank_order(addresses: list[tuple[str, int]]) -> list[int]:
    """Ranks ps-lite's scheduler gives nodes of one role at these (hostname, port): it sorts by
    ``(a.hostname.compare(b.hostname) | (a.port < b.port)) > 0``, i.e. hostname descending (bytewise), then port
    ascending (a negative compare() stays negative when or-ed with the bool)."""
    order = sorted(range(len(addresses)), key=lambda i: addresses[i][1])
    order.sort(key=lambda i: addresses[i][0].encode(), reverse=True)   # stable: ports stay ascending
    ranks = [0] * len(addresses)
    for rank, i in enumerate(order):
        ranks[i] = rank
    return ranks


def listening_ports(pid: int) -> set[int] | None:
    """TCP ports in LISTEN state held by process `pid` or its descendants (read from /proc, in the process's own
    network namespace); None if the process is gone or /proc cannot be read."""
    pids, ports = [pid], set()
    try:
        while pids:
            current = pids.pop()
            inodes = set()
            for fd in os.listdir(f"/proc/{current}/fd"):
                try:
                    link = os.readlink(f"/proc/{current}/fd/{fd}")
                except OSError:
                    continue
                if link.startswith("socket:["):
                    inodes.add(link[8:-1])
            for table in ("tcp", "tcp6"):
                with open(f"/proc/{current}/net/{table}") as fh:
                    for line in fh.readlines()[1:]:
                        fields = line.split()
                        if len(fields) > 9 and fields[3] == "0A" and fields[9] in inodes:
                            ports.add(int(fields[1].rsplit(":", 1)[1], 16))
            for task in os.listdir(f"/proc/{current}/task"):
                with open(f"/proc/{current}/task/{task}/children") as fh:
                    pids += [int(child) for child in fh.read().split()]
    except (OSError, ValueError):
        return None
    return ports



class RankDiscovery:
    """The ps-lite ranks of `nodes` (a Job's current processes, the list itself: it is updated in place), learnt
    from a server's log or from the ports the nodes listen on. Called from every node's output thread and from the
    supervising loop; `lock` is the Job's output lock (a node's label changes between two of its lines)."""

    def __init__(self, nodes: list[Node], lock: threading.Lock, say: Callable[[str], None]) -> None:
        self.nodes = nodes
        self.lock = lock
        self.say = say
        self._scan_lock = threading.Lock()
        self._scan_at = 0.0                 # when learn() last looked at the nodes' ports
        self.unknowable: set[str] = set()   # roles whose ranks cannot be told from ports

    def from_line(self, node: Node, line: str) -> None:
        """What one output line of `node` says about ranks."""
        if node.role == "server" and node.ps_rank is None and (found := REGISTERED.search(line)):
            self.set_ranks([node], [int(found.group(1))], "its log")
        elif node.role in ("server", "worker") and node.ps_rank is None:
            self.learn()      # a node that prints after registering: every node of its role has a port

    def set_ranks(self, nodes: list[Node], ranks: list[int], source: str) -> None:
        """Record ps-lite ranks learnt from `source`; say so for those that differ from the start order."""
        with self.lock:
            fresh = [(n, r) for n, r in zip(nodes, ranks) if n.ps_rank is None]
            for node, rank in fresh:
                node.ps_rank = rank
        moved = [f"{n.name} is rank {r}" for n, r in fresh if r != n.rank]
        if moved:
            self.say(f"ps-lite numbers nodes by address, not start order ({source}): " + ", ".join(moved))

    def learn(self, every: float = 0.0) -> None:
        """Ranks from the nodes' listening ports, once every node of a role on this machine has bound its own (at
        most one look every `every` seconds)."""
        with self._scan_lock:
            now = time.monotonic()
            if now >= self._scan_at + every:
                self._scan_at = now
                self._scan_ports()

    def _scan_ports(self) -> None:
        for role in ("server", "worker"):
            nodes = [n for n in self.nodes if n.role == role]
            if role in self.unknowable or all(n.ps_rank is not None for n in nodes) or \
                    any(isinstance(n.placement, SshPlacement) or n.ended is not None for n in nodes):
                continue
            addresses = []
            for node in nodes:
                ports = listening_ports(node.pid)
                if ports is not None and len(ports) > 1:
                    self.unknowable.add(role)
                    self.say(f"{node.name} listens on {len(ports)} ports {sorted(ports)}: {role} ranks are not "
                             f"inferred from ports")
                if ports is None or len(ports) != 1:
                    break        # not bound yet, or ambiguous
                addresses.append((node.env.get("DMLC_NODE_HOST", node.placement.host), ports.pop()))
            else:
                self.set_ranks(nodes, pslite_rank_order(addresses), "ports")
