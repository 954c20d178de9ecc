"""The launcher's options, MXNet's tools/launch.py ones (-n, -s, --launcher local|ssh, -H hostfile, --env) and
kvstore_lazy's, and the :class:`Job` an argument list describes.

Owns: the argument parser (``python -m kvstore_lazy.launch --help``) and turning parsed arguments into a Job and
its placer; nothing is started here.
Does not own: running the job (``command``), or what each option sets in a node's environment (``environment``).
"""
from __future__ import annotations

import argparse
import os
import shlex
import sys

from kvstore_lazy.launch.environment import add_restart_settings, add_restore_settings, parse_env
from kvstore_lazy.launch.errors import LaunchError
from kvstore_lazy.launch.job import LAZY_SERVER, STOCK_NODE, Job
from kvstore_lazy.launch.placement import (DEFAULT_PORT, DEFAULT_SERVER_PORT_BASE, LocalPlacer, NetnsPlacer, Placer,
                                           SshPlacer, parse_hostfile, parse_netns_map)


def build_parser(prog: str = "python -m kvstore_lazy.launch") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog,
                                description="Launch a distributed MXNet job with kvstore_lazy servers.")
    p.add_argument("-n", "--num-workers", type=int, required=True)
    p.add_argument("-s", "--num-servers", type=int, default=None, help="default: as many as workers")
    p.add_argument("--launcher", choices=["local", "ssh", "netns"], default="local",
                   help="local: every node on this machine; ssh: nodes on the hosts of -H (servers first, as "
                        "MXNet's launcher), scheduler here; netns: nodes in network namespaces (--netns-map)")
    p.add_argument("-H", "--hostfile", help="ssh: one host per line (host, host:sshport, host slots=N)")
    p.add_argument("--env", action="append", default=[],
                   help="NAME:VALUE[,NAME:VALUE], or NAME to pass its value here, for every node")
    p.add_argument("--env-server", action="append", default=[], help="as --env, servers only")
    p.add_argument("--env-worker", action="append", default=[], help="as --env, workers only")
    p.add_argument("--server", choices=["lazy", "stock"], default="lazy",
                   help="kvstore_lazy servers (default) or MXNet's stock C++ servers")
    p.add_argument("--host", default=None,
                   help="local: the address every node binds (127.0.0.1); ssh: this machine's address the nodes "
                        "reach the scheduler at (default: the one on the route to the first host)")
    p.add_argument("--port", type=int, default=None,
                   help=f"the scheduler's port (default: a free one here; {DEFAULT_PORT} in a namespace or remote)")
    p.add_argument("--netns-map", default="",
                   help="netns: scheduler=NS,server=NS,server1=NS,worker0=NS,... (a rank's entry wins over its "
                        "role's; NS@ADDR gives the address, else it is read from the namespace)")
    p.add_argument("--ssh-command", default="ssh", help="ssh: the ssh client to use (a command line)")
    p.add_argument("--scheduler-host", default=None,
                   help="ssh: run the scheduler over ssh on this host instead of here")
    p.add_argument("--sync-dst-dir", default=None,
                   help="ssh: rsync the current directory to this directory on every host first, and run there")
    p.add_argument("--workdir", default=None, help="ssh: the directory to run in on the hosts (default: this one)")
    p.add_argument("--server-command", default=None,
                   help=f"command line of a server (default: {shlex.join(LAZY_SERVER)})")
    p.add_argument("--scheduler-command", default=None,
                   help=f"command line of the scheduler (default: {shlex.join(STOCK_NODE)})")
    p.add_argument("--snapshot-dir", default=None,
                   help="servers snapshot into this directory (KVSTORE_LAZY_SNAPSHOT_DIR; a path on each server host)")
    p.add_argument("--snapshot-interval", type=float, default=None,
                   help="seconds between periodic server snapshots (KVSTORE_LAZY_SNAPSHOT_INTERVAL)")
    p.add_argument("--restore-from", default=None, metavar="DIR",
                   help="servers of this fresh job start from the snapshots another job wrote in DIR, with any number "
                        "of servers (KVSTORE_LAZY_RESTORE_FROM; needs --snapshot-dir, this job's own)")
    p.add_argument("--restart-servers", type=int, default=0, metavar="N",
                   help="restart a dead kvstore_lazy server up to N times; it rejoins from its snapshot and journal "
                        "(needs --snapshot-dir; turns on KVSTORE_LAZY_JOURNAL and PS_RESEND)")
    p.add_argument("--server-port-base", type=int, default=None,
                   help=f"servers bind PORT=BASE+i (default with --restart-servers: a free port each locally, "
                        f"{DEFAULT_SERVER_PORT_BASE}+i elsewhere)")
    p.add_argument("--timeout", type=float, default=None, help="end the job after this many seconds (status 124)")
    p.add_argument("--grace", type=float, default=5.0, help="seconds between SIGTERM and SIGKILL when stopping")
    p.add_argument("--dry-run", action="store_true", help="print each node's command and environment, start nothing")
    p.add_argument("command", nargs=argparse.REMAINDER)
    return p


def job_from_args(args, out=sys.stdout) -> Job:
    """The Job an argument list describes (no process started)."""
    if not args.command:
        raise LaunchError("give the worker command, e.g. python train.py")
    num_servers = args.num_workers if args.num_servers is None else args.num_servers
    env = parse_env(args.env)
    server_env = parse_env(args.env_server)
    worker_env = parse_env(args.env_worker)
    if args.snapshot_dir:
        server_env["KVSTORE_LAZY_SNAPSHOT_DIR"] = args.snapshot_dir
    if args.snapshot_interval is not None:
        server_env["KVSTORE_LAZY_SNAPSHOT_INTERVAL"] = str(args.snapshot_interval)
    if args.restore_from:
        add_restore_settings(args.restore_from, env, server_env)
    if args.restart_servers:
        add_restart_settings(env, server_env)
    placer = placer_from_args(args, num_servers)
    return Job(command=args.command, num_workers=args.num_workers, num_servers=num_servers, server=args.server,
               host=args.host or "127.0.0.1", env=env, server_env=server_env, worker_env=worker_env, out=out,
               placer=placer, port=args.port,
               server_command=shlex.split(args.server_command) if args.server_command else None,
               scheduler_command=shlex.split(args.scheduler_command) if args.scheduler_command else None,
               restart_servers=args.restart_servers, server_port_base=args.server_port_base, grace=args.grace)


def placer_from_args(args, num_servers: int) -> Placer:
    """Where --launcher puts the nodes (the hostfile is read here)."""
    if args.launcher == "local":
        if args.hostfile:
            raise LaunchError("-H/--hostfile is for --launcher ssh")
        return LocalPlacer(args.host or "127.0.0.1")
    if args.launcher == "netns":
        if not args.netns_map:
            raise LaunchError("--launcher netns needs --netns-map (see scripts/netns_cluster.sh map)")
        return NetnsPlacer(parse_netns_map(args.netns_map), port=args.port or DEFAULT_PORT)
    if not args.hostfile:
        raise LaunchError("--launcher ssh needs -H/--hostfile")
    with open(args.hostfile) as fh:
        hosts = parse_hostfile(fh.read())
    return SshPlacer(hosts, num_servers, ssh_command=shlex.split(args.ssh_command),
                     workdir=args.sync_dst_dir or args.workdir or os.getcwd(), scheduler_host=args.host,
                     remote_scheduler=args.scheduler_host, port=args.port)
