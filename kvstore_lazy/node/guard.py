"""Trust wiring: what ``trust.Admission`` decides about each received message, fed with this host's facts and the
job's roster, turned into log lines and startup errors (issue 11).

Owns: telling ``trust.Admission`` this machine's and this server's own addresses, the scheduler's expected address
and, once registered, the roster; one (rate-limited) log line per kind of refused message; the startup error for a
scheduler that cannot be trusted (or whose node list came from another address than DMLC_PS_ROOT_URI).
Does not own: the rules themselves (``trust``), the sockets, or the roster's contents (``membership``).
"""
from __future__ import annotations

import fcntl
import logging
import socket
import struct
from collections.abc import Callable

from kvstore_lazy.node import membership, trust
from kvstore_lazy.node.errors import StartupError
from kvstore_lazy.protocol.message import Message
from kvstore_lazy.protocol.pbmeta import ADD_NODE, EMPTY

log = logging.getLogger("kvstore_lazy")


def interface_ip(name: str) -> str | None:
    SIOCGIFADDR = 0x8915
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), SIOCGIFADDR, struct.pack("256s", name[:15].encode()))
        except OSError:
            return None
    return socket.inet_ntoa(packed[20:24])


def resolve(host: str) -> set[str]:
    """IPv4 addresses of a host name or literal (raises OSError if it does not resolve)."""
    return {str(info[4][0]) for info in socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM)}


def local_addresses() -> frozenset:
    """This machine's IPv4 addresses (one per interface), for trust.Admission's same-host rule."""
    found = set()
    for _, name in socket.if_nameindex():
        ip = trust.ip_of(interface_ip(name))
        if ip is not None:
            found.add(ip)
    return frozenset(found)


class Guard:
    """One server's admission of received messages. `resolve` and `local` are the host's name resolution and
    addresses (the functions above; a test passes its own); `heard()` is told of every admitted message from the
    scheduler (it answers: ``liveness``); `clock` is the monotonic clock of the refusals' rate limit."""

    def __init__(self, cfg, heard: Callable[[], None], clock: Callable[[], float],
                 resolve: Callable[[str], set[str]] = resolve,
                 local: Callable[[], frozenset] = local_addresses) -> None:
        self.cfg = cfg
        self.admission = trust.Admission(allow=cfg.allow, check_address=cfg.check_address, resolve=resolve)
        self._resolve = resolve
        self._local = local
        self.heard = heard
        self.roster: membership.Roster | None = None
        self._refusals = trust.LogLimiter(clock=clock)

    def expect_scheduler(self) -> None:
        cfg = self.cfg
        self.admission.local = self._local()
        try:
            own = self._resolve(cfg.host)
        except OSError:
            own = set()
        self.admission.own = frozenset(ip for ip in map(trust.ip_of, own) if ip is not None)
        reason = self.admission.expect_scheduler(cfg.root_uri)
        if reason is not None:
            raise StartupError(f"the scheduler at {cfg.root_uri}:{cfg.root_port} cannot be trusted: {reason}")

    def set_roster(self, roster: membership.Roster, my_id: int) -> None:
        self.roster = roster
        for node_id, reason in self.admission.set_roster(roster, my_id).items():
            if node_id == membership.SCHEDULER_ID:
                raise StartupError(f"the scheduler ({roster.nodes[node_id]}) cannot be trusted: {reason}")
            log.error("%s will not be served: %s", roster.nodes[node_id], reason)

    def refused(self, node_id: int) -> bool:
        return node_id in self.admission.refused_nodes

    def update_node(self, node_id: int, host: str) -> str | None:
        return self.admission.update_node(node_id, host)

    def admit(self, msg: Message, peer: str | None, dropped: str | None) -> bool:
        """trust.Admission's verdict on a received message; a refused one is logged (rate-limited) and dropped.
        `dropped` is why the van dropped its sender (None: it did not)."""
        if dropped:
            reason: str | None = f"this server dropped it ({dropped})"
        else:
            reason = self.admission.refusal(msg.sender, peer, msg.meta)
        if reason is None:
            if msg.sender == membership.SCHEDULER_ID:
                self.heard()
            if self.cfg.verbose >= 2:
                log.info("recv from %s: %s (%d data frames)", membership.node_name(msg.sender), msg.meta,
                         len(msg.data))
            return True
        if self.roster is None and msg.sender == membership.SCHEDULER_ID and msg.meta.control.cmd == ADD_NODE \
                and reason.startswith("it comes from"):
            # The scheduler's node list from another address than DMLC_PS_ROOT_URI: a Service (ClusterIP) or NAT in
            # between, most likely. Only the first connection as ps1 gets through ZeroMQ, so waiting cannot help.
            raise StartupError(f"the scheduler's node list came from {peer}, but DMLC_PS_ROOT_URI="
                               f"{self.cfg.root_uri} is not that address (behind a Service address or NAT? then "
                               f"set KVSTORE_LAZY_CHECK_ADDRESS=0, or point DMLC_PS_ROOT_URI at the scheduler itself)")
        suffix = self._refusals.admit((msg.sender, peer, reason))
        if suffix is not None:
            who = membership.node_name(msg.sender) if msg.sender == EMPTY or (
                self.roster is not None and msg.sender in self.roster.nodes) else f"node {msg.sender}"
            log.error("ignoring %s from %s%s: %s%s", trust.what(msg.meta), who, f" at {peer}" if peer else "",
                      reason, suffix)
        return False
