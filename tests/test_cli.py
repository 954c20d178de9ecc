"""The server's command line: what an operator sees when a server cannot start (one line, a non-zero status)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

BASE = {"DMLC_ROLE": "server", "DMLC_PS_ROOT_URI": "127.0.0.1", "DMLC_PS_ROOT_PORT": "1", "DMLC_NUM_WORKER": "1",
        "DMLC_NUM_SERVER": "1"}


def run_server(**env) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if not k.startswith(("DMLC_", "KVSTORE_LAZY_"))}
    full.update(BASE, **env)
    return subprocess.run([sys.executable, "-m", "kvstore_lazy.server"], env=full, capture_output=True, text=True,
                          timeout=120)


@pytest.mark.parametrize("env, says", [
    # an address this host does not have (nothing is sent anywhere: binding fails before the scheduler is dialled)
    ({"DMLC_NODE_HOST": "kvl-server-0.kvl-server", "KVSTORE_LAZY_BIND": "192.0.2.1"},
     "cannot start: could not bind 192.0.2.1"),
    # a DNS name to advertise, but nothing to bind instead (ZeroMQ cannot bind a name)
    ({"DMLC_NODE_HOST": "kvl-no-such-if"}, "DMLC_NODE_HOST='kvl-no-such-if' is a DNS name, which ZeroMQ cannot bind"),
    ({"DMLC_NUM_WORKER": "two"}, "DMLC_NUM_WORKER='two' is not an integer"),
    ({"KVSTORE_LAZY_RECOVERY": "1"}, "need KVSTORE_LAZY_SNAPSHOT_DIR"),
])
def test_a_server_that_cannot_start_says_why_in_one_line(env, says):
    done = run_server(**env)
    assert done.returncode == 2, (done.returncode, done.stderr)
    assert "Traceback" not in done.stderr, done.stderr
    errors = [line for line in done.stderr.splitlines() if " ERROR " in line]
    assert len(errors) == 1 and says in errors[0], done.stderr
