"""A server node's life in a ps-lite job, as control messages: registration, barriers, heartbeats, ACKs.

Owns: building these control messages, reading the scheduler's ADD_NODE reply, node ids and groups, the
PS_RESEND message signature. Sans-IO: the runtime sends and receives.

ps-lite facts this follows (Postoffice/Van @34fd45c):
- ids: scheduler 1, server rank r is 8+2r, worker rank r is 9+2r; groups 1 scheduler, 2 servers, 4 workers, sums.
- a node connects to every listed node except other nodes of its own role, and to itself.
- BARRIER requests go to the scheduler with request=1, app_id=0; the reply has request=0.
- with PS_RESEND every message but ACK and TERMINATE is ACKed with its signature.
"""
from __future__ import annotations

from dataclasses import dataclass

from .protocol.pbmeta import ACK, ADD_NODE, BARRIER, EMPTY, HEARTBEAT, SCHEDULER, SERVER, WORKER, Control, Meta, Node
from .protocol.message import Message

SCHEDULER_ID = 1
SERVER_GROUP, WORKER_GROUP, ALL_GROUP = 2, 4, 7
SCHEDULER_GROUP = 1


def server_id(rank: int) -> int:
    return 8 + 2 * rank


def worker_id(rank: int) -> int:
    return 9 + 2 * rank


def id_to_rank(node_id: int) -> int:
    return max((node_id - 8) // 2, 0)


@dataclass
class Peer:
    node_id: int
    role: int
    hostname: str
    port: int


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


def peers_update(reply: Meta, my_id: int) -> list[Peer]:
    """Peers announced by a later ADD_NODE (a recovered worker): those a server connects to."""
    return [Peer(n.id, n.role, n.hostname, n.port) for n in reply.control.nodes
            if n.id != EMPTY and (n.role in (WORKER, SCHEDULER) or n.id == my_id)]


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
