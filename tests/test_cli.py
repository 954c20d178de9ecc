"""The server's command line: what an operator sees when a server cannot start (one line, a non-zero status)."""
from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

BASE = {"DMLC_ROLE": "server", "DMLC_PS_ROOT_URI": "127.0.0.1", "DMLC_PS_ROOT_PORT": "1", "DMLC_NUM_WORKER": "1",
        "DMLC_NUM_SERVER": "1"}


def run_server(*args: str, **env) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if not k.startswith(("DMLC_", "KVSTORE_LAZY_"))}
    full.update(BASE, **env)
    return subprocess.run([sys.executable, "-m", "kvstore_lazy.server", *args], env=full, capture_output=True,
                          text=True, timeout=120)


@pytest.mark.parametrize("env, says", [
    # an address this host does not have (nothing is sent anywhere: binding fails before the scheduler is dialled)
    ({"DMLC_NODE_HOST": "kvl-server-0.kvl-server", "KVSTORE_LAZY_BIND": "192.0.2.1"},
     "cannot start: could not bind 192.0.2.1"),
    # a DNS name to advertise, but nothing to bind instead (ZeroMQ cannot bind a name)
    ({"DMLC_NODE_HOST": "kvl-no-such-if"}, "DMLC_NODE_HOST='kvl-no-such-if' is a DNS name, which ZeroMQ cannot bind"),
    ({"DMLC_NUM_WORKER": "two"}, "DMLC_NUM_WORKER='two' is not an integer"),
    ({"KVSTORE_LAZY_RECOVERY": "1"}, "need KVSTORE_LAZY_SNAPSHOT_DIR"),
    ({"KVSTORE_LAZY_METRICS_PORT": "9o9o"}, "KVSTORE_LAZY_METRICS_PORT='9o9o' is not a port number"),
    ({"KVSTORE_LAZY_METRICS_PORT": "0", "KVSTORE_LAZY_METRICS_BIND": "kvl-no-such-host.invalid"},
     "cannot start: metrics: cannot listen on kvl-no-such-host.invalid:0"),
])
def test_a_server_that_cannot_start_says_why_in_one_line(env, says):
    done = run_server(**env)
    assert done.returncode == 2, (done.returncode, done.stderr)
    assert "Traceback" not in done.stderr, done.stderr
    errors = [line for line in done.stderr.splitlines() if " ERROR " in line]
    assert len(errors) == 1 and says in errors[0], done.stderr


@pytest.mark.parametrize("how", ["env", "options"])
def test_a_busy_metrics_port_stops_the_server_before_it_registers(how):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        if how == "env":
            done = run_server(KVSTORE_LAZY_METRICS_PORT=str(port), KVSTORE_LAZY_METRICS_BIND="127.0.0.1")
        else:
            done = run_server("--metrics-port", str(port), "--metrics-bind", "127.0.0.1")
    assert done.returncode == 2, (done.returncode, done.stderr)
    errors = [line for line in done.stderr.splitlines() if " ERROR " in line]
    assert len(errors) == 1 and f"cannot start: metrics: cannot listen on 127.0.0.1:{port}" in errors[0], done.stderr
    assert "registering with the scheduler" not in done.stderr
