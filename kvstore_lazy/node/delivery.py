"""Reliable delivery under PS_RESEND, as ps-lite's Resender does it, and the batching of replies.

Owns: the signatures of received requests (the *seen* set: a resent duplicate is ACKed again, not processed again),
ACKs sent for what we received and taken for what we sent, our replies not ACKed yet (``Outbox``) and their
resending, and the replies held back until the end of a batch (``REPLY_BATCH`` in ``node``).
Does not own: the socket (a ``send`` callable), what a request means, or the journal (which keeps the seen set and
the outbox across a restart: ``durability`` reads them here and gives them back on replay).

ps-lite facts this follows: with PS_RESEND every message but ACK and TERMINATE is ACKed with its signature
(``membership.message_signature``: Resender::GetKey); control messages this server sends (ADD_NODE, BARRIER,
HEARTBEAT, ACK) are never kept for resending: a resent BARRIER that the scheduler had processed but not ACKed
counts twice.
"""
from __future__ import annotations

import collections
import logging
from collections.abc import Callable

from kvstore_lazy.node import membership
from kvstore_lazy.protocol.message import Message
from kvstore_lazy.protocol.pbmeta import TERMINATE

log = logging.getLogger("kvstore_lazy")

SEEN_KEEP = 200_000             # signatures of received requests remembered for duplicate detection (PS_RESEND)
SEEN_IN_JOURNAL = 65_536        # ... of which the newest are carried over into a rotated journal
RESEND_CHECK_MIN = 0.05         # s; the outbox is looked at every resend_timeout / 2, at most this often
DUPLICATE = -1                  # check_in's answer for a resent request already received


class Outbox:
    """Our messages that PS_RESEND peers have not ACKed yet, resent every `timeout` seconds (ps-lite's Resender,
    without its abort after 10 tries: a server keeps trying and says so in the log)."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self.pending: dict[int, list] = {}     # signature -> [recver, message, first sent, last sent, tries]

    def track(self, signature: int, recver: int, message: Message, now: float) -> None:
        self.pending.setdefault(signature, [recver, message, now, now, 0])

    def ack(self, signature: int) -> bool:
        return self.pending.pop(signature, None) is not None

    def due(self, now: float) -> list[list]:
        out = []
        for entry in self.pending.values():
            if now - entry[3] >= self.timeout:
                entry[3] = now
                entry[4] += 1
                out.append(entry)
        return out

    def frames(self) -> list[tuple[int, list[bytes]]]:
        return [(recver, [bytes(f) for f in message.to_frames()]) for recver, message, *_ in self.pending.values()]


class Delivery:
    """What this server sends and receives under PS_RESEND (`resend`), and its held replies. `send(node_id, msg)`
    is the van's; `now()` the node's monotonic clock; `acked(signature)` is told every reply a peer ACKed (the
    journal records it)."""

    def __init__(self, send: Callable[[int, Message], object], now: Callable[[], float], resend: bool,
                 timeout: float) -> None:
        self.send = send
        self.now = now
        self.resend = resend
        self.outbox = Outbox(timeout)
        self.seen: collections.OrderedDict[int, None] = collections.OrderedDict()
        self.my_id: int | None = None            # set once registered: signatures name this server
        self.held: list | None = None            # replies waiting for the end of a batch, or None: sent at once
        self.acked: Callable[[int], None] = lambda signature: None

    # --- sending

    def control(self, node_id: int, msg: Message) -> None:
        """A control message: sent now, never kept for resending."""
        self.send(node_id, msg)

    def reply(self, recver: int, msg: Message) -> None:
        """Send a reply, and with PS_RESEND keep it until the peer ACKs it (control messages go through
        control and are never resent)."""
        if self.held is not None:
            self.held.append((recver, msg))
        else:
            self.send(recver, msg)
        if self.resend and self.my_id is not None:
            self.outbox.track(membership.message_signature(msg.meta, self.my_id, recver), recver, msg, self.now())

    def hold(self) -> None:
        """Replies from now on wait for :meth:`release`."""
        self.held = []

    def release(self, hold: bool = True) -> None:
        """Send the replies held since the last release, in order (`hold=False`: and send at once from now on)."""
        held = self.held
        if held:
            self.held = []
            for recver, msg in held:
                self.send(recver, msg)
        if not hold:
            self.held = None

    def resend_due(self, now: float) -> None:
        for entry in self.outbox.due(now):
            recver, message, first, _, tries = entry
            self.send(recver, message)
            if tries in (1, 3, 10) or tries % 30 == 0:
                log.warning("no ACK from %s for %.0fs: resent a message to it (try %d)", membership.node_name(recver),
                            now - first, tries)

    def resend_period(self) -> float:
        return max(self.outbox.timeout / 2, RESEND_CHECK_MIN)

    # --- receiving

    def take_ack(self, signature: int) -> None:
        """A peer ACKed one of our messages."""
        if self.outbox.ack(signature):
            self.acked(signature)

    def check_in(self, msg: Message) -> int | None:
        """A received message's signature to ACK (None: nothing to ACK), or DUPLICATE for a resent request already
        received (ACKed again here; not to be processed again)."""
        if not self.resend or self.my_id is None or msg.meta.control.cmd == TERMINATE:
            return None
        signature = membership.message_signature(msg.meta, msg.sender, self.my_id)
        if signature in self.seen:
            self.control(msg.sender, membership.ack(signature))
            return DUPLICATE   # a resent duplicate: ACKed again, not processed again
        return signature

    def confirm(self, sender: int, signature: int) -> None:
        """ACK a received message (after the journal has it) and remember it."""
        self.control(sender, membership.ack(signature))
        self.remember(signature)

    def remember(self, signature: int) -> None:
        self.seen[signature] = None
        if len(self.seen) > SEEN_KEEP:
            self.seen.popitem(last=False)

    # --- what a journal keeps across a restart

    def newest_seen(self) -> list[int]:
        return list(self.seen)[-SEEN_IN_JOURNAL:]

    def replayed(self, msg: Message) -> None:
        """A journaled request replayed: a resent copy of it is a duplicate."""
        assert self.my_id is not None
        self.remember(membership.message_signature(msg.meta, msg.sender, self.my_id))

    def signature_of_reply(self, recver: int, reply: Message) -> int:
        assert self.my_id is not None
        return membership.message_signature(reply.meta, self.my_id, recver)
