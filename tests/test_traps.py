"""Issue 28, "no silent traps on a user's path": each numbered trap of the issue has a test here that fails on the
code before the fix. Real processes where the trap needs them: a server started as an operator starts it, the
launcher as a user runs it, workers on a private patched copy of the venv's mxnet (tests/mxnet_copy.py, never the
shared venv), the patch tool from a wheel built of this checkout.
(Trap 6, ``KVSTORE_LAZY=false`` switching lazy mode on, is tests/test_patches.py's
test_the_switch_reads_on_off_words_and_refuses_others.)
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SERVER_BASE = {"DMLC_ROLE": "server", "DMLC_PS_ROOT_URI": "127.0.0.1", "DMLC_PS_ROOT_PORT": "1",
               "DMLC_NUM_WORKER": "1", "DMLC_NUM_SERVER": "1"}


def clean_env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DMLC_", "KVSTORE_LAZY", "PS_"))}
    env.update(extra)
    return env


def run_server(**env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvstore_lazy.server"], env=clean_env(**SERVER_BASE, **env),
                          capture_output=True, text=True, timeout=120)


def lines(text: str, level: str) -> list[str]:
    return [line for line in text.splitlines() if f" {level} " in line]


# ---- trap 3: a misspelled variable is ignored silently, and the servers do not log their settings

def test_trap3_a_misspelled_variable_is_named_with_the_one_meant_and_the_settings_are_logged():
    # the start then fails at the bind (an address this host does not have), after the configuration was read
    done = run_server(KVSTORE_LAZY_MATERIALISE="touch", KVSTORE_LAZY_STATS_INTERVAL="5",
                      DMLC_NODE_HOST="kvl-server-0.kvl-server", KVSTORE_LAZY_BIND="192.0.2.1")
    assert done.returncode == 2, done.stderr
    warnings = lines(done.stderr, "WARNING")
    assert any("KVSTORE_LAZY_MATERIALISE is not a kvstore_lazy setting and is ignored: did you mean "
               "KVSTORE_LAZY_MATERIALIZE?" in line for line in warnings), done.stderr
    settings = [line for line in lines(done.stderr, "INFO") if "settings: " in line]
    assert len(settings) == 1, done.stderr
    assert "KVSTORE_LAZY_STATS_INTERVAL=5" in settings[0] and "KVSTORE_LAZY_BIND=192.0.2.1" in settings[0]


# ---- trap 4: a bad value is named badly (neither the variable nor the value), and only after registration

@pytest.mark.parametrize("env, says", [
    ({"KVSTORE_LAZY_MATERIALIZE": "pull"}, "KVSTORE_LAZY_MATERIALIZE='pull': use push or touch"),
    ({"KVSTORE_LAZY_JOURNAL": "maybe"}, "KVSTORE_LAZY_JOURNAL='maybe': use 1/0, true/false, yes/no or on/off"),
    ({"KVSTORE_LAZY_STATS_INTERVAL": "10s"}, "KVSTORE_LAZY_STATS_INTERVAL='10s' is not a number"),
    ({"KVSTORE_LAZY_CHECK_ADDRESS": "nope"}, "KVSTORE_LAZY_CHECK_ADDRESS='nope': use 1/0"),
    ({"KVSTORE_LAZY_LOG_LEVEL": "LOUD"}, "KVSTORE_LAZY_LOG_LEVEL='LOUD': use DEBUG, INFO, WARNING or ERROR"),
])
def test_trap4_a_bad_value_stops_the_server_with_one_line_naming_variable_and_value(env, says):
    done = run_server(**env)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    errors = lines(done.stderr, "ERROR")
    assert len(errors) == 1 and says in errors[0], done.stderr
    assert "registered" not in done.stderr and "scheduler" not in errors[0]
