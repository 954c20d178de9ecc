"""The environment each node of a job gets: the DMLC_* variables ps-lite reads, what is passed from this machine,
and what ``--env NAME:VALUE`` and ``--restart-servers`` add.

Owns: the DMLC_* environment of a node (role, scheduler address, counts, its own host, its task id), which of this
machine's variables go to a node started over ssh (MXNet's ssh launcher's list, plus every ps-lite, MXNet and
kvstore_lazy variable), the parsing of ``--env``, the settings server recovery needs, and what ``--restore-from``
sets.
Does not own: where a node runs (``placement``) or starting it (``job``).

Server recovery (--restart-servers N): a kvstore_lazy server that dies is restarted with KVSTORE_LAZY_RECOVERY=1 at
the same host and port; it rejoins the job from its snapshot and journal (see kvstore_lazy.node.runtime). This needs
--snapshot-dir, and turns on the journal for servers and PS_RESEND for every node.
"""
from __future__ import annotations

import os

from kvstore_lazy.config import c_atoi
from kvstore_lazy.launch.errors import LaunchError

RESEND_TIMEOUT_MS = "3000"      # PS_RESEND_TIMEOUT with --restart-servers: ps-lite aborts after 10 tries = 30 s
# what MXNet's ssh launcher passes from the launching machine, plus the prefixes whose variables configure ps-lite,
# MXNet and kvstore_lazy
PASS_ENV = ["OMP_NUM_THREADS", "KMP_AFFINITY", "LD_LIBRARY_PATH", "DMLC_INTERFACE"]
PASS_PREFIXES = ("PS_", "MXNET_", "KVSTORE_LAZY_")


def passed_env() -> dict:
    """The variables of this machine a node started over ssh gets (a local node inherits all of them)."""
    env = {k: os.environ[k] for k in PASS_ENV if k in os.environ}
    env.update({k: v for k, v in os.environ.items() if k.startswith(PASS_PREFIXES)})
    return env


def node_env(role: str, rank: int, root_host: str, root_port: int | None, num_workers: int, num_servers: int,
             node_host: str, cluster: str, common: dict, extra: dict | None = None) -> dict:
    """The environment of one node: what ps-lite reads to find the scheduler and itself, then the job's `common`
    variables, then the node's `extra` ones (its role's, its PORT)."""
    env = {"DMLC_ROLE": role, "DMLC_PS_ROOT_URI": root_host, "DMLC_PS_ROOT_PORT": str(root_port),
           "DMLC_NUM_WORKER": str(num_workers), "DMLC_NUM_SERVER": str(num_servers),
           "DMLC_NODE_HOST": node_host, "DMLC_TASK_ID": str(rank),
           "DMLC_JOB_CLUSTER": cluster, "PYTHONUNBUFFERED": "1"}
    env.update(common)
    if extra:
        env.update(extra)
    return env


def parse_env(items: list[str], source=None) -> dict:
    """``NAME:VALUE`` / ``NAME=VALUE`` (comma-separated lists too), or ``NAME`` alone for its value here (as
    MXNet's --env passes a variable of the launching machine)."""
    source = os.environ if source is None else source
    env = {}
    for item in items:
        for part in item.split(","):
            if not part:
                continue
            name, sep, value = part.partition(":")
            if not sep:
                name, sep, value = part.partition("=")
            if not sep:
                if part not in source:
                    raise LaunchError(f"--env {part}: not set here (give NAME:VALUE)")
                name, value = part, source[part]
            env[name.strip()] = value
    return env



def add_restart_settings(env: dict, server_env: dict) -> None:
    """What --restart-servers needs, added to the job's `env` and the servers' `server_env`: the journal for
    servers, PS_RESEND for every node (unless set already). LaunchError if there is no snapshot directory or
    PS_RESEND is turned off."""
    if not (server_env.get("KVSTORE_LAZY_SNAPSHOT_DIR") or env.get("KVSTORE_LAZY_SNAPSHOT_DIR")
            or os.environ.get("KVSTORE_LAZY_SNAPSHOT_DIR")):
        raise LaunchError("--restart-servers needs --snapshot-dir (where a restarted server finds its state)")
    server_env["KVSTORE_LAZY_JOURNAL"] = "1"
    for name, value in (("PS_RESEND", "1"), ("PS_RESEND_TIMEOUT", RESEND_TIMEOUT_MS)):
        if name not in env and name not in os.environ:
            env[name] = value
    if c_atoi(env.get("PS_RESEND") or os.environ.get("PS_RESEND", "0")) == 0:
        raise LaunchError("--restart-servers needs PS_RESEND=1 on every node (it is how workers re-send what "
                          "died with a server)")


def add_restore_settings(directory: str, env: dict, server_env: dict) -> None:
    """What --restore-from DIR sets: KVSTORE_LAZY_RESTORE_FROM for the servers. LaunchError without a snapshot
    directory of the job's own (a server restores only at a fresh start with nothing to resume there, and writes
    its own snapshots there: the old job's directory is never written), or if it is the old job's."""
    own = (server_env.get("KVSTORE_LAZY_SNAPSHOT_DIR") or env.get("KVSTORE_LAZY_SNAPSHOT_DIR")
           or os.environ.get("KVSTORE_LAZY_SNAPSHOT_DIR"))
    if not own:
        raise LaunchError("--restore-from needs --snapshot-dir (this job's own snapshot directory)")
    if os.path.abspath(own) == os.path.abspath(directory):
        raise LaunchError(f"--restore-from {directory} is this job's --snapshot-dir: give the new job a directory "
                          f"of its own (or run with the old server count and no --restore-from)")
    server_env["KVSTORE_LAZY_RESTORE_FROM"] = directory
