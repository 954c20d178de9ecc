"""What the launcher decides and checks before it starts a process (issue 28: no silent traps on a user's path).

Owns:
- what ``--server`` means whatever the environment says (:func:`overrides`): ``--server stock`` runs MXNet's own
  servers even with ``KVSTORE_LAZY=1`` in the environment (a patched mxnet would otherwise turn each "stock" server
  into a kvstore_lazy one, and a comparison with stock would compare lazy with lazy): servers and the scheduler get
  ``KVSTORE_LAZY=0``, and workers that have the switch on get ``KVSTORE_LAZY_SERVERS=stock`` (they then ship full
  weights holding the lazy initial values, which a stock server cannot compute). Asking for both (``--server stock``
  with ``--env-server KVSTORE_LAZY=1``) is refused;
- the one line saying what the job runs (:func:`describe`);
- the settings every node would read, checked with kvstore_lazy.config's readers before anything starts
  (:func:`check_settings`: a bad value is refused by name, an unknown ``KVSTORE_LAZY_*`` name is warned about);
- that the workers' mxnet is patched when their switch is on (:func:`check_workers_patched`): an unpatched mxnet
  ignores ``KVSTORE_LAZY=1``, and the job would run with full weights and no sidecar and nothing saying so.
  Checked for workers on this machine (``local``, ``netns``), with the workers' own Python and environment; on
  hosts reached over ssh, ``kvstore-lazy patch --check`` run there says the same.
Does not own: the options (``options``), a node's environment (``environment``), the patches
(``kvstore_lazy.worker.patch``).
"""
from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
from collections.abc import Mapping

from kvstore_lazy import config
from kvstore_lazy.launch.errors import LaunchError

STOCK_SERVERS = "stock"
# the interpreter names of a worker command that runs Python (python, python3, python3.11)
_PYTHON = re.compile(r"python[0-9.]*$")
# run by the workers' Python: where its mxnet is and what state kvstore_lazy.worker.patch finds it in (an empty first
# line: no mxnet)
_ASK_PATCH = ("from kvstore_lazy.worker import patch\n"
              "try:\n    where = patch.find_mxnet()\nexcept patch.PatchError:\n    print('')\n"
              "else:\n    try:\n        print(where); print(patch.state(where))\n"
              "    except patch.PatchError as exc:\n        print(f'not checkable ({exc})')\n")


def _merged(*layers: Mapping[str, str]) -> dict:
    out: dict = {}
    for layer in layers:
        out.update(layer)
    return out


def worker_switch(env: dict, worker_env: dict, base: Mapping[str, str] | None = None) -> bool:
    """Whether the workers have KVSTORE_LAZY on (this machine's environment, then --env, then --env-worker)."""
    try:
        return config.boolean(_merged(os.environ if base is None else base, env, worker_env), "KVSTORE_LAZY")
    except config.ConfigError as exc:
        raise LaunchError(str(exc)) from None


def overrides(server: str, env: dict, server_env: dict, worker_env: dict,
              base: Mapping[str, str] | None = None) -> dict[str, dict]:
    """role -> the variables the launcher sets for it over --env/--env-<role>, so that --server means what it says."""
    out: dict[str, dict] = {"scheduler": {}, "server": {}, "worker": {}}
    if server != STOCK_SERVERS:
        if worker_switch(env, worker_env, base) and _stock_servers_asked(_merged(env, worker_env)):
            raise LaunchError("KVSTORE_LAZY_SERVERS=stock but --server lazy: drop the variable, or use --server "
                              "stock to run MXNet's servers")
        return out
    try:
        asked = config.boolean(server_env, "KVSTORE_LAZY")
    except config.ConfigError as exc:
        raise LaunchError(str(exc)) from None
    if asked:
        raise LaunchError("--server stock runs MXNet's own servers, but --env-server sets KVSTORE_LAZY on for them "
                          "(which would make them kvstore_lazy servers): drop one of the two")
    out["scheduler"]["KVSTORE_LAZY"] = out["server"]["KVSTORE_LAZY"] = "0"
    if worker_switch(env, worker_env, base):
        out["worker"]["KVSTORE_LAZY_SERVERS"] = STOCK_SERVERS
    return out


def _stock_servers_asked(env: dict) -> bool:
    try:
        return config.choice(env, "KVSTORE_LAZY_SERVERS") == STOCK_SERVERS
    except config.ConfigError as exc:
        raise LaunchError(str(exc)) from None


def describe(num_workers: int, num_servers: int, server: str, server_command: list[str] | None, switch: bool) -> str:
    """What the job runs, in words: the banner's first half."""
    if server_command:
        servers = f"{num_servers} servers running {shlex.join(server_command)}"
    elif server == STOCK_SERVERS:
        servers = f"{num_servers} stock MXNet servers"
    else:
        servers = f"{num_servers} kvstore_lazy servers"
    if not switch:
        workers = f"{num_workers} workers (KVSTORE_LAZY off: stock mxnet)"
    elif server == STOCK_SERVERS:
        workers = (f"{num_workers} workers (KVSTORE_LAZY=1 with stock servers: full row_sparse weights holding the "
                   f"lazy initial values)")
    else:
        workers = f"{num_workers} workers (KVSTORE_LAZY=1: row_sparse weights declared lazily)"
    return f"{workers}, {servers}"


def check_settings(node_envs: list[tuple[str, dict]]) -> list[str]:
    """Check the settings each node will read ((role, the variables the launcher sets for it) over this machine's
    environment): LaunchError naming the first bad value; returns one warning per unknown KVSTORE_LAZY_* name."""
    warnings: list[str] = []
    for role, env in node_envs:
        full = _merged(os.environ, env)
        try:
            config.check(full, role if role in ("server", "worker") else "launcher")
        except config.ConfigError as exc:
            raise LaunchError(f"{role}s: {exc}") from None
        warnings += [w for w in config.unknown_warnings(full) if w not in warnings]
    return warnings


def check_workers_patched(argv: list[str], env: dict) -> None:
    """LaunchError if a worker running `argv` with environment `env` (as this machine starts it) would import an
    mxnet that is not patched while its KVSTORE_LAZY is on. Asked of the workers' own Python (kvstore_lazy.worker.patch
    there, which imports neither mxnet nor anything of the launcher's): a command that is not a Python interpreter
    (a shell script), or one that cannot be run here, is not checked."""
    if not argv or not _PYTHON.match(os.path.basename(argv[0])):
        return
    python = shutil.which(argv[0], path=env.get("PATH")) or argv[0]
    try:
        found = subprocess.run([python, "-c", _ASK_PATCH], env=env, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return
    fix = f"{python} -m kvstore_lazy.worker.patch"
    if found.returncode != 0:
        if "No module named 'kvstore_lazy" in found.stderr:
            raise LaunchError(f"KVSTORE_LAZY=1 but kvstore_lazy is not importable in the workers' Python ({python}), "
                              f"so a patched mxnet could not use it: install kvstore-lazy there, then `{fix}`")
        return
    where, _, state = found.stdout.strip().partition("\n")
    if not where:
        raise LaunchError(f"KVSTORE_LAZY=1 but the workers' Python ({python}) has no mxnet: install "
                          f"'kvstore-lazy[worker]' there, then `{fix}`")
    if state != "patched":
        raise LaunchError(f"KVSTORE_LAZY=1 but the mxnet the workers import ({where}) is {state}: the switch would "
                          f"have no effect (full weights shipped to the servers, no sidecar beside the checkpoints). "
                          f"Patch it with `{fix}` (kvstore-lazy patch in that Python), or unset KVSTORE_LAZY")
