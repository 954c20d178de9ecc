"""The command line: ``kvstore-lazy <command>`` (or ``python -m kvstore_lazy <command>``), and the server's own
``kvstore-lazy-server`` (``python -m kvstore_lazy.server``).

Owns: the list of commands, the server's options (each one an environment variable's spelling), and the readiness
probe's exit status. Each command delegates to the room that does the work: ``server`` to kvstore_lazy.node.runtime,
``launch`` to kvstore_lazy.launch, ``densify`` and ``inspect`` to kvstore_lazy.persist.densify, ``reshard`` to
kvstore_lazy.persist.reshard, ``ready`` to kvstore_lazy.node.placement, ``patch`` to kvstore_lazy.worker.patch.
Those are imported only when their command runs: a server process does not load the launcher or the checkpoint
tools, and neither ``densify`` nor ``patch`` imports mxnet.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Callable

from kvstore_lazy.config import BY_NAME, ConfigError, choice


def server_main(argv: list[str] | None = None, prog: str = "kvstore-lazy-server") -> int:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Run a kvstore_lazy parameter server. It reads the same DMLC_* environment as a stock MXNet "
                    "server (DMLC_PS_ROOT_URI, DMLC_PS_ROOT_PORT, DMLC_NUM_WORKER, DMLC_NUM_SERVER, "
                    "DMLC_NODE_HOST, PS_HEARTBEAT_INTERVAL, PS_RESEND, ...).")
    parser.add_argument("--materialize", choices=["touch", "push"], default=None,
                        help="when a lazy row is stored: only on its first push (push, the default: pulls of "
                             "absent rows get computed initial values) or on its first pull or push (touch). "
                             "Env: KVSTORE_LAZY_MATERIALIZE")
    parser.add_argument("--metrics-port", metavar="PORT", default=None,
                        help="serve Prometheus metrics on PORT (0: any free port, logged). "
                             "Env: KVSTORE_LAZY_METRICS_PORT")
    parser.add_argument("--metrics-bind", metavar="ADDRESS", default=None,
                        help="address the metrics listen on (default 0.0.0.0; 127.0.0.1 under DMLC_LOCAL). "
                             "Env: KVSTORE_LAZY_METRICS_BIND")
    parser.add_argument("--log-level", choices=list(BY_NAME["KVSTORE_LAZY_LOG_LEVEL"].choices), type=str.upper,
                        default=None, help="the server's log level (default INFO). Env: KVSTORE_LAZY_LOG_LEVEL")
    parser.add_argument("--ready", nargs="?", const="", default=None, metavar="STATUS_FILE",
                        help="do not run a server: exit 0 if the server writing STATUS_FILE (default: "
                             "$KVSTORE_LAZY_STATUS_FILE) is alive and serving, else 1 (a Kubernetes readiness probe)")
    args = parser.parse_args(argv)
    if args.ready is not None:
        return _probe(args.ready)
    env = dict(os.environ)   # options are the environment variables' spelling on the command line: they win
    for value, name in ((args.materialize, "KVSTORE_LAZY_MATERIALIZE"),
                        (args.metrics_port, "KVSTORE_LAZY_METRICS_PORT"),
                        (args.metrics_bind, "KVSTORE_LAZY_METRICS_BIND")):
        if value is not None:
            env[name] = value
    from kvstore_lazy.node import runtime
    from kvstore_lazy.node.runtime import Config, StartupError

    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(runtime.NodeLogFilter())
    handler.setFormatter(logging.Formatter("%(asctime)s kvstore_lazy %(node)s %(levelname)s %(message)s"))
    bad_level: ConfigError | None = None
    try:
        level = args.log_level or choice(env, "KVSTORE_LAZY_LOG_LEVEL")
    except ConfigError as exc:
        level, bad_level = "INFO", exc
    logging.basicConfig(level=level, handlers=[handler])
    try:
        if bad_level is not None:
            raise StartupError(str(bad_level))
        return _run(Config.from_env(env))
    except StartupError as exc:   # configuration, bind, registration, snapshot: one line and status 2
        logging.getLogger("kvstore_lazy").error("%s", exc)
        return 2


def _run(config) -> int:
    from kvstore_lazy.node.runtime import ServerNode

    profile = config.profile
    if not profile:
        return ServerNode(config).run()
    # KVSTORE_LAZY_PROFILE=PREFIX: run under cProfile (CPU time, so a loaded machine does not inflate it), write
    # PREFIX.<pid>.prof at a normal exit (scripts/bench.py --profile)
    import cProfile
    import time

    profiler = cProfile.Profile(time.process_time)
    try:
        return profiler.runcall(ServerNode(config).run)
    finally:
        profiler.dump_stats(f"{profile}.{os.getpid()}.prof")


def _probe(status_file: str) -> int:
    """The readiness probe: 0 if the server writing `status_file` ('' for $KVSTORE_LAZY_STATUS_FILE) is alive and
    serving, else 1; one line saying why."""
    from kvstore_lazy.node.placement import STATUS_ENV, check_ready

    ready, why = check_ready(status_file or os.environ.get(STATUS_ENV))
    print(("ready: " if ready else "not ready: ") + why)
    return 0 if ready else 1


def ready_main(argv: list[str] | None = None, prog: str = "kvstore-lazy ready") -> int:
    parser = argparse.ArgumentParser(
        prog=prog, description="Exit 0 if the kvstore_lazy server writing STATUS_FILE is alive and serving, else 1 "
                               "(a Kubernetes readiness probe; the same as kvstore-lazy server --ready).")
    parser.add_argument("status_file", nargs="?", default="", metavar="STATUS_FILE",
                        help="the server's status file (default: $KVSTORE_LAZY_STATUS_FILE)")
    return _probe(parser.parse_args(argv).status_file)


def _launch(argv: list[str], prog: str) -> int:
    from kvstore_lazy.launch import main as launch_main

    return launch_main(argv, prog=prog)


def _densify(argv: list[str], prog: str) -> int:
    from kvstore_lazy.persist.densify import densify_main

    return densify_main(argv, prog=prog)


def _inspect(argv: list[str], prog: str) -> int:
    from kvstore_lazy.persist.densify import inspect_main

    return inspect_main(argv, prog=prog)


def _reshard(argv: list[str], prog: str) -> int:
    from kvstore_lazy.persist.reshard import reshard_main

    return reshard_main(argv, prog=prog)


def _patch(argv: list[str], prog: str) -> int:
    from kvstore_lazy.worker.patch import main as patch_main

    return patch_main(argv, prog=prog)


# name -> (one line of help, the command: (arguments after its name, prog) -> exit status)
COMMANDS: dict[str, tuple[str, Callable[[list[str], str], int]]] = {
    "server": ("run a kvstore_lazy parameter server (a drop-in for a stock MXNet server)", server_main),
    "launch": ("launch a distributed MXNet job: the stock scheduler, kvstore_lazy servers, your workers", _launch),
    "densify": ("write a stock MXNet file with the absent rows of a checkpoint's lazy parameters filled in",
                _densify),
    "inspect": ("print what a checkpoint file (and its sidecar) or a server snapshot directory holds", _inspect),
    "reshard": ("write a server snapshot directory for another number of servers (grow or shrink a job)",
                _reshard),
    "ready": ("exit 0 if the server writing a status file is alive and serving (a readiness probe)", ready_main),
    "patch": ("apply (--check, --revert) the Gluon/Module patches to this Python's mxnet 1.9.1 (for KVSTORE_LAZY=1)",
              _patch),
}


def main(argv: list[str] | None = None) -> int:
    """``kvstore-lazy <command> [options]``: each command's ``--help`` says what it takes."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in COMMANDS:
        return COMMANDS[argv[0]][1](argv[1:], f"kvstore-lazy {argv[0]}")
    parser = argparse.ArgumentParser(prog="kvstore-lazy", description="kvstore_lazy: a drop-in parameter server for "
                                     "MXNet 1.9.1, its launcher and its checkpoint tools.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (help_text, _) in COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    parser.parse_args(argv)   # --help, or a missing or unknown command: the usage, and status 0 or 2
    return 2
