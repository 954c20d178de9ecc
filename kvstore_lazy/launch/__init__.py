"""Launch a distributed MXNet job: the stock scheduler, kvstore_lazy (or stock) servers, and the user's command as
workers. Options follow MXNet's tools/launch.py (-n, -s, --launcher local|ssh, -H hostfile, --env), on Python 3.11.

Owns (one module each): the options and the Job they describe (``options``), the DMLC_* environment of each node
(``environment``), where nodes run: on this machine, in a network namespace, or over ssh (``placement``), one
started process (``process``), ps-lite rank discovery (``ranks``), the job's processes (``job``), supervision and
failure judgement (``supervise``), and the command line: signals, dry runs, the exit status (``command``). Every
process the launcher starts is in its own process group (and, where ``setpriv`` exists, dies with the launcher); it
is ended by PID when the job ends: on success, on Ctrl-C or SIGTERM, on a deadline, or as soon as any node fails
(stock ps-lite would leave every other node hanging silently). Each node's output is streamed with a prefix, and
the launcher's own lines ("[launch +3.21s] ...") say what happened and when.

This package re-exports the names scripts and tests use (``from kvstore_lazy.launch import Job``).

Run: ``python -m kvstore_lazy.launch -n 2 -s 2 python train.py`` (or ``kvstore-lazy launch ...``).
"""
from __future__ import annotations

from kvstore_lazy.launch.command import main
from kvstore_lazy.launch.environment import PASS_ENV, PASS_PREFIXES, RESEND_TIMEOUT_MS, node_env, parse_env
from kvstore_lazy.launch.errors import LaunchError
from kvstore_lazy.launch.job import LAZY_SERVER, STOCK_NODE, Job
from kvstore_lazy.launch.options import build_parser, job_from_args
from kvstore_lazy.launch.placement import (DEFAULT_PORT, DEFAULT_SERVER_PORT_BASE, SSH_OPTIONS, LocalPlacer,
                                           NetnsPlacement, NetnsPlacer, Placement, Placer, SshPlacement, SshPlacer,
                                           free_port, namespace_address, outbound_ip, parse_hostfile,
                                           parse_netns_map)
from kvstore_lazy.launch.process import LineSink, Node, describe_status
from kvstore_lazy.launch.ranks import REGISTERED, SERVER_PREFIX, RankDiscovery, listening_ports, pslite_rank_order
from kvstore_lazy.launch.supervise import ABORT_JUDGE_WAIT, POLL, Supervision

__all__ = [
    "ABORT_JUDGE_WAIT", "DEFAULT_PORT", "DEFAULT_SERVER_PORT_BASE", "LAZY_SERVER", "PASS_ENV", "PASS_PREFIXES",
    "POLL", "REGISTERED", "RESEND_TIMEOUT_MS", "SERVER_PREFIX", "SSH_OPTIONS", "STOCK_NODE",
    "Job", "LaunchError", "LineSink", "LocalPlacer", "NetnsPlacement", "NetnsPlacer", "Node", "Placement", "Placer",
    "RankDiscovery", "SshPlacement", "SshPlacer", "Supervision",
    "build_parser", "describe_status", "free_port", "job_from_args", "listening_ports", "main", "namespace_address",
    "node_env", "outbound_ip", "parse_env", "parse_hostfile", "parse_netns_map", "pslite_rank_order",
]
