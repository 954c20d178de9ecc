"""An in-process network of vans, for tests: several ``MemoryVan`` exchange frames without a socket or a thread.

Owns: ``MemoryNetwork`` (who is bound where, which addresses are down, the scripted peers) and ``MemoryVan``, which
satisfies ``van.Van`` as ``zmq_van.ZmqVan`` does: ROUTER-like receiving (identity frame first, the sender's address
as ``last_peer``), DEALER-like sending (messages to an address nobody is bound at wait until someone binds it, as
ZeroMQ's do), watched links that go down when the peer's van closes or its address is marked down.
Does not own: message meaning, or time: the network takes the clock (`now`) and what a receive that finds nothing
does with its timeout (`wait`: nothing, or a fake clock's advance).

How a single-threaded test drives a whole life: the peers a test scripts (a fake scheduler, a fake worker) are
*turns* (callables returning whether they did anything). A van that would wait for a message gives every turn a
chance first, then lets `wait(timeout)` pass if nothing came. So the server under test runs its real loop, and the
peers answer exactly when it waits for them.
"""
from __future__ import annotations

import collections
import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kvstore_lazy.protocol.message import Message
from kvstore_lazy.transport.van import BindError, ConnectError

log = logging.getLogger(__name__)

ANY_HOST = ("", "*", "0.0.0.0")   # bound on every interface
TURN_ROUNDS = 100                  # rounds of turns a waiting receive gives the peers before the timeout passes


@dataclass
class MemoryLink:
    up: bool = False
    ever_up: bool = False
    changed: float = 0.0


@dataclass
class _Dealer:
    host: str
    port: int
    identity: bytes
    waiting: collections.deque = field(default_factory=collections.deque)   # frames for an address not bound yet


class MemoryNetwork:
    """Vans by address. `now` is the monotonic clock (links' change times); `wait(seconds)` what a receive that
    found nothing does with its timeout."""

    def __init__(self, now: Callable[[], float] = time.monotonic,
                 wait: Callable[[float], None] | None = None) -> None:
        self.now = now
        self.wait = wait if wait is not None else (lambda seconds: None)
        self.bound: dict[tuple[str, int], MemoryVan] = {}
        self.down: set[tuple[str, int]] = set()
        self.vans: list[MemoryVan] = []
        self.turns: list[Callable[[], bool]] = []
        self._ports = itertools.count(20000)
        self._anonymous = itertools.count(1)

    def van(self, host: str | None = "127.0.0.1") -> "MemoryVan":
        """A new van sending from `host` (None: no address, as ipc)."""
        van = MemoryVan(self, host)
        self.vans.append(van)
        return van

    def at(self, host: str, port: int) -> "MemoryVan | None":
        if (host, port) in self.down:
            return None
        return self.bound.get((host, port)) or next(
            (v for (h, p), v in self.bound.items() if p == port and h in ANY_HOST), None)

    def set_down(self, host: str, port: int, down: bool = True) -> None:
        """Make `host:port` unreachable (or reachable again): links to it change at once."""
        (self.down.add if down else self.down.discard)((host, port))
        self.changed()

    def changed(self) -> None:
        """Addresses were bound, closed or marked down: deliver what waited, update watched links."""
        for van in self.vans:
            van._refresh()

    def idle(self, van: "MemoryVan", seconds: float) -> None:
        """`van` would wait up to `seconds`: the peers' turns first, then (nothing for it) the wait itself."""
        for _ in range(TURN_ROUNDS):
            if van.inbox:
                return
            if not any([turn() for turn in self.turns]):
                break
        if not van.inbox:
            self.wait(seconds)

    def anonymous_identity(self) -> bytes:
        """What a ROUTER names a DEALER without identity (ZeroMQ: 5 bytes, a zero byte first)."""
        return b"\0" + next(self._anonymous).to_bytes(4, "big")


class MemoryVan:
    """One node's transport in a MemoryNetwork (see the module docstring)."""

    def __init__(self, network: MemoryNetwork, host: str | None) -> None:
        self.network = network
        self.host = host
        self.address: tuple[str, int] | None = None
        self.inbox: collections.deque = collections.deque()    # (frames, peer address)
        self.senders: dict[int, _Dealer] = {}
        self.links: dict[int, MemoryLink] = {}
        self.dropped: dict[int, str] = {}
        self.last_peer: str | None = None
        self.bytes_sent = 0
        self.bytes_received = 0
        self.closed = False
        self.busy = False

    def bind(self, host: str, port: int, max_retry: int = 40) -> int:
        candidates = [port] if port else []
        candidates += [next(self.network._ports) for _ in range(max_retry)]
        for candidate in candidates:
            if self.network.bound.get((host, candidate)) is None:
                self.address = (host, candidate)
                self.network.bound[self.address] = self
                self.network.changed()
                return candidate
        raise BindError(f"could not bind {host}: tried {candidates[:3]}... ({len(candidates)} ports)")

    def connect(self, node_id: int, host: str, port: int, identity: bytes | None, watch: bool = False) -> None:
        if not host or not 0 < port < 65536:
            raise ConnectError(f"cannot connect to node {node_id} at {host}:{port}: Invalid argument")
        self.disconnect(node_id)
        self.dropped.pop(node_id, None)
        self.senders[node_id] = _Dealer(host, port, identity if identity is not None else
                                        self.network.anonymous_identity())
        if watch:
            self.links[node_id] = MemoryLink(changed=self.network.now())
        self._refresh()

    def disconnect(self, node_id: int) -> None:
        self.senders.pop(node_id, None)
        self.links.pop(node_id, None)

    def link(self, node_id: int) -> MemoryLink | None:
        return self.links.get(node_id)

    def send(self, node_id: int, message: Message) -> int:
        dealer = self.senders.get(node_id)
        if dealer is None:
            if node_id not in self.dropped:
                log.error("no connection to node %d; dropping a message (head %s)", node_id, message.meta.head)
            return 0
        frames = [bytes(f) for f in message.to_frames()]
        size = sum(map(len, frames))
        dealer.waiting.append(frames)
        self.bytes_sent += size
        self._flush(dealer)
        return size

    def _flush(self, dealer: _Dealer) -> None:
        target = self.network.at(dealer.host, dealer.port)
        while dealer.waiting and target is not None and not self.closed:
            target.inbox.append(([dealer.identity] + dealer.waiting.popleft(), self.host))

    def _refresh(self) -> None:
        for node_id, dealer in self.senders.items():
            self._flush(dealer)
            link = self.links.get(node_id)
            if link is not None:
                up = self.network.at(dealer.host, dealer.port) is not None
                if up != link.up:
                    link.up, link.changed = up, self.network.now()
                link.ever_up |= up

    def recv(self, timeout_ms: int) -> list[bytes | memoryview] | None:
        if not self.inbox and timeout_ms > 0:
            self.network.idle(self, timeout_ms / 1000)
        if not self.inbox:
            return None
        frames, self.last_peer = self.inbox.popleft()
        self.bytes_received += sum(map(len, frames[1:]))
        return frames

    def incoming(self) -> bool:
        return bool(self.inbox)

    def pace(self, busy: bool) -> None:
        self.busy = busy          # (no threads to schedule: kept for tests)

    def close(self) -> None:
        """Gone, as a process that died: what it had not read is lost, and links to it go down."""
        if self.address is not None and self.network.bound.get(self.address) is self:
            del self.network.bound[self.address]
        self.closed = True
        self.inbox.clear()
        self.senders.clear()
        if self in self.network.vans:
            self.network.vans.remove(self)
        self.network.changed()
