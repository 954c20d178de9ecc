"""What a lazy key asks of its rows (:class:`Policy`) and the server-wide lifecycle settings (:class:`Settings`).

Owns: the fields of a key's row policy (admission by count or probability, TTL in rounds or seconds), their strict
checks (a declaration's ``"policy"`` object, ``Policy.check``), the server-wide settings (the default policy, the
memory budget, eviction kind, watermarks, the pending cap, the disk tier's options) and reading them from the
``KVSTORE_LAZY_*`` environment (through kvstore_lazy.config's strict readers), and :func:`parse_bytes` for sizes.
Plain values: frozen dataclasses, checked when made.
Does not own: what a policy does to rows, when, and in which order (``lifecycle``: its docstring is the reference
for the policies' semantics and their determinism; :class:`~kvstore_lazy.server.lifecycle.RowPolicy` is a key's
state, :class:`~kvstore_lazy.server.lifecycle.Lifecycle` the budget's pass), nor the rows (``keys``).
"""
from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from typing import Any

from kvstore_lazy import config

EVICT_KINDS = ("lru", "lfu")
DEFAULT_ADMIT_CAP = 1 << 20
DEFAULT_LOW_WATERMARK = 0.9
DISK_LOW_WATERMARK = 0.98       # the default with a disk tier: a pass moves rows (nothing is lost), so it moves few
                                # at a time (2% of the budget), often: each round end's pass (after its replies)
                                # stays short, and memory stays full
MAX_ROUNDS = (1 << 31) - 1
RESERVE_FLOOR = 32 << 20        # a budget's share for the buffers of its phases (Settings.reserve): none below this,
RESERVE_SHARE = 8               # 1/8 of what is above it,
RESERVE_MAX = 128 << 20         # at most this
ENV = {"admit_min_count": "KVSTORE_LAZY_ADMIT_MIN_COUNT", "admit_prob": "KVSTORE_LAZY_ADMIT_PROB",
       "ttl_rounds": "KVSTORE_LAZY_TTL_ROUNDS", "ttl_seconds": "KVSTORE_LAZY_TTL_SECONDS"}
_BYTE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
               "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str) -> int:
    """``"512MiB"``, ``"8GiB"``, ``"1.5GB"``, ``"1000000"`` -> bytes (KiB/MiB/GiB/TiB are powers of 1024, KB/MB/GB/TB
    of 1000); ValueError for anything else."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _BYTE_UNITS:
        raise ValueError(f"{text!r} is not a size (use bytes, or a number with KiB, MiB, GiB, TiB, KB, MB, GB, TB)")
    return int(float(m.group(1)) * _BYTE_UNITS[unit]) if "." in m.group(1) else int(m.group(1)) * _BYTE_UNITS[unit]


def _whole(name: str, value, lo: int, hi: int) -> int:
    if type(value) is not int or not lo <= value <= hi:
        raise ValueError(f"{name} must be an integer in [{lo}, {hi}], got {value!r}")
    return value


def _real(name: str, value, lo: float, hi: float, lo_open: bool = False) -> float:
    if type(value) not in (int, float) or not math.isfinite(value) or value > hi or value < lo \
            or (lo_open and value == lo):
        raise ValueError(f"{name} must be a number in {'(' if lo_open else '['}{lo}, {hi}], got {value!r}")
    return float(value)


@dataclass(frozen=True)
class Policy:
    """What one lazy key asks of its rows; the defaults change nothing."""

    admit_min_count: int = 1
    admit_prob: float = 1.0
    ttl_rounds: int = 0
    ttl_seconds: float = 0.0

    CHECKS = {"admit_min_count": lambda v: _whole("admit_min_count", v, 1, MAX_ROUNDS),
              "admit_prob": lambda v: _real("admit_prob", v, 0.0, 1.0, lo_open=True),
              "ttl_rounds": lambda v: _whole("ttl_rounds", v, 0, MAX_ROUNDS),
              "ttl_seconds": lambda v: _real("ttl_seconds", v, 0.0, 1e12)}

    @property
    def admits_at_once(self) -> bool:
        return self.admit_min_count == 1 and self.admit_prob >= 1.0

    @property
    def expires(self) -> bool:
        return bool(self.ttl_rounds or self.ttl_seconds)

    @classmethod
    def check(cls, body) -> dict:
        """A declaration's ``"policy"`` object, checked strictly: known names with values in range, else ValueError
        naming the field. Returns the fields it sets."""
        if not isinstance(body, dict):
            raise ValueError(f"policy must be a JSON object, got {type(body).__name__}")
        unknown = sorted(set(body) - set(cls.CHECKS))
        if unknown:
            raise ValueError(f"unknown policy field(s) {', '.join(map(repr, unknown))}; known: "
                             f"{', '.join(cls.CHECKS)}")
        return {name: cls.CHECKS[name](value) for name, value in body.items()}

    def updated(self, fields: dict) -> "Policy":
        return dataclasses.replace(self, **fields)

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def _reserve(budget: int) -> int:
    return min(RESERVE_MAX, max(0, budget - RESERVE_FLOOR) // RESERVE_SHARE)


@dataclass(frozen=True)
class Settings:
    """Server-wide: the default policy of keys whose declaration does not set one, the memory budget, the pending
    cap, and whether tables track changes (for incremental snapshots)."""

    defaults: Policy = Policy()
    memory_budget: int = 0              # bytes; 0: none
    evict: str = "lru"
    low_watermark: float | None = None  # None: DISK_LOW_WATERMARK with a disk tier, else DEFAULT_LOW_WATERMARK
    admit_cap: int = DEFAULT_ADMIT_CAP
    track_changes: bool = False
    disk_dir: str = ""                  # KVSTORE_LAZY_DISK_DIR: rows the budget pushes out go there (the disk tier)
    disk_segment_rows: int = 1 << 16    # KVSTORE_LAZY_DISK_SEGMENT_ROWS: records per segment file (a power of two)
    disk_compact: float = 0.25          # KVSTORE_LAZY_DISK_COMPACT: garbage share that gets a sealed segment compacted
    disk_admit_window: int = 0          # KVSTORE_LAZY_DISK_ADMIT_WINDOW: a row on disk comes back into memory only if
                                        # pushed in its key's last W rounds (else it is updated where it is); 0: always
    adam_row_steps: bool = False        # KVSTORE_LAZY_ADAM_ROW_STEPS: lazy Adam's bias correction per row (a key's
                                        # declaration may say otherwise)
    catchup: str = "exact"              # KVSTORE_LAZY_CATCHUP: exact (replayed) or closed (closed forms, linear rules)

    def __post_init__(self) -> None:
        if self.low_watermark is None:
            object.__setattr__(self, "low_watermark", DISK_LOW_WATERMARK if self.disk_dir else DEFAULT_LOW_WATERMARK)
        if self.evict not in EVICT_KINDS:
            raise ValueError(f"evict must be one of {', '.join(EVICT_KINDS)}, got {self.evict!r}")
        _real("low_watermark", self.low_watermark, 0.0, 1.0, lo_open=True)
        _whole("admit_cap", self.admit_cap, 1, 1 << 40)
        _whole("memory_budget", self.memory_budget, 0, 1 << 62)
        _whole("disk_segment_rows", self.disk_segment_rows, 1, 1 << 30)
        _real("disk_compact", self.disk_compact, 0.0, 1.0, lo_open=True)
        _whole("disk_admit_window", self.disk_admit_window, 0, MAX_ROUNDS)
        if self.catchup not in ("exact", "closed"):
            raise ValueError(f"catchup must be exact or closed, got {self.catchup!r}")
        if self.disk_segment_rows & (self.disk_segment_rows - 1):
            raise ValueError(f"disk_segment_rows must be a power of two, got {self.disk_segment_rows}")

    @classmethod
    def from_env(cls, env, track_changes: bool = False) -> "Settings":
        """KVSTORE_LAZY_ADMIT_MIN_COUNT, _ADMIT_PROB, _TTL_ROUNDS, _TTL_SECONDS (the default policy), _MEMORY_BUDGET,
        _EVICT, _LOW_WATERMARK, _ADMIT_CAP and the disk tier's, each read by kvstore_lazy.config's strict readers
        (ConfigError, a ValueError, naming the variable and the value); a value of the right type out of its range
        is a ValueError naming the variable too."""
        fields = {}
        for field, name in ENV.items():
            if (env.get(name) or "").strip():
                value = config.integer(env, name, 0) if field in ("admit_min_count", "ttl_rounds") \
                    else config.number(env, name, 0.0)
                try:
                    fields[field] = Policy.CHECKS[field](value)
                except ValueError as exc:
                    raise ValueError(f"{name}: {exc}") from None
        options: dict[str, Any] = {}
        budget = config.read(env, "KVSTORE_LAZY_MEMORY_BUDGET")
        if budget:
            try:
                options["memory_budget"] = parse_bytes(budget)
            except ValueError as exc:
                raise ValueError(f"KVSTORE_LAZY_MEMORY_BUDGET: {exc}") from None
        evict = (env.get("KVSTORE_LAZY_EVICT") or "").strip()
        if evict:   # refused by Settings with its own words (the choices are EVICT_KINDS)
            options["evict"] = evict.lower()
        disk = config.read(env, "KVSTORE_LAZY_DISK_DIR")
        if disk:
            if not options.get("memory_budget"):
                raise ValueError(f"KVSTORE_LAZY_DISK_DIR={disk!r} needs KVSTORE_LAZY_MEMORY_BUDGET: the disk tier "
                                 f"holds the rows the memory budget pushes out of memory")
            options["disk_dir"] = disk
        for option, name, kind in (("low_watermark", "KVSTORE_LAZY_LOW_WATERMARK", float),
                                   ("admit_cap", "KVSTORE_LAZY_ADMIT_CAP", int),
                                   ("disk_segment_rows", "KVSTORE_LAZY_DISK_SEGMENT_ROWS", int),
                                   ("disk_compact", "KVSTORE_LAZY_DISK_COMPACT", float),
                                   ("disk_admit_window", "KVSTORE_LAZY_DISK_ADMIT_WINDOW", int)):
            if (env.get(name) or "").strip():
                options[option] = config.integer(env, name, 0) if kind is int else config.number(env, name, 0.0)
        options["adam_row_steps"] = config.boolean(env, "KVSTORE_LAZY_ADAM_ROW_STEPS")
        options["catchup"] = config.choice(env, "KVSTORE_LAZY_CATCHUP")
        try:
            return cls(defaults=Policy().updated(fields), track_changes=track_changes, **options)
        except ValueError as exc:
            raise ValueError(f"KVSTORE_LAZY_{str(exc).split()[0].upper()}: {exc}") from None

    @property
    def reserve(self) -> int:
        """Bytes of the memory budget kept for the buffers of the server's phases (budget passes, demotions and the
        disk index's merges, snapshots, checkpoint fetches, restores), never for rows: the row tables are held to
        :attr:`row_budget`. Those buffers are fixed caps (a few MiB each) plus a few bytes a row a pass moves, so
        what a budget past ``RESERVE_FLOOR`` has over it pays 1/RESERVE_SHARE, at most ``RESERVE_MAX``: a budget of
        1 GiB keeps 124 MiB, of 256 MiB 28 MiB, of 32 MiB or less nothing (its phases' buffers are within the
        fixed caps a server has over its budget anyway)."""
        return _reserve(self.memory_budget)

    @property
    def row_budget(self) -> int:
        """Bytes the row tables may account for: the memory budget less its :attr:`reserve` (0: no budget)."""
        return self.memory_budget - self.reserve

    @staticmethod
    def budget_for(row_bytes: int) -> int:
        """The smallest memory budget whose :attr:`row_budget` holds `row_bytes` (what to tell a user to set)."""
        if row_bytes <= RESERVE_FLOOR:
            return row_bytes
        # budget - (budget - FLOOR) / SHARE = row_bytes while the reserve is under its cap (then the floor division's
        # few bytes)
        budget = -(-(RESERVE_SHARE * row_bytes - RESERVE_FLOOR) // (RESERVE_SHARE - 1))
        if budget - RESERVE_FLOOR >= RESERVE_SHARE * RESERVE_MAX:
            budget = row_bytes + RESERVE_MAX
        while budget - 1 - _reserve(budget - 1) >= row_bytes:
            budget -= 1
        return budget

    def to_json(self) -> dict:
        return {"defaults": self.defaults.to_json(), "memory_budget": self.memory_budget, "evict": self.evict,
                "low_watermark": self.low_watermark, "admit_cap": self.admit_cap, "disk_dir": self.disk_dir,
                "disk_segment_rows": self.disk_segment_rows, "disk_compact": self.disk_compact,
                "disk_admit_window": self.disk_admit_window, "adam_row_steps": self.adam_row_steps,
                "catchup": self.catchup}
