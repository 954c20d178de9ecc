"""Command-line entry points (console scripts in pyproject.toml)."""
from __future__ import annotations

import argparse
import logging
import os
import sys


def server_main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="kvstore-lazy-server",
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
    parser.add_argument("--log-level", default=os.environ.get("KVSTORE_LAZY_LOG_LEVEL", "INFO"))
    parser.add_argument("--ready", nargs="?", const="", default=None, metavar="STATUS_FILE",
                        help="do not run a server: exit 0 if the server writing STATUS_FILE (default: "
                             "$KVSTORE_LAZY_STATUS_FILE) is alive and serving, else 1 (a Kubernetes readiness probe)")
    args = parser.parse_args(argv)
    if args.ready is not None:
        from kvstore_lazy.node.placement import STATUS_ENV, check_ready

        ready, why = check_ready(args.ready or os.environ.get(STATUS_ENV))
        print(("ready: " if ready else "not ready: ") + why)
        return 0 if ready else 1
    for value, name in ((args.materialize, "KVSTORE_LAZY_MATERIALIZE"),
                        (args.metrics_port, "KVSTORE_LAZY_METRICS_PORT"),
                        (args.metrics_bind, "KVSTORE_LAZY_METRICS_BIND")):
        if value is not None:
            os.environ[name] = value   # options are the environment variables' spelling on the command line
    from kvstore_lazy.node import runtime
    from kvstore_lazy.node.runtime import Config, StartupError

    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(runtime.NodeLogFilter())
    handler.setFormatter(logging.Formatter("%(asctime)s kvstore_lazy %(node)s %(levelname)s %(message)s"))
    logging.basicConfig(level=args.log_level.upper(), handlers=[handler])
    try:
        return _run(Config.from_env())
    except StartupError as exc:   # configuration, bind, registration, snapshot: one line and status 2
        logging.getLogger("kvstore_lazy").error("%s", exc)
        return 2


def _run(config) -> int:
    from kvstore_lazy.node.runtime import ServerNode

    profile = os.environ.get("KVSTORE_LAZY_PROFILE", "")
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
