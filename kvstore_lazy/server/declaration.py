"""What a worker declares for a lazy row_sparse key (command LAZY_DECLARE, a JSON body): checked strictly.

Owns: :class:`LazySpec` and its JSON form (``kvstore_lazy.worker.lazy_spec_body`` writes it; server snapshots keep
it), and the bounds one declaration may ask for. A declaration allocates nothing, but every later pull of its key
allocates rows of its row size, so a row size or a key outside these bounds is refused when it is declared.
An optional ``"policy"`` object sets the key's row lifecycle (``policy.Policy``: admission, TTL); fields it
leaves out take the server's defaults (the ``KVSTORE_LAZY_*`` environment) when the key is created; so does an
optional ``"adam_row_steps"`` (true/false: per-row Adam bias correction, ``KVSTORE_LAZY_ADAM_ROW_STEPS``).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from kvstore_lazy.numerics.initializers import RowInitializer, parse_initializer
from kvstore_lazy.protocol import mxnet as mx
from kvstore_lazy.server.policy import Policy

MAX_ROW_ELEMENTS = 1 << 16        # elements per row (embedding dims); 256 KiB a float32 row
MAX_ROWS = 1 << 62                # rows of one key (hashed ids over a 2^62 space)
LAZY_DTYPES = ("float16", "float32", "float64")
DEFAULT_BOUND = 1_000_000         # MXNET_KVSTORE_BIGARRAY_BOUND's default in MXNet 1.9.1


def _whole(body: dict, name: str, lo: int, hi: int, default: int | None = None) -> int:
    """body[name] as an int in [lo, hi]: a JSON integer, not a float, a string or a bool."""
    value = body.get(name, default)
    if type(value) is not int or not lo <= value <= hi:
        raise ValueError(f"{name} must be an integer in [{lo}, {hi}], got {value!r}")
    return value


@dataclass
class LazySpec:
    key: int
    total_rows: int
    row_shape: tuple[int, ...]
    dtype: np.dtype
    init: str
    seed: int
    bound: int
    initializer: RowInitializer
    policy: dict = field(default_factory=dict)   # policy.Policy fields the declaration sets
    adam_row_steps: bool | None = None           # per-row Adam bias correction (None: the server's default)

    def row_policy(self, defaults: Policy) -> Policy:
        """The key's lifecycle policy: the declared fields over the server's defaults."""
        return defaults.updated(self.policy)

    @property
    def row_size(self) -> int:
        return int(np.prod(self.row_shape, dtype=np.int64))

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.total_rows,) + self.row_shape

    def partition(self, num_servers: int, rank: int) -> tuple[int, int]:
        """(first global row, rows) this server holds: MXNet splits a key of at least `bound` elements by rows."""
        if self.total_rows * self.row_size >= self.bound:
            return mx.row_partition(self.total_rows, num_servers, rank)
        return 0, self.total_rows

    def to_json(self) -> dict:
        body = {"key": self.key, "rows": self.total_rows, "row_shape": list(self.row_shape),
                "dtype": self.dtype.name, "init": self.init, "seed": self.seed, "bound": self.bound}
        if self.policy:
            body["policy"] = dict(self.policy)
        if self.adam_row_steps is not None:
            body["adam_row_steps"] = self.adam_row_steps
        return body

    @classmethod
    def from_json(cls, body) -> "LazySpec":
        """The declaration `body` (parsed JSON), or ValueError/InitializerError naming what is wrong."""
        if not isinstance(body, dict):
            raise ValueError(f"a lazy declaration is a JSON object, got {type(body).__name__}")
        row_shape = body.get("row_shape")
        if (not isinstance(row_shape, list) or not row_shape
                or any(type(d) is not int or d <= 0 for d in row_shape)):
            raise ValueError(f"row_shape must be a non-empty list of positive integers, got {row_shape!r}")
        if int(np.prod([float(d) for d in row_shape])) > MAX_ROW_ELEMENTS:
            raise ValueError(f"row_shape {row_shape} has more than {MAX_ROW_ELEMENTS} elements a row")
        dtype = body.get("dtype", "float32")
        if dtype not in LAZY_DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(LAZY_DTYPES)}, got {dtype!r}")
        row_steps = body.get("adam_row_steps")
        if row_steps is not None and type(row_steps) is not bool:
            raise ValueError(f"adam_row_steps must be true or false, got {row_steps!r}")
        init = body.get("init")
        if not isinstance(init, str):
            raise ValueError(f"init must be an Initializer.dumps() string, got {type(init).__name__}")
        spec = cls(key=_whole(body, "key", 0, mx.ROWS_HEADER_KEY - 1), total_rows=_whole(body, "rows", 1, MAX_ROWS),
                   row_shape=tuple(row_shape), dtype=np.dtype(dtype), init=init,
                   seed=_whole(body, "seed", -(1 << 63), (1 << 64) - 1, default=0),
                   bound=_whole(body, "bound", 1, (1 << 63) - 1, default=DEFAULT_BOUND),
                   initializer=parse_initializer(init), policy=Policy.check(body.get("policy", {})),
                   adam_row_steps=row_steps)
        spec.initializer.rows(spec.seed, spec.key, np.zeros(1, np.uint64), spec.shape, spec.dtype)  # fails now if ever
        return spec
