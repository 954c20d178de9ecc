"""Who may send this server what, and from where: the check every received message passes before anything reads
it (issue 11). ``Admission`` is the check (it was called ``Gate``; ``server.resume.ResumeGate`` is another thing:
what a resumed job's kv.init pushes may change).

Owns: the network allow-list (``KVSTORE_LAZY_ALLOW``), which addresses a node of the job may send from, which
messages each role may send a server, and rate-limited logging of what is refused. Sans-IO: ``guard`` passes in
the sender id (from the identity frame), the TCP address ZeroMQ received the message from, the decoded meta, the
job's :class:`~kvstore_lazy.node.membership.Roster`, and a resolver for host names.
Does not own: what a request means (``server``) or the sockets (``transport``).

Stock ps-lite authenticates nothing: a ROUTER takes any ``ps<id>`` identity, so any peer that reaches a node's port
can speak as the scheduler or any worker. Here a message is served only if all of these hold:

1. its TCP address is inside ``KVSTORE_LAZY_ALLOW`` (if set);
2. its identity is ``ps`` + the canonical decimal of an id (``protocol.message.parse_identity``);
3. while registering: it is the scheduler's ADD_NODE reply; afterwards the id is one the scheduler announced for
   this job, and not this server's own;
4. it comes from the address the scheduler announced for that node (``KVSTORE_LAZY_CHECK_ADDRESS=0`` turns this
   off, e.g. behind NAT). A node on this machine may also reach us from this server's own address or 127.0.0.1:
   a connection between two local addresses takes the destination (or loopback) as its source;
5. the role may send it: the scheduler sends only ADD_NODE, BARRIER releases, HEARTBEAT replies and ACKs; a worker
   sends requests (KV and SimpleApp commands, kStopServer included: stock workers of rank 0 stop the servers) and
   ACKs; servers send a server nothing. Replies (request=0) arriving as requests are dropped.
"""
from __future__ import annotations

import functools
import ipaddress
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvstore_lazy.node.membership import SCHEDULER_ID, Roster
from kvstore_lazy.protocol.pbmeta import (ACK, ADD_NODE, BARRIER, EMPTY, HEARTBEAT, SCHEDULER, SERVER, TERMINATE,
                                          WORKER, Meta)

Address = ipaddress.IPv4Address | ipaddress.IPv6Address
Network = ipaddress.IPv4Network | ipaddress.IPv6Network

LOOPBACK = ipaddress.ip_address("127.0.0.1")


class TrustError(ValueError):
    """A setting of this module that cannot be used (the message names it)."""


def parse_allow(text: str) -> tuple[Network, ...]:
    """``KVSTORE_LAZY_ALLOW``: comma-separated networks or addresses (``10.0.0.0/8,192.168.1.7``); empty: no list."""
    networks = []
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        try:
            networks.append(ipaddress.ip_network(item, strict=False))
        except ValueError as exc:
            raise TrustError(f"KVSTORE_LAZY_ALLOW: {item!r} is not a network or an address ({exc})") from None
    if text.strip() and not networks:
        raise TrustError(f"KVSTORE_LAZY_ALLOW={text!r} lists no network")
    return tuple(networks)


@functools.lru_cache(maxsize=4096)   # peers send from a handful of addresses: parse each once
def ip_of(text: str | None) -> Address | None:
    if not text:
        return None
    try:
        ip = ipaddress.ip_address(text)
    except ValueError:
        return None
    mapped = getattr(ip, "ipv4_mapped", None)
    return mapped if mapped is not None else ip


def what(meta: Meta) -> str:
    """A message's kind, for log lines."""
    if meta.control.cmd:
        return f"control command {meta.control.cmd}"
    kind = "command" if meta.simple_app else "request"
    return f"a {kind} (head {meta.head})" if meta.request else f"a reply-shaped {kind} (head {meta.head})"


@dataclass
class Admission:
    """The checks above for one server. `resolve` maps a host name to its addresses (socket.getaddrinfo in
    ``guard``); `local` is this machine's own addresses, `own` the ones this server announced."""

    allow: tuple[Network, ...] = ()
    check_address: bool = True
    resolve: Callable[[str], set[str]] = lambda host: {host}
    local: frozenset[Address] = frozenset()
    own: frozenset[Address] = frozenset()
    roster: Roster | None = None
    my_id: int | None = None
    scheduler_host: str = ""
    sources: dict[int, frozenset[Address]] = field(default_factory=dict)   # node id -> addresses it may send from
    refused_nodes: dict[int, str] = field(default_factory=dict)            # announced, but never served: why
    _from: dict = field(default_factory=dict, repr=False)      # (node id, TCP address) -> _source's verdict
    _peers: dict = field(default_factory=dict, repr=False)     # TCP address -> _peer's (address, verdict)

    def allowed(self, ip: Address) -> bool:
        """Inside KVSTORE_LAZY_ALLOW (asked once per source address, see _peer, and per announced address)."""
        return not self.allow or any(ip in net for net in self.allow)

    def sources_of(self, host: str) -> tuple[frozenset[Address], str | None]:
        """(addresses a node announced at `host` may send from, or why none)."""
        try:
            ips = {ip for ip in (ip_of(a) for a in self.resolve(host)) if ip is not None}
        except OSError as exc:
            return frozenset(), f"its host {host!r} does not resolve ({exc})"
        if not ips:
            return frozenset(), f"its host {host!r} does not resolve to an IP address"
        outside = sorted(str(ip) for ip in ips if not self.allowed(ip))
        if outside:
            return frozenset(), f"its address {', '.join(outside)} is outside KVSTORE_LAZY_ALLOW"
        if any(ip.is_loopback or ip in self.local for ip in ips):   # on this machine (see the module docstring)
            ips |= self.own | {LOOPBACK}
        return frozenset(ips), None

    def expect_scheduler(self, host: str) -> str | None:
        """Before registration: the scheduler's announced host (DMLC_PS_ROOT_URI). Returns why it is unusable."""
        self.scheduler_host = host
        sources, reason = self.sources_of(host)
        self.sources = {SCHEDULER_ID: sources}
        self._from.clear()
        return reason

    def set_roster(self, roster: Roster, my_id: int) -> dict[int, str]:
        """After registration: the job's nodes. Returns the announced nodes that will not be served, and why."""
        self.roster, self.my_id = roster, my_id
        self.sources, self.refused_nodes = {}, {}
        for node_id, peer in roster.nodes.items():
            self.update_node(node_id, peer.hostname)
        return dict(self.refused_nodes)

    def update_node(self, node_id: int, host: str) -> str | None:
        sources, reason = self.sources_of(host)
        self.sources[node_id] = sources
        self._from.clear()
        if reason is None:
            self.refused_nodes.pop(node_id, None)
        else:
            self.refused_nodes[node_id] = reason
        return reason

    def refusal(self, sender: int, peer: str | None, meta: Meta) -> str | None:
        """Why a message must be dropped, or None to serve it. `peer` is its TCP address (None over ipc)."""
        ip, reason = _judged(self._peers, peer, self._peer, peer)
        if reason is not None:
            return reason
        if sender == EMPTY:
            return "it has no ps<id> identity"
        cmd = meta.control.cmd
        if self.roster is None:
            if sender != SCHEDULER_ID or cmd != ADD_NODE:
                return "this server is registering: only the scheduler's ADD_NODE reply is expected"
            return self._source(sender, ip)
        if sender == self.my_id:
            return "it claims to be this server (a server never sends to itself)"
        role = self.roster.role(sender)
        if role is None:
            return f"node {sender} is not in this job (the scheduler did not announce it)"
        if sender in self.refused_nodes:
            return self.refused_nodes[sender]
        # a node sends from a handful of addresses: each pair is judged once
        reason = _judged(self._from, (sender, peer), self._source, sender, ip)
        if reason is not None:
            return reason
        return _permission(role, meta)

    def _peer(self, peer: str | None) -> tuple[Address | None, str | None]:
        """(the IP address of TCP address `peer`, why a message from there is refused or None), judged once per
        address (``_peers``): parsing and matching an address costs more than the rest of the checks."""
        ip = ip_of(peer)
        if peer is not None and ip is None:
            return None, f"its source address {peer!r} is not an IP address"
        if ip is not None and not self.allowed(ip):
            return ip, "its address is outside KVSTORE_LAZY_ALLOW"
        return ip, None

    def _source(self, sender: int, ip: Address | None) -> str | None:
        if ip is None or not self.check_address:
            return None
        if ip not in self.sources.get(sender, ()):
            if self.roster is not None:
                announced = self.roster.nodes[sender].hostname
            else:
                announced = self.scheduler_host
            return (f"it comes from {ip}, not from {announced}, the address the scheduler announced for it "
                    f"(KVSTORE_LAZY_CHECK_ADDRESS=0 turns this check off)")
        return None


_UNJUDGED = object()
JUDGED_MAX = 4096      # verdicts an Admission keeps per table (peers send from a handful of addresses)


def _judged(table: dict, key, judge: Callable[..., Any], *args: Any) -> Any:
    """``table[key]``, made by ``judge(*args)`` the first time (a bounded table: past JUDGED_MAX it starts over)."""
    verdict = table.get(key, _UNJUDGED)
    if verdict is _UNJUDGED:
        if len(table) >= JUDGED_MAX:
            table.clear()
        verdict = table[key] = judge(*args)
    return verdict


def _permission(role: int, meta: Meta) -> str | None:
    """What each role may send a server (ps-lite: Van, KVWorker, SimpleApp)."""
    cmd = meta.control.cmd
    if cmd == ACK:
        return None
    if role == SCHEDULER:
        if cmd == ADD_NODE or cmd == HEARTBEAT or (cmd == BARRIER and not meta.request):
            return None
        if not cmd:
            return "the scheduler sends servers no requests"
        return "the scheduler sends a server only ADD_NODE, BARRIER releases, HEARTBEAT replies and ACKs"
    if role == SERVER:
        return "servers send a server nothing"
    assert role == WORKER, role
    if cmd in (ADD_NODE, BARRIER):
        return "only the scheduler sends it"
    if cmd == TERMINATE:
        return "ps-lite sends TERMINATE only to its own node"
    if cmd:
        return "workers send a server no such control command"
    if not meta.request:
        return "a reply arriving as a request (servers send workers no requests)"
    return None


@dataclass
class LogLimiter:
    """Log the first `burst` refusals of each kind, then one line per `interval` seconds saying how many more."""

    burst: int = 100
    interval: float = 10.0
    clock: Callable[[], float] = time.monotonic
    counts: dict[tuple, list] = field(default_factory=dict)   # kind -> [count, count at last line, last line time]
    max_kinds: int = 4096

    def admit(self, kind: tuple) -> str | None:
        """None to stay quiet, "" to log the line, or a suffix saying how many were not logged since."""
        entry = self.counts.get(kind)
        if entry is None:
            if len(self.counts) >= self.max_kinds:   # many kinds (varying ids): bound this table too
                kind = ("other",)
                entry = self.counts.setdefault(kind, [0, 0, -float("inf")])
            else:
                entry = self.counts[kind] = [0, 0, -float("inf")]
        entry[0] += 1
        if entry[0] <= self.burst:
            entry[1] = entry[0]
            return ""
        now = self.clock()
        if now - entry[2] < self.interval:
            return None
        skipped = entry[0] - entry[1] - 1
        entry[1], entry[2] = entry[0], now
        return f" ({skipped} more like it not logged)" if skipped else ""
