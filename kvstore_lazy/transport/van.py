"""The transport as the server node sees it: what a van does, whichever carries the frames.

Owns: the ``Van`` interface (a ``typing.Protocol``) and ``Link``, the state of a watched connection. The methods
are exactly those of ``zmq_van.ZmqVan`` the node uses; ``ZmqVan`` satisfies the protocol structurally (nothing
subclasses it), and ``memory.MemoryVan`` is its in-process twin for tests (as httpx keeps a mock transport beside
the real one). Every van raises ``zmq_van.BindError`` (an OSError) for an address it cannot bind and
``zmq_van.ConnectError`` (a ValueError) for one it cannot connect to; they are re-exported here.
Does not own: any socket (``zmq_van``), ids or messages' meaning.

The contract the node relies on:
- ``recv`` returns one message's frames, identity first (as a ROUTER gives them), or None after `timeout_ms`;
  ``last_peer`` is then the address the message came from (None when the transport has none: ipc).
- ``send`` never blocks: a message a peer cannot take yet waits; a peer that stops reading is dropped and named in
  ``dropped`` (node id -> why).
- ``connect`` (re)opens the link to a node; with `watch`, ``link`` tells whether it is up and since when.
"""
from __future__ import annotations

from typing import Protocol

from kvstore_lazy.protocol.message import Message
from kvstore_lazy.transport.zmq_van import BindError, ConnectError

__all__ = ["BindError", "ConnectError", "Link", "Van"]


class Link(Protocol):
    """What the van saw of a watched connection."""

    up: bool
    ever_up: bool
    changed: float     # monotonic time of the last change


class Van(Protocol):
    dropped: dict[int, str]
    last_peer: str | None
    bytes_sent: int
    bytes_received: int

    def bind(self, host: str, port: int, max_retry: int = 40) -> int: ...

    def connect(self, node_id: int, host: str, port: int, identity: bytes | None, watch: bool = False) -> None: ...

    def disconnect(self, node_id: int) -> None: ...

    def link(self, node_id: int) -> Link | None: ...

    def send(self, node_id: int, message: Message) -> int: ...

    def recv(self, timeout_ms: int) -> list[bytes | memoryview] | None: ...

    def incoming(self) -> bool: ...

    def pace(self, busy: bool) -> None:
        """Whether the serving loop is busy (``node.Pace``): a van with threads of its own may schedule them so."""
        ...

    def close(self) -> None: ...
