"""A server's life with the scheduler: registration, the startup barrier, rejoining, heartbeats, the final barrier.

Owns: the exact start/stop sequence stock workers and the stock scheduler need, each phase a state of
``states.Life``:
ADD_NODE -> reconnect with identity -> BARRIER(7) -> serve -> kStopServer answered -> BARRIER(7) -> close;
the rejoin of a restarted server at the address it had (no registration); this server's id, rank, roster and
peers, its control messages' timestamps, and what the scheduler's control messages do (barrier releases, a
recovered node announced by ADD_NODE).
Does not own: the loop (``node``), the control messages' bytes (``membership``), the state restored
(``durability``), the membership record (``recovery``) or the admission of messages (``guard``).

Stock ps-lite races under PS_RESEND that this server works around (see start and stop): the scheduler creates its
resender up to 100 ms after answering the registrations, so BARRIER requests that arrive first are counted, never
ACKed, resent and counted again; the extra counts release the final barrier before every node asked.

A server restarted with KVSTORE_LAZY_RECOVERY=1 *rejoins* its job: it binds the address it had (its
``node.rank<r>.json``), restores the snapshot, replays the journal (the same requests in the same order give the
same state, half-done rounds included), re-sends the replies its peers never ACKed, and serves on. It does not
register again: to the workers and the scheduler, whose ZeroMQ sockets reconnect to the same address on their
own, it looks like a connection that dropped for a moment.
KVSTORE_LAZY_RECOVERY=register tries stock ps-lite's own recovery instead (ADD_NODE with is_recovery, resent until
the scheduler's PS_HEARTBEAT_TIMEOUT has declared the old node dead; no startup barrier); see ``runtime``.
"""
from __future__ import annotations

import logging
from collections.abc import Callable

from kvstore_lazy.node import membership, placement, recovery, states
from kvstore_lazy.node.durability import Durability
from kvstore_lazy.node.errors import StartupError
from kvstore_lazy.node.guard import Guard
from kvstore_lazy.node.liveness import SchedulerWatch
from kvstore_lazy.node.lognames import set_label
from kvstore_lazy.node.node import Node
from kvstore_lazy.protocol.message import Message, identity_of
from kvstore_lazy.protocol.pbmeta import ADD_NODE, WORKER

log = logging.getLogger("kvstore_lazy")

RESEND_STARTUP_DELAY = 0.5      # s; under PS_RESEND, ask for the startup barrier this late (see start)
FINAL_BARRIER_STAGGER = 0.3     # s; under PS_RESEND, server rank r asks for the final barrier (r+1) x this late
# s a server waits for the final barrier's release (it comes within moments of the last node asking). The scheduler
# can lose it: its socket to a server re-created at a new IP may still be trying the old one when it exits. The
# server serves on meanwhile: the workers' sockets still trying the old IP deliver their last messages to it once
# the kernel gives up that connect (tcp_syn_retries 6: 127 s), and their exit waits for that (ZeroMQ linger).
FINAL_RELEASE_WAIT = 150.0
REGISTER_RETRY = 5.0            # s between ADD_NODEs of a node recovering ps-lite's way (RECOVERY=register)


class Session:
    """One server's phases. `open_server(rank)` makes the KVServer once the rank is known; `start_timers()` fills
    the node's timer table once registered."""

    def __init__(self, cfg, node: Node, guard: Guard, watch: SchedulerWatch, durability: Durability,
                 status: placement.StatusFile, open_server: Callable[[int], None],
                 start_timers: Callable[[], None]) -> None:
        self.cfg = cfg
        self.node = node
        self.guard = guard
        self.watch = watch
        self.durability = durability
        self.status = status
        self.open_server = open_server
        self.start_timers = start_timers
        self.life = states.Life()
        self.my_id: int | None = None
        self.rank = -1
        self.port = 0
        self.timestamp = 0          # the van's own counter for control messages
        self.roster: membership.Roster | None = None
        self.peers: list[membership.Peer] = []
        self.barrier_released = False

    def tick(self) -> int:
        ts = self.timestamp
        self.timestamp += 1
        return ts

    def _send_control(self, node_id: int, msg: Message) -> None:
        self.node.delivery.control(node_id, msg)

    def _set_id(self, my_id: int, rank: int) -> None:
        self.my_id, self.rank = my_id, rank
        self.node.delivery.my_id = my_id
        set_label(rank)

    # ------------------------------------------------------------------------------------------------------------
    # a fresh start (or ps-lite's own recovery)

    def start(self, timeout: float = 600.0) -> None:
        cfg = self.cfg
        self.life.to(states.REGISTERING)
        self.port = self.node.bind(cfg.bind or cfg.host, cfg.port)
        self.status.write("starting", host=cfg.host, port=self.port)
        log.info("listening on %s:%d%s; registering with the scheduler at %s:%d%s", cfg.host, self.port,
                 f" (bound to {cfg.bind})" if cfg.bind else "", cfg.root_uri, cfg.root_port,
                 " as a recovered node" if cfg.recovery == recovery.REGISTER else "")
        if cfg.recovery == recovery.REGISTER:
            self.timestamp = recovery.rejoin_timestamp(self.node.clock.time())
        self.guard.expect_scheduler()
        # The first socket to the scheduler has no identity: that is how it recognises a new registration.
        self._connect(membership.Peer(membership.SCHEDULER_ID, membership.SCHEDULER, cfg.root_uri, cfg.root_port),
                      identity=None)
        reply = self._register(timeout)
        recovered = self._joined(reply)
        if cfg.snapshot_dir:
            self.write_record()
            if cfg.recovery == recovery.REGISTER:
                self._recover(self.node.clock.monotonic())
            else:
                self.durability.load_snapshot()
                if cfg.journal:
                    self.durability.new_epoch()
        self.status_serving()
        if recovered:
            # MXNet's servers and workers skip the startup barrier when ps-lite says is_recovery: the others are
            # long past it.
            log.info("recovered node: skipping the startup barrier")
            self.life.to(states.SERVING)
            return
        self.life.to(states.STARTUP_BARRIER)
        if cfg.resend:
            # Stock ps-lite creates the scheduler's resender up to 100 ms after it has answered the registrations;
            # a BARRIER arriving before that is counted but never ACKed, so its sender resends it and the scheduler
            # counts it again (the extra count later releases the final barrier early). Ask a little later.
            self.node.pump_for(RESEND_STARTUP_DELAY)
        self.barrier(membership.ALL_GROUP)
        self.life.to(states.SERVING)

    def _register(self, timeout: float) -> Message:
        """Send ADD_NODE and wait for the scheduler's node list."""
        cfg, clock = self.cfg, self.node.clock
        request = membership.add_node_request(cfg.host, self.port, self.tick(), cfg.recovery == recovery.REGISTER)
        self._send_control(membership.SCHEDULER_ID, request)
        deadline = clock.monotonic() + timeout
        retry_every = REGISTER_RETRY if cfg.recovery == recovery.REGISTER else float("inf")
        next_retry = clock.monotonic() + retry_every
        while True:
            now = clock.monotonic()
            if now > deadline:
                raise StartupError(f"no reply to ADD_NODE from the scheduler at {cfg.root_uri}:{cfg.root_port}")
            if now > next_retry:
                # a stock scheduler ignores a recovering node until its heartbeat timeout declared the old one dead
                self._send_control(membership.SCHEDULER_ID, request)
                next_retry = now + retry_every
            msg = self.node.recv(1000)
            if msg is not None and msg.meta.control.cmd == ADD_NODE:
                return msg
            self.watch.check(clock.monotonic())

    def _joined(self, reply: Message) -> bool:
        """The scheduler's node list: this server's id, the roster, the connections to its peers, the KVServer.
        Returns whether ps-lite calls this node recovered."""
        cfg = self.cfg
        try:
            roster = membership.Roster.from_reply(reply.meta, cfg.num_servers, cfg.num_workers)
            my_id, peers = membership.find_self(reply.meta, cfg.host, self.port)
        except ValueError as exc:
            raise StartupError(f"cannot join the job: {exc}") from None
        recovered = any(n.id == my_id and n.is_recovery for n in reply.meta.control.nodes)
        rank = membership.id_to_rank(my_id)
        self._set_id(my_id, rank)
        self._set_roster(roster)
        self.peers = peers
        self.connect_peers()
        self.open_server(rank)
        log.info("registered as server rank %d (node %d) of %d servers, %d workers%s", rank, my_id,
                 cfg.num_servers, cfg.num_workers, " (recovered node)" if recovered else "")
        self.start_timers()
        return recovered

    # ------------------------------------------------------------------------------------------------------------
    # a rejoin

    def rejoin(self) -> None:
        """KVSTORE_LAZY_RECOVERY=1: take over from a dead server of this job at the address it had (see the module
        docstring)."""
        cfg = self.cfg
        started = self.node.clock.monotonic()
        self.life.to(states.REJOINING)
        record = recovery.rejoin_record(cfg)
        self._set_id(int(record["id"]), int(record["rank"]))
        # Rejoined at a new address (a re-created pod), the scheduler's ROUTER may refuse our connection until its
        # stale one to the old address times out (ZeroMQ keeps the first connection under an identity): wait for the
        # scheduler as long as for the final barrier's release before calling it dead.
        self.watch.grace = FINAL_RELEASE_WAIT
        self.timestamp = recovery.rejoin_timestamp(self.node.clock.time())
        self.port = self.node.bind_again(cfg.bind or record["host"], int(record["port"]))
        log.info("rejoining as server rank %d (node %d) at %s:%d", self.rank, self.my_id, record["host"], self.port)
        self.open_server(self.rank)
        self.peers = [membership.Peer(int(i), int(role), h, int(p)) for i, role, h, p in record["peers"]]
        self.guard.expect_scheduler()
        self._set_roster(membership.Roster({peer.node_id: peer for peer in self.peers}))
        self._recover(started)
        if not placement.is_ip_address(record["host"]):
            self._announce_address()
        self.start_timers()
        self.write_record()
        self.status_serving()
        self.life.to(states.SERVING)

    def _recover(self, started: float) -> None:
        """The snapshot and the journal replayed; then the peers connected and the replies they never ACKed
        re-sent."""
        recovered = self.durability.recover()
        self.connect_peers()
        self.durability.finish_recovery(recovered, started)

    def _announce_address(self) -> None:
        """Rejoined under a DNS name, perhaps at a new IP (a re-created pod): tell every worker where this server is
        now, so that a socket of theirs stuck on the old IP is replaced at once (placement module docstring)."""
        cfg = self.cfg
        assert self.my_id is not None
        address = cfg.bind if cfg.bind not in ("", placement.ALL_INTERFACES) else \
            placement.routed_address(cfg.root_uri, cfg.root_port)
        if address is None:
            log.warning("cannot tell the workers this server's address (no route to %s); they reach it once their "
                        "sockets give up the old one", cfg.root_uri)
            return
        workers = [p for p in self.peers if p.role == WORKER]
        for peer in workers:
            self._send_control(peer.node_id, membership.address_update(self.my_id, address, self.port, self.tick()))
        log.info("told %d workers this server is at %s:%d (for %s)", len(workers), address, self.port, cfg.host)

    # ------------------------------------------------------------------------------------------------------------
    # the end

    def stop(self) -> None:
        # Without this final group-7 barrier every worker and the scheduler hang after training.
        if self.cfg.resend and self.my_id is not None:
            # Under PS_RESEND the stock scheduler may carry extra counts from resent startup BARRIERs of workers (see
            # start), and then releases the final barrier before everyone asked; a node that asks after that release
            # waits forever. The servers ask last, one after another, and a server the release reached before it
            # asked does not ask: that absorbs up to one extra count per server.
            self.barrier_released = False
            self.node.pump_for(FINAL_BARRIER_STAGGER * (self.rank + 1), until=lambda: self.barrier_released)
            if self.barrier_released:
                log.info("the scheduler released the final barrier before this server asked (extra counts from "
                         "resent startup BARRIERs, a ps-lite PS_RESEND race); not asking")
                self._stopped()
                return
        self.life.to(states.FINAL_BARRIER)
        if not self.barrier(membership.ALL_GROUP, timeout=FINAL_RELEASE_WAIT):
            log.warning("no release of the final barrier from the scheduler within %.0fs (its socket to this server "
                        "may still have been trying an old address of it); training is over, stopping",
                        FINAL_RELEASE_WAIT)
        self._stopped()

    def _stopped(self) -> None:
        """Past the final barrier: the job is over, so a later start with this record registers anew."""
        if self.cfg.snapshot_dir and self.my_id is not None:
            self.write_record("finished")
        self.status.write("stopped")
        self.life.to(states.STOPPED)
        log.info("stopped")

    def barrier(self, group: int, timeout: float | None = None) -> bool:
        """Ask the scheduler for barrier `group` and serve until it is released (False: not within `timeout` s)."""
        self.barrier_released = False
        # not kept for resending: a resent BARRIER that the scheduler had processed but not ACKed counts twice
        self._send_control(membership.SCHEDULER_ID, membership.barrier_request(group, self.tick()))
        return self.node.serve_until(lambda: self.barrier_released, timeout)

    # ------------------------------------------------------------------------------------------------------------
    # while serving

    def heartbeat(self, now: float) -> None:
        """A timer's action: the scheduler answers each heartbeat (Van::ProcessHearbeat); see liveness."""
        assert self.my_id is not None
        self._send_control(membership.SCHEDULER_ID,
                           membership.heartbeat(self.my_id, self.cfg.host, self.port, self.tick()))
        self.watch.heartbeat_sent(now)

    def control(self, msg: Message) -> None:
        # guard admitted it: BARRIER releases, ADD_NODE and HEARTBEAT replies come from the scheduler only
        cmd = msg.meta.control.cmd
        if membership.is_barrier_release(msg.meta):
            self.barrier_released = True
        elif cmd == ADD_NODE and self.my_id is not None:
            self._announced(msg)

    def _announced(self, msg: Message) -> None:
        """A later ADD_NODE from the scheduler announces a recovered node: reconnect to it under its (reused) id."""
        assert self.roster is not None and self.my_id is not None
        try:
            workers = self.roster.update(msg.meta)
        except membership.MembershipError as exc:
            log.error("ignoring an ADD_NODE from the scheduler: %s", exc)
            return
        for peer in workers:
            reason = self.guard.update_node(peer.node_id, peer.hostname)
            if reason is not None:
                self.node.van.disconnect(peer.node_id)
                log.error("%s will not be served: %s", peer, reason)
                continue
            try:
                self._connect(peer, identity_of(self.my_id))
            except StartupError as exc:
                log.error("%s", exc)
                continue
            log.info("reconnected to %s at %s:%d", membership.node_name(peer.node_id), peer.hostname, peer.port)

    # ------------------------------------------------------------------------------------------------------------
    # peers and records

    def _set_roster(self, roster: membership.Roster) -> None:
        assert self.my_id is not None
        self.roster = roster
        self.guard.set_roster(roster, self.my_id)

    def _connect(self, peer: membership.Peer, identity: bytes | None) -> None:
        """Open the DEALER to an announced (validated) peer; the scheduler's is watched (a dead scheduler)."""
        self.node.connect(peer.node_id, peer.hostname, peer.port, identity=identity,
                          watch=peer.node_id == membership.SCHEDULER_ID)

    def connect_peers(self) -> None:
        assert self.my_id is not None
        for peer in self.peers:
            if not self.guard.refused(peer.node_id):
                self._connect(peer, identity_of(self.my_id))

    def write_record(self, state: str = "running") -> None:
        assert self.my_id is not None
        recovery.write_record(self.cfg, self.rank, self.my_id, self.port, self.peers, state)

    def status_serving(self) -> None:
        self.status.write("serving", rank=self.rank, node_id=self.my_id, host=self.cfg.host, port=self.port)
