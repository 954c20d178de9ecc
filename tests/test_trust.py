"""Who may send the server what (kvstore_lazy.node.trust) and the job's roster (kvstore_lazy.node.membership), sans-IO.

Issue 11: stock ps-lite takes any ``ps<id>`` identity from anyone. Here the scheduler's ADD_NODE reply is validated
into a Roster (this job's ids and roles, addresses a DEALER can connect to) and every received message passes
trust.Admission: the allow-list, a known id other than the server's own, the address the scheduler announced for it,
and what that role may send. The real-socket side (Peer-Address, the whole server process) is in
tests/test_transport.py and tests/test_trust_live.py.
"""
from __future__ import annotations

import ipaddress

import pytest

from kvstore_lazy.node import membership
from kvstore_lazy.node.membership import MembershipError, Roster, check_address
from kvstore_lazy.protocol.pbmeta import (ACK, ADD_NODE, BARRIER, EMPTY, HEARTBEAT, SCHEDULER, SERVER, TERMINATE,
                                          WORKER, Control, Meta, Node)
from kvstore_lazy.node.trust import Admission, LogLimiter, TrustError, parse_allow, what

IP = ipaddress.ip_address


def reply_meta(nodes) -> Meta:
    return Meta(control=Control(cmd=ADD_NODE, nodes=[Node(role=r, id=i, hostname=h, port=p) for i, r, h, p in nodes]))


JOB = [(8, SERVER, "10.0.0.2", 9000), (10, SERVER, "10.0.0.3", 9000), (9, WORKER, "10.0.0.4", 9001),
       (11, WORKER, "10.0.0.5", 9001), (1, SCHEDULER, "10.0.0.1", 9091)]


def roster(nodes=JOB, servers=2, workers=2) -> Roster:
    return Roster.from_reply(reply_meta(nodes), servers, workers)


# ---------------------------------------------------------------------------------------------------------------
# announced addresses

@pytest.mark.parametrize("host, port", [("10.0.0.1", 9091), ("127.0.0.1", 1), ("node-3.example.com", 65535),
                                        ("worker0", 5000), ("a" * 63 + ".b", 80)])
def test_usable_addresses(host, port):
    check_address(host, port)


@pytest.mark.parametrize("host, port, why", [
    ("", 9000, "empty"), ("10.0.0.1", -1, "port"), ("10.0.0.1", 0, "port"), ("10.0.0.1", 65536, "port"),
    ("10.0.0.1", True, "port"), ("256.1.1.1", 5, "not a valid IPv4"), ("1.2.3", 5, "not a valid IPv4"),
    ("::1", 5, "IPv4 only"), ("host name", 5, "neither"), ("-bad", 5, "neither"), ("a..b", 5, "neither"),
    ("x" * 64, 5, "neither"), ("tcp://1.2.3.4", 5, "neither"), ("1.2.3.4:5", 5, "neither"),
    ("h\x00", 5, "neither"), ("é.example", 5, "neither"),
])
def test_unusable_addresses(host, port, why):
    with pytest.raises(MembershipError, match=why):
        check_address(host, port)


# ---------------------------------------------------------------------------------------------------------------
# the roster from the scheduler's ADD_NODE reply

def test_roster_of_a_job():
    r = roster()
    assert sorted(r.nodes) == [1, 8, 9, 10, 11]
    assert r.role(9) == WORKER and r.role(10) == SERVER and r.role(1) == SCHEDULER and r.role(77) is None


@pytest.mark.parametrize("nodes, why", [
    (JOB + [(13, WORKER, "10.0.0.6", 1)], "not a job of 2 servers and 2 workers"),             # one too many
    (JOB[:-1], "not a job of 2 servers and 2 workers"),                                       # no scheduler
    ([n if n[0] != 9 else (77, WORKER, "10.0.0.4", 9001) for n in JOB], "not a job"),        # id 77
    ([n if n[0] != 9 else (9, SERVER, "10.0.0.4", 9001) for n in JOB], "not a job"),         # wrong role
    (JOB + [(9, WORKER, "10.0.0.9", 1)], "twice"),
    ([n if n[0] != 9 else (9, WORKER, "", 9001) for n in JOB], "empty host"),
    ([n if n[0] != 9 else (9, WORKER, "10.0.0.4", -1) for n in JOB], "port -1"),
    ([n if n[0] != 9 else (9, 7, "10.0.0.4", 9001) for n in JOB], "unknown role 7"),
])
def test_unusable_rosters(nodes, why):
    with pytest.raises(MembershipError, match=why):
        roster(nodes)


def test_a_recovered_worker_moves_but_nothing_else_may():
    r = roster()
    moved = r.update(reply_meta([(9, WORKER, "10.0.0.40", 7000)]))
    assert [(p.node_id, p.hostname, p.port) for p in moved] == [(9, "10.0.0.40", 7000)]
    assert r.nodes[9].hostname == "10.0.0.40"
    for nodes, why in [([(77, WORKER, "10.0.0.7", 1)], "not a node of this job"),
                       ([(9, SERVER, "10.0.0.7", 1)], "not a node of this job"),
                       ([(9, WORKER, "", 1)], "empty host"), ([(11, WORKER, "10.0.0.5", 0)], "port 0")]:
        with pytest.raises(MembershipError, match=why):
            r.update(reply_meta(nodes))
    assert r.nodes[9].hostname == "10.0.0.40" and r.nodes[11].port == 9001   # a refused update changes nothing


# ---------------------------------------------------------------------------------------------------------------
# the gate

def request(**kw) -> Meta:
    return Meta(head=0, request=True, push=True, timestamp=1, app_id=0, **kw)


def control(cmd: int, request: bool = False) -> Meta:
    return Meta(control=Control(cmd=cmd), request=request)


def resolve(host: str) -> set[str]:
    names = {"sched.example": {"10.0.0.1"}, "gone.example": set()}
    if host == "unresolvable.example":
        raise OSError("Name or service not known")
    return names.get(host, {host})


def gate(**kw) -> Admission:
    g = Admission(resolve=resolve, local=frozenset({IP("10.0.0.2")}), own=frozenset({IP("10.0.0.2")}), **kw)
    assert g.expect_scheduler("10.0.0.1") is None
    return g


def test_while_registering_only_the_schedulers_add_node_passes():
    g = gate()
    assert g.refusal(1, "10.0.0.1", control(ADD_NODE)) is None
    assert "registering" in g.refusal(1, "10.0.0.1", control(BARRIER))
    assert "registering" in g.refusal(77, "10.0.0.1", control(ADD_NODE))
    assert "registering" in g.refusal(9, "10.0.0.4", request())
    assert "comes from 10.0.0.9" in g.refusal(1, "10.0.0.9", control(ADD_NODE))
    assert "no ps<id> identity" in g.refusal(EMPTY, "10.0.0.1", control(ADD_NODE))


def test_served_nodes_and_what_each_may_send():
    g = gate()
    assert g.set_roster(roster(), 8) == {}
    ok = [(9, "10.0.0.4", request()), (11, "10.0.0.5", request(simple_app=True)), (9, "10.0.0.4", control(ACK)),
          (1, "10.0.0.1", control(ADD_NODE)), (1, "10.0.0.1", control(BARRIER)), (1, "10.0.0.1", control(HEARTBEAT)),
          (1, "10.0.0.1", control(ACK))]
    for sender, peer, meta in ok:
        assert g.refusal(sender, peer, meta) is None, (sender, meta)
    refused = [
        (77, "10.0.0.4", request(), "node 77 is not in this job"),
        (13, "10.0.0.4", request(), "node 13 is not in this job"),
        (8, "10.0.0.2", request(), "claims to be this server"),
        (10, "10.0.0.3", request(), "servers send a server nothing"),
        (1, "10.0.0.1", request(), "the scheduler sends servers no requests"),
        (1, "10.0.0.1", control(BARRIER, request=True), "the scheduler sends a server only"),
        (1, "10.0.0.1", control(TERMINATE), "the scheduler sends a server only"),
        (9, "10.0.0.4", control(ADD_NODE), "only the scheduler sends it"),
        (9, "10.0.0.4", control(BARRIER), "only the scheduler sends it"),
        (9, "10.0.0.4", control(TERMINATE), "only to its own node"),
        (9, "10.0.0.4", control(HEARTBEAT), "no such control command"),
        (9, "10.0.0.4", control(99), "no such control command"),
        (9, "10.0.0.4", Meta(head=0, request=False, push=True), "a reply arriving as a request"),
        (9, "10.0.0.4", Meta(head=2, request=False, simple_app=True), "a reply arriving as a request"),
        (9, "10.0.0.5", request(), "comes from 10.0.0.5, not from 10.0.0.4"),    # worker 1's address
        (1, "10.0.0.4", control(BARRIER), "comes from 10.0.0.4, not from 10.0.0.1"),
        (9, "not-an-ip", request(), "not an IP address"),
    ]
    for sender, peer, meta, why in refused:
        reason = g.refusal(sender, peer, meta)
        assert reason is not None and why in reason, (sender, peer, meta, reason)


def test_address_check_off_and_ipc():
    g = gate(check_address=False)
    g.set_roster(roster(), 8)
    assert g.refusal(9, "10.0.0.5", request()) is None       # KVSTORE_LAZY_CHECK_ADDRESS=0
    assert g.refusal(77, "10.0.0.5", request()) is not None   # ids are still checked
    g = gate()
    g.set_roster(roster(), 8)
    assert g.refusal(9, None, request()) is None              # ipc: no TCP address to check


def test_same_host_nodes_may_come_from_this_servers_address_or_loopback():
    # worker 9 announced 10.0.0.2, an address of this machine: connecting to us it may show up as our own
    # announced address or as 127.0.0.1 (a local connection's source), but not as another loopback address
    nodes = [n if n[0] != 9 else (9, WORKER, "10.0.0.2", 9001) for n in JOB]
    g = gate()
    g.set_roster(roster(nodes), 8)
    for peer in ("10.0.0.2", "127.0.0.1"):
        assert g.refusal(9, peer, request()) is None
    assert "comes from 127.0.0.2" in g.refusal(9, "127.0.0.2", request())
    assert "comes from 10.0.0.2" in g.refusal(11, "10.0.0.2", request())   # a remote worker stays remote


def test_allow_list():
    g = gate(allow=parse_allow("10.0.0.0/29, 192.168.7.7"))
    assert g.set_roster(roster(), 8) == {}
    assert "outside KVSTORE_LAZY_ALLOW" in g.refusal(9, "10.0.0.9", request())
    assert g.refusal(9, "10.0.0.4", request()) is None
    # announced outside the list: never served, said once at registration
    nodes = [n if n[0] != 11 else (11, WORKER, "10.9.9.9", 9001) for n in JOB]
    g = gate(allow=parse_allow("10.0.0.0/29"))
    refused = g.set_roster(roster(nodes), 8)
    assert list(refused) == [11] and "10.9.9.9 is outside KVSTORE_LAZY_ALLOW" in refused[11]
    assert "outside KVSTORE_LAZY_ALLOW" in g.refusal(11, "10.9.9.9", request())
    g = Admission(resolve=resolve, allow=parse_allow("192.168.0.0/16"))
    assert "outside KVSTORE_LAZY_ALLOW" in g.expect_scheduler("10.0.0.1")


def test_names_are_resolved_once_and_unresolvable_nodes_are_not_served():
    nodes = [n if n[0] != 1 else (1, SCHEDULER, "sched.example", 9091) for n in JOB]
    nodes = [n if n[0] != 11 else (11, WORKER, "unresolvable.example", 9001) for n in nodes]
    g = gate()
    refused = g.set_roster(roster(nodes), 8)
    assert list(refused) == [11] and "does not resolve" in refused[11]
    assert g.refusal(1, "10.0.0.1", control(BARRIER)) is None
    assert "does not resolve" in g.refusal(11, "10.0.0.5", request())


@pytest.mark.parametrize("text, networks", [("", ()), (" ", ()), ("10.0.0.0/8", ("10.0.0.0/8",)),
                                            ("10.1.2.3/8,127.0.0.1", ("10.0.0.0/8", "127.0.0.1/32")),
                                            ("10.0.0.0/8,,", ("10.0.0.0/8",))])
def test_parse_allow(text, networks):
    assert tuple(str(n) for n in parse_allow(text)) == networks


@pytest.mark.parametrize("text", ["10.0.0.0/33", "ten", "10.0.0.0/8,x", ",", "1.2.3.4/-1"])
def test_parse_allow_refuses(text):
    with pytest.raises(TrustError, match="KVSTORE_LAZY_ALLOW"):
        parse_allow(text)


def test_what():
    assert what(control(ADD_NODE)) == "control command 2"
    assert what(request()) == "a request (head 0)"
    assert what(Meta(head=2, simple_app=True, request=True)) == "a command (head 2)"
    assert what(Meta(head=0)) == "a reply-shaped request (head 0)"


def test_log_limiter():
    now = [0.0]
    limiter = LogLimiter(burst=3, interval=10.0, clock=lambda: now[0], max_kinds=2)
    assert [limiter.admit(("a",)) for _ in range(3)] == ["", "", ""]
    assert limiter.admit(("a",)) == ""            # the first past the burst: logged, then quiet for 10 s
    assert [limiter.admit(("a",)) for _ in range(5)] == [None] * 5
    now[0] = 11.0
    assert limiter.admit(("a",)) == " (5 more like it not logged)"
    assert limiter.admit(("b",)) == ""
    for i in range(100):                           # many kinds: one shared entry, the table stays small
        limiter.admit(("c", i))
    assert len(limiter.counts) == 3


def test_membership_still_numbers_ids_as_ps_lite():
    assert [membership.server_id(r) for r in range(3)] == [8, 10, 12]
    assert [membership.worker_id(r) for r in range(3)] == [9, 11, 13]
