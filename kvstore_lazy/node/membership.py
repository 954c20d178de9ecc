"""A server node's life in a ps-lite job, as control messages: registration, barriers, heartbeats, ACKs.

Owns: building these control messages, reading and validating the scheduler's ADD_NODE reply (the job's
:class:`Roster`: which node ids exist, their roles and announced addresses), node ids and groups, the PS_RESEND
message signature. Sans-IO: the runtime sends and receives.

ps-lite facts this follows (Postoffice/Van @34fd45c):
- ids: scheduler 1, server rank r is 8+2r, worker rank r is 9+2r; groups 1 scheduler, 2 servers, 4 workers, sums.
- a node connects to every listed node except other nodes of its own role, and to itself.
- BARRIER requests go to the scheduler with request=1, app_id=0; the reply has request=0.
- with PS_RESEND every message but ACK and TERMINATE is ACKed with its signature.
"""
from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass

from kvstore_lazy.protocol.pbmeta import (ACK, ADD_NODE, BARRIER, EMPTY, HEARTBEAT, SCHEDULER, SERVER, WORKER, Control,
                                          Meta, Node)
from kvstore_lazy.protocol.message import Message

SCHEDULER_ID = 1
SERVER_GROUP, WORKER_GROUP, ALL_GROUP = 2, 4, 7
SCHEDULER_GROUP = 1


def server_id(rank: int) -> int:
    return 8 + 2 * rank


def worker_id(rank: int) -> int:
    return 9 + 2 * rank


def id_to_rank(node_id: int) -> int:
    return max((node_id - 8) // 2, 0)


ROLE_NAMES = {SERVER: "server", WORKER: "worker", SCHEDULER: "scheduler"}


def node_name(node_id: int) -> str:
    """A node as log lines name it; the same words as ``server.core.node_name`` (the server's log lines), which
    cannot import this module (the server knows nothing of membership)."""
    if node_id == EMPTY:
        return "an unidentified node"
    if node_id == SCHEDULER_ID:
        return "the scheduler"
    role = "server" if node_id % 2 == 0 else "worker"
    return f"{role} {id_to_rank(node_id)} (node {node_id})"


class MembershipError(ValueError):
    """A node list from the scheduler this server cannot use; the message names the node and the reason."""


@dataclass
class Peer:
    node_id: int
    role: int
    hostname: str
    port: int

    def __str__(self) -> str:
        return f"{ROLE_NAMES.get(self.role, f'role {self.role}')} node {self.node_id} at {self.hostname}:{self.port}"


_LABEL = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?\Z")


def check_address(hostname: str, port: int) -> None:
    """Raise MembershipError unless `hostname`:`port` is an address a ZeroMQ DEALER can connect to: an IPv4 literal
    or a DNS name (RFC 1123 labels; all-numeric names must be valid IPv4), and 0 < port < 65536. ps-lite connects
    to whatever it was told: an empty host or a port of -1 made a connect raise (and the cleanup hang), an
    unreachable one made the next send block for good."""
    if not isinstance(hostname, str) or not hostname:
        raise MembershipError("empty host name")
    if not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536:
        raise MembershipError(f"port {port!r} is not in 1..65535")
    try:
        ip = ipaddress.ip_address(hostname)
    except ValueError:
        labels = hostname.split(".")
        if len(hostname) > 253 or not all(_LABEL.match(label) for label in labels):
            raise MembershipError(f"host {hostname[:80]!r} is neither an IPv4 address nor a DNS name") from None
        if all(label.isdigit() for label in labels):
            raise MembershipError(f"host {hostname!r} is not a valid IPv4 address") from None
        return
    if ip.version != 4:
        raise MembershipError(f"host {hostname!r}: ps-lite's ZeroMQ van speaks IPv4 only")


def _check_node(node: Node) -> Peer:
    """A Peer from one PBNode of the scheduler's list, or MembershipError naming it."""
    where = f"{ROLE_NAMES.get(node.role, f'a node of unknown role {node.role}')} node {node.id}"
    if node.role not in ROLE_NAMES:
        raise MembershipError(f"the scheduler announced {where}")
    try:
        check_address(node.hostname, node.port)
    except MembershipError as exc:
        raise MembershipError(f"the scheduler announced {where} at an unusable address: {exc}") from None
    return Peer(node.id, node.role, node.hostname, node.port)


@dataclass
class Roster:
    """The nodes of this job, by node id, as the scheduler announced them (its ADD_NODE reply): the only ids a
    server serves (stock ps-lite serves any id), and the addresses their messages must come from."""

    nodes: dict[int, Peer]

    @classmethod
    def from_reply(cls, reply: Meta, num_servers: int, num_workers: int) -> "Roster":
        """Validate the whole list: every node's role and address, and exactly this job's ids (ps-lite numbers
        them: scheduler 1, servers 8 + 2r, workers 9 + 2r for DMLC_NUM_SERVER / DMLC_NUM_WORKER)."""
        nodes: dict[int, Peer] = {}
        for node in reply.control.nodes:
            peer = _check_node(node)
            if peer.node_id in nodes:
                raise MembershipError(f"the scheduler announced node {peer.node_id} twice")
            nodes[peer.node_id] = peer
        expected = {SCHEDULER_ID: SCHEDULER}
        expected.update({server_id(r): SERVER for r in range(num_servers)})
        expected.update({worker_id(r): WORKER for r in range(num_workers)})
        got = {node_id: peer.role for node_id, peer in nodes.items()}
        if got != expected:
            def describe(ids: dict[int, int]) -> str:
                return ", ".join(f"{ROLE_NAMES.get(role, role)} {node_id}" for node_id, role in sorted(ids.items()))
            raise MembershipError(f"the scheduler's node list ({describe(got)}) is not a job of {num_servers} "
                                  f"servers and {num_workers} workers as DMLC_NUM_SERVER / DMLC_NUM_WORKER say "
                                  f"here ({describe(expected)})")
        return cls(nodes)

    def update(self, reply: Meta) -> list[Peer]:
        """A later ADD_NODE (the scheduler announces a recovered worker, at its new address): the workers it lists,
        now in the roster. Every listed node must be one of this job's, with its role; only workers move."""
        peers = [_check_node(node) for node in reply.control.nodes if node.id != EMPTY]
        for peer in peers:
            known = self.nodes.get(peer.node_id)
            if known is None or known.role != peer.role:
                raise MembershipError(f"the scheduler announced {peer}, which is not a node of this job")
        workers = [peer for peer in peers if peer.role == WORKER]
        self.nodes.update((peer.node_id, peer) for peer in workers)
        return workers

    def role(self, node_id: int) -> int | None:
        peer = self.nodes.get(node_id)
        return None if peer is None else peer.role


def add_node_request(hostname: str, port: int, timestamp: int, is_recovery: bool = False) -> Message:
    node = Node(role=SERVER, id=EMPTY, hostname=hostname, port=port, is_recovery=is_recovery, customer_id=0)
    return Message(Meta(control=Control(cmd=ADD_NODE, nodes=[node]), timestamp=timestamp))


def find_self(reply: Meta, hostname: str, port: int) -> tuple[int, list[Peer]]:
    """From the scheduler's ADD_NODE reply: my id and the peers a server connects to (workers, itself, scheduler).

    Raises ValueError if the reply does not list this node.
    """
    my_id = None
    for node in reply.control.nodes:
        if node.hostname == hostname and node.port == port and node.role == SERVER:
            my_id = node.id
    if my_id is None:
        raise ValueError(f"the scheduler's node list does not contain {hostname}:{port}")
    peers = []
    for node in reply.control.nodes:
        if node.role == SERVER and node.id != my_id:
            continue
        peers.append(Peer(node.id, node.role, node.hostname, node.port))
    return my_id, peers


def address_update(my_id: int, hostname: str, port: int, timestamp: int) -> Message:
    """ADD_NODE listing only this (registered) server at `hostname:port`. A stock worker connects to every host:port
    an ADD_NODE lists that it has not connected to, and ZMQVan::Connect first closes its socket to that node id
    (ps-lite Van::ProcessAddNodeCommand, the path of a recovered node): so it drops a socket still trying the
    server's old address and dials the new one."""
    node = Node(role=SERVER, id=my_id, hostname=hostname, port=port, customer_id=0)
    return Message(Meta(control=Control(cmd=ADD_NODE, nodes=[node]), timestamp=timestamp))

def barrier_request(group: int, timestamp: int) -> Message:
    return Message(Meta(request=True, app_id=0, customer_id=0, timestamp=timestamp,
                        control=Control(cmd=BARRIER, barrier_group=group)))


def is_barrier_release(meta: Meta) -> bool:
    return meta.control.cmd == BARRIER and not meta.request


def heartbeat(my_id: int, hostname: str, port: int, timestamp: int) -> Message:
    node = Node(role=SERVER, id=my_id, hostname=hostname, port=port, customer_id=0)
    return Message(Meta(control=Control(cmd=HEARTBEAT, nodes=[node]), timestamp=timestamp))


def message_signature(meta: Meta, sender: int, recver: int) -> int:
    """Resender::GetKey: uint16 app_id << 48 | uint8 sender << 40 | uint8 recver << 32 | (timestamp << 1 | request)."""
    app_id = meta.app_id & 0xFFFF
    ts = meta.timestamp & 0xFFFFFFFF
    return (app_id << 48) | ((sender & 0xFF) << 40) | ((recver & 0xFF) << 32) | (((ts << 1) | int(meta.request))
                                                                             & 0xFFFFFFFF)


def ack(signature: int) -> Message:
    return Message(Meta(control=Control(cmd=ACK, msg_sig=signature)))
