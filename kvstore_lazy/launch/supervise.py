"""Supervision of a running job and the judgement of how it ended: success, a failed node, or the deadline.

Owns: the supervising loop of :meth:`Job.supervise <kvstore_lazy.launch.job.Job.supervise>`, what counts as a
failure, when a dead server is restarted instead, and the job's exit status.
Does not own: starting or stopping processes (``job``); it calls the job's ``restart`` and ``stop``.

Failure detection: a node that exits (killed, crashed, non-zero status) is noticed within POLL seconds; the job then
ends with a line naming it, and every other process gets SIGTERM, then SIGKILL after --grace seconds. So a dead
node ends the job within POLL + grace (0.05 s + 5 s by default; measured ~0.15 s, as nodes die on SIGTERM). A node
that dies of SIGABRT (how MXNet/ps-lite CHECK failures end) is judged up to ABORT_JUDGE_WAIT (5 s) later: if by then
the scheduler or a server has exited 0, the final barrier was passed and the abort is a known ps-lite teardown race
under PS_RESEND (a warning, the job succeeded). A node that hangs without dying is only caught by --timeout
(status 124); stock ps-lite would leave every other node hanging silently.
"""
from __future__ import annotations

import signal
import time
from typing import Protocol

from kvstore_lazy.launch.process import Node, describe_status
from kvstore_lazy.launch.ranks import RankDiscovery


class Job(Protocol):
    """What the loop uses of :class:`kvstore_lazy.launch.job.Job` (which imports this module)."""
    t0: float
    nodes: list[Node]
    ranks: RankDiscovery
    restart_servers: int
    finish_grace: float

    def stop(self) -> None: ...
    def say(self, line: str) -> None: ...
    def restart(self, node: Node) -> Node: ...
    def _event(self, kind: str, node: Node, detail: str) -> None: ...

POLL = 0.05
ABORT_JUDGE_WAIT = 5.0          # s to wait, after a node aborts, for signs that the job had already finished


class Supervision:
    """One run of the supervising loop over `job`: every POLL seconds, reap the nodes that exited, judge the ones
    that aborted, see whether the job finished or its deadline (`timeout` seconds after the job started) passed."""

    def __init__(self, job: Job, timeout: float | None) -> None:
        self.job = job
        self.timeout = timeout
        self.deadline = None if timeout is None else job.t0 + timeout
        self.finish_by: float | None = None      # set once every worker exited: when to stop waiting for the rest
        self.aborted: list[tuple[Node, str, float]] = []   # (node, what happened, judge by)

    def run(self) -> int:
        """The job's exit status: 0, the failing node's status (128+N for signal N), or 124 on the deadline. Every
        process is stopped on the way out."""
        try:
            while True:
                now = time.monotonic()
                code = self._reap(now)
                if code is None:
                    code = self._judge_aborts(now)
                if code is None:
                    code = self._finished(now)
                if code is not None:
                    return code
                if self.finish_by is None:
                    self.job.ranks.learn(every=0.5)
                code = self._past_deadline(now)
                if code is not None:
                    return code
                time.sleep(POLL)
        finally:
            self.job.stop()

    def _reap(self, now: float) -> int | None:
        """Note every node that exited since the last look; a failure's status if one ends the job."""
        job = self.job
        for node in list(job.nodes):
            code = node.popen.poll()
            if code is None or node.ended is not None:
                continue
            node.ended = now
            job._event("exited", node, str(code))
            if code == 0:
                continue
            rank = "" if node.ps_rank is None else f", rank {node.ps_rank}"
            what = f"{node.name} (pid {node.pid} on {node.placement.where}{rank}) {describe_status(code)}"
            if code == -signal.SIGABRT and node.role != "scheduler":
                # judged below, once it is clear whether the final barrier was done
                self.aborted.append((node, what, now + ABORT_JUDGE_WAIT))
                continue
            if node.role == "server" and node.restarts < job.restart_servers and self.finish_by is None:
                job.say(f"{what}; restarting it (restart {node.restarts + 1} of {job.restart_servers}) to "
                        f"rejoin the job from its snapshot and journal")
                job.restart(node)
                continue
            job._event("failed", node, what)
            job.say(f"ERROR: {what}; stopping the job")
            return code if code > 0 else 128 - code
        return None

    def _judge_aborts(self, now: float) -> int | None:
        """An aborted node is a shutdown race once the final barrier is done, a failure once its wait is over."""
        job = self.job
        for entry in list(self.aborted):
            node, what, judge_by = entry
            if final_barrier_done(job):
                # The scheduler and the servers exit 0 only after the final barrier: training is over.
                # Under PS_RESEND, ps-lite 34fd45c's Resender can abort a node while it tears down (its
                # monitor thread wakes after ready_=false and CHECKs it, or resends a final BARRIER the
                # departed scheduler never ACKed): not a failure of the job.
                self.aborted.remove(entry)
                job._event("shutdown-abort", node, what)
                job.say(f"WARNING: {what} after the final barrier (a ps-lite shutdown race under "
                        f"PS_RESEND); training had completed")
            elif now > judge_by:
                job._event("failed", node, what)
                job.say(f"ERROR: {what}; stopping the job")
                return 128 + signal.SIGABRT
        return None

    def _finished(self, now: float) -> int | None:
        """0 once every worker is done and the rest exited, or did not within the job's finish_grace."""
        job = self.job
        workers = [n for n in job.nodes if n.role == "worker"]
        if self.finish_by is None and not self.aborted and all(n.ended is not None for n in workers):
            self.finish_by = now + job.finish_grace
            job._event("workers-done", workers[0] if workers else job.nodes[0], "")
        if self.finish_by is not None:
            if all(n.ended is not None for n in job.nodes):
                return 0
            if now > self.finish_by:
                running = ", ".join(n.name for n in job.nodes if n.ended is None)
                job.say(f"WARNING: every worker finished, but {running} did not exit within "
                        f"{job.finish_grace:.0f}s; stopping them")
                return 0
        return None

    def _past_deadline(self, now: float) -> int | None:
        if self.deadline is None or now <= self.deadline:
            return None
        job = self.job
        running = ", ".join(n.name for n in job.nodes if n.ended is None)
        job._event("deadline", job.nodes[0], running)
        job.say(f"ERROR: deadline of {self.timeout:.0f}s reached; still running: {running}; stopping the job")
        return 124


def final_barrier_done(job: Job) -> bool:
    """The scheduler and the servers exit 0 only once the final group barrier released everyone."""
    return any(n.role in ("scheduler", "server") and n.ended is not None and n.popen.returncode == 0
               for n in job.nodes)
