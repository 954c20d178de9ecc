"""What a server restored from a snapshot keeps when a *fresh* job starts against it.

Owns: :class:`ResumeGate`, which answers and drops the requests of the new job that would overwrite what the
snapshot restored. It sits in front of :class:`~kvstore_lazy.server.core.KVServer` (the runtime passes every request
through it first, journal replay included) and is saved in snapshots while it is active.
"""
from __future__ import annotations

import logging

from kvstore_lazy.protocol import kv as wire
from kvstore_lazy.protocol import mxnet as mx
from kvstore_lazy.protocol.message import Message
from kvstore_lazy.server.core import node_name

log = logging.getLogger("kvstore_lazy.server")

WORKER0_ID = 9   # ps-lite's node id of worker rank 0 (membership.worker_id(0))


class ResumeGate:
    """A server that a *fresh* job started from a snapshot keeps what it restored:

    - the first push of each restored key from worker rank 0 is that worker's ``kv.init`` (MXNet's workers must init
      every key, and only rank 0 pushes the value): it is answered and dropped, so the restored rows, values and
      optimizer states stay (Gluon's ``broadcast`` then pulls the restored dense values into the workers);
    - until training pushes begin, a kController carrying the optimizer the snapshot has (every worker sends it in
      ``set_optimizer``) is answered and dropped, so optimizer states and update counts stay. Another optimizer is
      applied as usual (which, as on a stock server, starts fresh states).
    """

    def __init__(self, keys, optimizer_body: bytes | None, optimizer_skip: bool = True) -> None:
        self.keys = set(int(k) for k in keys)
        self.optimizer_body = optimizer_body
        self.optimizer_skip = optimizer_skip and optimizer_body is not None

    @property
    def active(self) -> bool:
        return bool(self.keys) or self.optimizer_skip

    def state(self) -> dict:
        return {"await_init": sorted(self.keys), "optimizer_skip": self.optimizer_skip}

    @classmethod
    def from_state(cls, state: dict, optimizer_body: bytes | None) -> "ResumeGate":
        return cls(state.get("await_init", []), optimizer_body, bool(state.get("optimizer_skip")))

    def intercept(self, key_range: wire.KeyRange, msg: Message) -> list | None:
        """The answer to a request this gate drops, or None to let the server handle it."""
        meta = msg.meta
        if meta.simple_app:
            if self.optimizer_skip and meta.head == mx.CONTROLLER and bytes(meta.body) == self.optimizer_body:
                log.info("resume: %s sent the optimizer this server restored; keeping its states and counts",
                         node_name(msg.sender))
                return [wire.command_reply(msg)]
            return None
        if not meta.push:
            return None
        key = key_range.hint(msg)
        if key is not None and key in self.keys and msg.sender == WORKER0_ID:
            self.keys.discard(key)
            log.info("resume: key %d restored from the snapshot; its kv.init push from worker 0 is dropped", key)
            return [wire.reply(msg.sender, meta)]
        self.optimizer_skip = False
        return None
