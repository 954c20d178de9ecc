"""``python -m kvstore_lazy.launch`` (and ``kvstore-lazy launch``): parse the options, then print the nodes
(--dry-run) or sync the working directory (ssh), run the job, supervise it and exit with its status.

Owns: the launcher's process-level behaviour: signals (SIGINT, SIGTERM, SIGHUP stop every node; the status is then
128 + the signal) and the launcher's first and last lines.
Does not own: what the options mean (``options``) or how the job is watched (``supervise``).

Run: ``python -m kvstore_lazy.launch -n 2 -s 2 python train.py``.
"""
from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys

from kvstore_lazy.launch.preflight import check_settings, check_workers_patched
from kvstore_lazy.launch.errors import LaunchError
from kvstore_lazy.launch.job import LAZY_SERVER, Job
from kvstore_lazy.launch.options import build_parser, job_from_args
from kvstore_lazy.launch.placement import SshPlacement, SshPlacer


def main(argv: list[str] | None = None, prog: str = "python -m kvstore_lazy.launch") -> int:
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    try:
        job = job_from_args(args)
    except (LaunchError, OSError) as exc:
        parser.error(str(exc))
    if args.dry_run:
        print_nodes(job)
        return 0
    try:
        for warning in check(job):
            job.say(f"warning: {warning}")
    except LaunchError as exc:   # one line, no usage: the options were fine, what they would run is not
        print(f"{parser.prog}: error: {exc}", file=sys.stderr)
        return 2
    if args.launcher == "ssh" and args.sync_dst_dir:
        assert isinstance(job.placer, SshPlacer)
        for cmd in job.placer.sync_commands(os.getcwd(), args.sync_dst_dir):
            job.say(f"sync: {shlex.join(cmd)}")
            if subprocess.run(cmd).returncode != 0:
                job.say("ERROR: rsync failed")
                return 1
    job.say(f"{job.describe()} ({args.launcher}): {shlex.join(args.command)}")
    code = run(job, args.timeout)
    job.say(f"job finished with status {code}")
    return code


def check(job: Job) -> list[str]:
    """Before anything starts (kvstore_lazy.launch.preflight): the settings every node will read, and the workers'
    mxnet when their switch is on. LaunchError for what would fail or do nothing; returns warnings to show."""
    first: dict[str, tuple] = {}
    for role, _, placement, argv, env in job.node_specs():
        first.setdefault(role, (placement, argv, env))   # the nodes of a role differ only in their DMLC_* and PORT
    checked = [(role, env) for role, (_, _, env) in first.items() if role != "scheduler"]
    if job.server != "lazy" or job.server_command != LAZY_SERVER:
        checked = [(role, env) for role, env in checked if role != "server"]   # not ours to read
    warnings = check_settings(checked)
    placement, argv, env = first["worker"]
    if job.worker_switch and not isinstance(placement, SshPlacement):
        check_workers_patched(argv, placement.command(argv, env)[1])
    return warnings


def print_nodes(job: Job) -> None:
    """--dry-run: each node's command and environment, nothing started."""
    for role, rank, placement, node_argv, env in job.node_specs():
        local_argv, _ = placement.command(node_argv, env)
        print(f"# {role} {rank} on {placement.where}")
        print(shlex.join(local_argv) if isinstance(placement, SshPlacement) else
              " ".join(f"{k}={shlex.quote(str(v))}" for k, v in env.items()) + " " + shlex.join(local_argv))


def run(job: Job, timeout: float | None) -> int:
    """Start and supervise `job`; a signal stops every process. Returns the job's status."""
    # SIGINT too: a launcher started in the background of a non-interactive shell inherits SIGINT ignored, and an
    # explicit `kill -INT` must still stop the job
    previous = {sig: signal.signal(sig, _interrupt) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        job.start()
        code = job.supervise(timeout)
    except KeyboardInterrupt:
        signum = _received[-1] if _received else signal.SIGINT
        job.say(f"interrupted ({signal.Signals(signum).name}); stopping every process")
        job.stop()
        code = 128 + signum
    except BaseException:
        job.stop()
        raise
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return code


_received: list[int] = []


def _interrupt(signum, frame):
    _received.append(signum)
    raise KeyboardInterrupt()

