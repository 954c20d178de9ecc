"""Every environment variable the project reads, in one table, and the one way each is read.

Owns: :data:`VARIABLES` (name, kind, default, who reads it, what it does: the docs' reference page is generated from
it, and a test fails when the code reads a ``KVSTORE_LAZY_*`` name this table lacks); :class:`ConfigError`, the one
error a bad setting raises (its message names the variable, the value given and what is accepted); the strict readers
(:func:`read`, :func:`boolean`, :func:`integer`, ...); :func:`unknown` (a misspelled ``KVSTORE_LAZY_*`` name and the
known one it most likely meant); :func:`summary` (the effective settings in one log line).
Does not own: what a setting means to the code that uses it (the server's ``Config``, the row lifecycle's
``Settings``, the launcher's options build their frozen settings from these readers).

ps-lite's own variables (``DMLC_*``, ``PS_*``) are read as ps-lite reads them, with C ``atoi`` (:func:`c_atoi`):
``PS_RESEND=true`` is 0 for a stock node, so it must be for ours too, or the two would disagree about one job.
"""
from __future__ import annotations

import difflib
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["ConfigError", "Variable", "VARIABLES", "BY_NAME", "PREFIX", "read", "boolean", "integer", "number",
           "choice", "check", "unknown", "unknown_warnings", "summary", "c_atoi", "atoi_flag", "flag"]

PREFIX = "KVSTORE_LAZY_"
TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")


class ConfigError(ValueError):
    """A setting that cannot be honoured: one line naming the variable, the value and what is accepted."""


@dataclass(frozen=True)
class Variable:
    """One environment variable: ``kind`` is how its text is read (bool, int, float, seconds, bytes, choice, text,
    path, networks, port, atoi); ``default`` is the text an unset variable means ("" = unset: off / none);
    ``readers`` are the processes that read it (server, worker, launcher)."""
    name: str
    kind: str
    default: str
    readers: tuple[str, ...]
    doc: str
    choices: tuple[str, ...] = ()


def _v(name: str, kind: str, default: str, readers: str, doc: str, choices: tuple[str, ...] = ()) -> Variable:
    return Variable(name, kind, default, tuple(readers.split(",")), doc, choices)


VARIABLES: tuple[Variable, ...] = (
    # --- the switch and what a worker computes
    _v("KVSTORE_LAZY", "bool", "0", "worker,server",
       "The switch of the patched mxnet: on, the Gluon/Module hooks declare row_sparse weights lazily and a "
       "`DMLC_ROLE=server` process becomes a kvstore_lazy server; off, mxnet is stock."),
    _v("KVSTORE_LAZY_SEED", "int", "0", "worker",
       "Seed of the lazy initial values: a row's initial value is a pure function of (seed, key, row id). An "
       "integer from -2**63 to 2**64-1, read when the first hook runs (the first `initialize()`)."),
    _v("KVSTORE_LAZY_SERVERS", "choice", "lazy", "worker",
       "What serves the job the workers of the patched mxnet are in: `lazy` (kvstore_lazy servers: row_sparse "
       "weights are declared lazily) or `stock` (MXNet's own servers: the workers ship full row_sparse weights "
       "holding the values lazy servers would have computed, so the two runs can be compared loss for loss). "
       "`python -m kvstore_lazy.launch --server stock` sets it for workers that have the switch on.",
       ("lazy", "stock")),
    # --- the server: requests and rows
    _v("KVSTORE_LAZY_MATERIALIZE", "choice", "push", "server",
       "When a lazy row is stored: `push` (only on its first push; a pull of an absent row is answered with its "
       "computed initial value) or `touch` (on its first pull or push).", ("push", "touch")),
    _v("KVSTORE_LAZY_STATS_INTERVAL", "seconds", "60", "server",
       "Seconds between log lines with rows and bytes per lazy key (also logged at shutdown)."),
    _v("KVSTORE_LAZY_LOG_LEVEL", "choice", "INFO", "server",
       "The server's log level.", ("DEBUG", "INFO", "WARNING", "ERROR")),
    _v("KVSTORE_LAZY_PROFILE", "path", "", "server",
       "Run the server under cProfile and write PREFIX.<pid>.prof at a normal exit (benchmarks)."),
    # --- row lifecycle and the memory budget
    _v("KVSTORE_LAZY_ADMIT_MIN_COUNT", "int", "1", "server",
       "Default policy of lazy keys: pushes a row needs before it is stored (1: the first)."),
    _v("KVSTORE_LAZY_ADMIT_PROB", "float", "1", "server",
       "Default policy of lazy keys: probability that a row reaching the count is admitted (deterministic coin)."),
    _v("KVSTORE_LAZY_TTL_ROUNDS", "int", "0", "server",
       "Default policy of lazy keys: a row not pushed for this many of its key's rounds is removed (0: off)."),
    _v("KVSTORE_LAZY_TTL_SECONDS", "float", "0", "server",
       "Default policy of lazy keys: a row not pushed for this many seconds is removed (0: off)."),
    _v("KVSTORE_LAZY_ADMIT_CAP", "int", "1048576", "server",
       "Ids waiting for admission kept per key per server; over it the ones counted longest ago are forgotten."),
    _v("KVSTORE_LAZY_MEMORY_BUDGET", "bytes", "", "server",
       "Per server: bytes the server's rows and the buffers of its phases may take (`512MiB`, `8GiB`); past it, "
       "less the share kept for the buffers (1/8 of what is over 32 MiB, at most 128 MiB), the lowest-scoring rows "
       "of every lazy key go (evicted, or to the disk tier)."),
    _v("KVSTORE_LAZY_EVICT", "choice", "lru", "server",
       "Which rows the budget removes first: least recently (`lru`) or least frequently (`lfu`) pushed.",
       ("lru", "lfu")),
    _v("KVSTORE_LAZY_LOW_WATERMARK", "float", "0.9", "server",
       "Share of the budget a budget pass brings the tables down to (0.98 by default with a disk tier)."),
    # --- the disk tier
    _v("KVSTORE_LAZY_DISK_DIR", "path", "", "server",
       "A directory for the disk tier: rows the budget pushes out of memory go there instead of being lost. "
       "Needs KVSTORE_LAZY_MEMORY_BUDGET."),
    _v("KVSTORE_LAZY_DISK_SEGMENT_ROWS", "int", "65536", "server",
       "Records per disk-tier segment file (a power of two)."),
    _v("KVSTORE_LAZY_DISK_COMPACT", "float", "0.25", "server",
       "Garbage share of the disk tier past which its emptiest sealed segments are compacted."),
    _v("KVSTORE_LAZY_DISK_ADMIT_WINDOW", "int", "0", "server",
       "Rounds: a row on disk comes back into memory only if pushed in its key's last W rounds (0: always)."),
    _v("KVSTORE_LAZY_CATCHUP", "choice", "exact", "server",
       "How a row of a key under an optimizer stock runs densely (lazy_update=False, NAG, Signum, RMSProp) is "
       "brought over the steps it missed: `exact` replays them in float32, bit-identical to stock; `closed` uses "
       "closed forms for the linear rules (SGD, SGD momentum, NAG, signSGD: a few matrix products however many "
       "steps, within the tolerance the docs state); the others are always replayed.", ("exact", "closed")),
    _v("KVSTORE_LAZY_ADAM_ROW_STEPS", "bool", "0", "server",
       "Beyond stock: under lazy Adam (lazy_update=True), each row's bias correction counts the updates that row "
       "received instead of the key's (FBGEMM's per-row counter). The default for keys whose declaration "
       "(`init_lazy(..., adam_row_steps=)`) does not say."),
    # --- snapshots, journal, recovery
    _v("KVSTORE_LAZY_SNAPSHOT_DIR", "path", "", "server",
       "Where the server writes its snapshots (at shutdown, on LAZY_SNAPSHOT, every SNAPSHOT_INTERVAL) and "
       "restores them from at start."),
    _v("KVSTORE_LAZY_SNAPSHOT_INTERVAL", "seconds", "0", "server",
       "Seconds between periodic snapshots (0: none; needs KVSTORE_LAZY_SNAPSHOT_DIR)."),
    _v("KVSTORE_LAZY_SNAPSHOT_DELTAS", "int", "8", "server",
       "Periodic snapshots written as deltas between two full ones (0: always full)."),
    _v("KVSTORE_LAZY_SNAPSHOT_SCOPE", "choice", "job", "server",
       "`job`: every server of the job writes to the same snapshot directory; `server`: each has its own volume "
       "(Kubernetes PVCs).", ("job", "server")),
    _v("KVSTORE_LAZY_RESUME", "choice", "auto", "server",
       "What a fresh start loads from the snapshot directory: `auto` (the tagged snapshot, else the latest), "
       "`tagged`, `latest` or `none`.", ("auto", "tagged", "latest", "none")),
    _v("KVSTORE_LAZY_RESTORE_FROM", "path", "", "server",
       "A snapshot directory another job wrote, with any number of servers: at a fresh start with nothing to "
       "resume in its own KVSTORE_LAZY_SNAPSHOT_DIR (which it needs), each server restores the rows of its range "
       "(`kvstore-lazy reshard` does the same offline). The directory is never changed."),
    _v("KVSTORE_LAZY_JOURNAL", "bool", "0", "server",
       "Journal every request since the last snapshot (what a restarted server replays). Needs SNAPSHOT_DIR."),
    _v("KVSTORE_LAZY_JOURNAL_FSYNC", "bool", "0", "server",
       "fsync the journal at every flush (survives a power cut, not only a process death)."),
    _v("KVSTORE_LAZY_JOURNAL_MAX_MB", "int", "256", "server",
       "A journal larger than this many MiB triggers a snapshot (which starts a new journal)."),
    _v("KVSTORE_LAZY_RECOVERY", "choice", "0", "server",
       "`1`/`rejoin`: rejoin the running job as the server that had this host and port (what --restart-servers "
       "sets); `auto`: rejoin if that server died within the rejoin window, else register anew; `register`: stock "
       "ps-lite's recovery (experiments only); `0`: a fresh start.", ("0", "1", "rejoin", "auto", "register")),
    _v("KVSTORE_LAZY_RECOVER_RANK", "int", "-1", "server",
       "Rejoin as this rank instead of finding the record by host and port."),
    _v("KVSTORE_LAZY_REJOIN_WINDOW", "seconds", "", "server",
       "Seconds after its death that RECOVERY=auto still rejoins a server's job (default 10 x PS_RESEND_TIMEOUT)."),
    _v("KVSTORE_LAZY_STATUS_FILE", "path", "", "server",
       "A JSON file the server keeps up to date (phase, pid, rank), read by `kvstore-lazy ready`."),
    _v("KVSTORE_LAZY_BIND", "text", "", "server",
       "The address the server binds, apart from the one it advertises (DMLC_NODE_HOST): `*` or `0.0.0.0` for all "
       "interfaces (Kubernetes)."),
    # --- who may send what
    _v("KVSTORE_LAZY_ALLOW", "networks", "", "server",
       "Comma-separated networks or addresses (`10.0.0.0/8,192.168.1.7`) peers may connect from (empty: any)."),
    _v("KVSTORE_LAZY_CHECK_ADDRESS", "bool", "1", "server",
       "A node's messages must come from the address the scheduler announced for it (0 behind NAT or a Service)."),
    _v("KVSTORE_LAZY_SCHEDULER_TIMEOUT", "seconds", "30", "server",
       "Seconds the scheduler may leave heartbeats unanswered before the server exits with status 3 (0: off)."),
    _v("KVSTORE_LAZY_PEER_QUEUE", "int", "10000", "server",
       "Messages that may wait for one peer beyond ZeroMQ's queue before it counts as not reading and is dropped."),
    _v("KVSTORE_LAZY_PEER_QUEUE_MB", "int", "1024", "server",
       "The same bound in MiB."),
    # --- metrics
    _v("KVSTORE_LAZY_METRICS_PORT", "port", "", "server",
       "Serve Prometheus metrics on this port (0: any free port, logged); unset: no metrics."),
    _v("KVSTORE_LAZY_METRICS_BIND", "text", "0.0.0.0", "server",
       "The address the metrics listen on (127.0.0.1 under DMLC_LOCAL)."),
    # --- the server's Python (tests, launcher)
    _v("KVSTORE_LAZY_SERVER_PYTHON", "path", "", "launcher",
       "The Python interpreter kvstore_lazy servers run on (default: the launcher's own)."),
    # --- ps-lite's variables, read as a stock server reads them (the launcher sets them)
    _v("DMLC_ROLE", "text", "server", "server,worker", "ps-lite's role of the process; a kvstore_lazy server only "
       "runs `server`."),
    _v("DMLC_PS_ROOT_URI", "text", "", "server,worker", "The scheduler's address (required)."),
    _v("DMLC_PS_ROOT_PORT", "atoi", "", "server,worker", "The scheduler's port (required)."),
    _v("DMLC_NUM_WORKER", "atoi", "", "server,worker", "Workers in the job (required)."),
    _v("DMLC_NUM_SERVER", "atoi", "", "server,worker", "Servers in the job (required)."),
    _v("DMLC_NODE_HOST", "text", "", "server", "The address this server advertises (default: DMLC_INTERFACE's "
       "address, else the first non-loopback IPv4)."),
    _v("DMLC_INTERFACE", "text", "", "server", "The network interface whose address the server advertises."),
    _v("PORT", "atoi", "0", "server", "The port the server binds (0: a free one)."),
    _v("DMLC_LOCAL", "atoi", "0", "server", "ps-lite's local mode (every node on one machine)."),
    _v("PS_HEARTBEAT_INTERVAL", "float", "0", "server", "Seconds between heartbeats to the scheduler (0: off)."),
    _v("PS_RESEND", "atoi", "0", "server,worker", "ps-lite's resending of unacknowledged messages (needed for "
       "recovery)."),
    _v("PS_RESEND_TIMEOUT", "atoi", "1000", "server,worker", "Milliseconds before an unacknowledged message is "
       "resent."),
    _v("DMLC_PS_WATER_MARK", "atoi", "0", "server", "ZeroMQ's send high-water mark per peer (0: its default)."),
    _v("PS_VERBOSE", "atoi", "0", "server", "ps-lite's verbosity (2: every message is logged)."),
)
BY_NAME: dict[str, Variable] = {v.name: v for v in VARIABLES}


def _text(env: Mapping[str, str], name: str) -> str | None:
    value = env.get(name)
    if value is None or not value.strip():
        return None
    return value.strip()


def _refuse(name: str, value: str, accepted: str, sep: str = ": ") -> ConfigError:
    return ConfigError(f"{name}={value!r}{sep}{accepted}")


def boolean(env: Mapping[str, str], name: str, default: bool = False) -> bool:
    """1/0, true/false, yes/no, on/off (any case); unset or empty: `default`; anything else is refused."""
    text = _text(env, name)
    if text is None:
        return default
    if text.lower() in TRUE_WORDS:
        return True
    if text.lower() in FALSE_WORDS:
        return False
    raise _refuse(name, text, "use 1/0, true/false, yes/no or on/off")


def integer(env: Mapping[str, str], name: str, default: int, minimum: int | None = None,
            maximum: int | None = None) -> int:
    """A decimal integer (`minimum` and `maximum` inclusive); unset or empty: `default`."""
    text = _text(env, name)
    if text is None:
        return default
    try:
        value = int(text)
    except ValueError:
        raise _refuse(name, text, "is not an integer", sep=" ") from None
    if minimum is not None and value < minimum:
        raise _refuse(name, text, f"must be at least {minimum}")
    if maximum is not None and value > maximum:
        raise _refuse(name, text, f"must be at most {maximum}")
    return value


def number(env: Mapping[str, str], name: str, default: float, minimum: float | None = None) -> float:
    """A finite number (`minimum` inclusive)."""
    text = _text(env, name)
    if text is None:
        return default
    try:
        value = float(text)
    except ValueError:
        raise _refuse(name, text, "is not a number", sep=" ") from None
    if value != value or value in (float("inf"), float("-inf")):
        raise _refuse(name, text, "must be a finite number")
    if minimum is not None and value < minimum:
        raise _refuse(name, text, f"must be a finite number >= {minimum:g}")
    return value


def choice(env: Mapping[str, str], name: str) -> str:
    """One of the variable's choices (compared without case); unset: its default."""
    var = BY_NAME[name]
    text = _text(env, name)
    if text is None:
        return var.default
    for option in var.choices:
        if text.lower() == option.lower():
            return option
    raise _refuse(name, text, "use " + ", ".join(var.choices[:-1]) + " or " + var.choices[-1])


def read(env: Mapping[str, str], name: str):
    """The variable's value by its kind (bool, int, float, seconds, choice; text and paths as given, "" if unset)."""
    var = BY_NAME[name]
    if var.kind == "bool":
        return boolean(env, name, var.default in TRUE_WORDS)
    if var.kind == "int":
        return integer(env, name, int(var.default) if var.default else 0)
    if var.kind in ("float", "seconds"):
        return number(env, name, float(var.default) if var.default else 0.0,
                      minimum=0.0 if var.kind == "seconds" else None)
    if var.kind == "choice":
        return choice(env, name)
    return _text(env, name) or ""


def check(env: Mapping[str, str], reader: str) -> None:
    """Read every variable `reader` reads whose kind this module can check (bool, int, float, seconds, choice):
    the first bad value raises its ConfigError. What a process checks at start before it does anything else (the
    launcher, for the settings it passes to its nodes)."""
    for var in VARIABLES:
        if reader in var.readers and var.kind in ("bool", "int", "float", "seconds", "choice"):
            read(env, var.name)


def unknown(env: Mapping[str, str]) -> list[tuple[str, str | None]]:
    """``KVSTORE_LAZY_*`` names in `env` that no code reads, each with the known name it most likely meant."""
    known = [name for name in BY_NAME if name.startswith(PREFIX)]
    out = []
    for name in sorted(env):
        if (name.startswith(PREFIX) or name == "KVSTORE_LAZY") and name not in BY_NAME \
                and not name.startswith(("KVSTORE_LAZY_DOCKER_", "KVSTORE_LAZY_TEST_")):
            close = difflib.get_close_matches(name, known, n=1, cutoff=0.75)
            out.append((name, close[0] if close else None))
    return out


def unknown_warnings(env: Mapping[str, str]) -> list[str]:
    """One warning line per unknown ``KVSTORE_LAZY_*`` variable (:func:`unknown`)."""
    return [f"{name} is not a kvstore_lazy setting and is ignored" + (f": did you mean {meant}?" if meant else
                                                                        " (see the reference of environment "
                                                                        "variables)")
            for name, meant in unknown(env)]


def summary(env: Mapping[str, str], reader: str = "server") -> str:
    """The settings of `reader` that `env` sets, as ``NAME=value`` words in table order ("defaults" if none)."""
    words = [f"{v.name}={env[v.name].strip()}" for v in VARIABLES
             if reader in v.readers and v.name.startswith(PREFIX) and (env.get(v.name) or "").strip()]
    return " ".join(words) or "defaults"


# ---- ps-lite's way of reading its own variables


def c_atoi(text: str) -> int:
    """C ``atoi``, as ps-lite reads its variables: leading digits after an optional sign; anything else is 0
    (so ``PS_RESEND=true`` is off for stock nodes, and must be for ours)."""
    text = text.strip()
    end = 1 if text[:1] in ("+", "-") else 0
    while end < len(text) and text[end].isdigit():
        end += 1
    try:
        return int(text[:end])
    except ValueError:
        return 0


def atoi_flag(env: Mapping[str, str], name: str) -> bool:
    """A ps-lite on/off variable: atoi(value) != 0."""
    return c_atoi(env.get(name, "")) != 0


def flag(env: Mapping[str, str], name: str) -> bool:
    """One of kvstore_lazy's own on/off variables: anything but empty, 0, false, no or off is on."""
    return env.get(name, "0").strip().lower() not in ("", "0", "false", "no", "off")
