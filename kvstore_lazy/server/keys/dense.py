"""A dense key: one tensor (DataHandleDefault / DataHandleCompressed of kvstore_dist_server.h).

Owns: the key's value (in its dtype: what pulls return), its float32 master copy under multi-precision, its optimizer
states, the buffer a round's merged sum reuses, the serialized value shared by pulls until the next update, and its
snapshot, inspection and optimizer-state transfer.
Does not own: decompressing a 2-bit push (the server does, before :meth:`DenseKey.gradient`), the round's
bookkeeping (:class:`~kvstore_lazy.server.keys.sync_round.SyncRound`).
"""
from __future__ import annotations

import numpy as np

from kvstore_lazy.numerics.optimizers import Optimizer
from kvstore_lazy.protocol.kv import BadRequest
from kvstore_lazy.server.keys.sync_round import SyncRound


class DenseKey:
    """A dense tensor (DataHandleDefault / DataHandleCompressed)."""

    kind = "dense"

    def __init__(self, key: int, value: np.ndarray, multi_precision: bool) -> None:
        self.key = key
        self.dtype = value.dtype
        self._value = value                       # in the key's dtype: what pulls return
        self._master = value.astype(np.float32) if multi_precision and value.dtype != np.float32 else None
        self._states: list[np.ndarray] | None = None   # optimizer states, created at the first update
        self._merge_buffer: np.ndarray | None = None   # reused for merged sums, round after round
        self._payload: bytes | None = None             # value.tobytes(), shared by pulls until the next update
        self.round = SyncRound()

    @classmethod
    def first_push(cls, key: int, values: np.ndarray, multi_precision: bool) -> "DenseKey":
        """The init: stored as sent."""
        return cls(key, np.array(values), multi_precision)

    @property
    def size(self) -> int:
        return self._value.size

    @property
    def num_states(self) -> int:
        return len(self._states or [])

    @property
    def _stored(self) -> np.ndarray:
        """The array updates run on (store_realt_ under multi-precision, else store_)."""
        return self._master if self._master is not None else self._value

    def gradient(self, dtype: np.dtype, values: np.ndarray) -> np.ndarray:
        """A push's values as the gradient this key merges and applies."""
        if dtype != self.dtype or values.size != self._value.size:
            raise BadRequest(self.key, f"push of {values.size} {dtype.name} values to a key of {self._value.size} "
                                       f"{self.dtype.name}")
        return values.astype(np.float32) if self._master is not None else values

    def plain_gradient(self, dtype: np.dtype, size: int) -> bool:
        """Whether a push of `size` `dtype` values is a gradient :meth:`gradient` takes as it is (no master copy):
        the fast path's condition for handing it to the round (server/fastpath.py)."""
        return dtype == self.dtype and size == self._value.size and self._master is None

    def merge(self, merged, grad: np.ndarray, count: int) -> np.ndarray:
        if count == 0:
            return grad              # the message's buffer, never written: the 2nd push sums elsewhere
        if count == 1:
            if self._merge_buffer is None or self._merge_buffer.dtype != grad.dtype:
                self._merge_buffer = np.empty_like(grad)
            return np.add(merged, grad, out=self._merge_buffer)
        merged += grad
        return merged

    def apply(self, grad: np.ndarray, optimizer: Optimizer | None, sync: bool = True) -> None:
        self._payload = None
        if optimizer is None:
            self._stored[...] = grad
        else:
            if self._states is None:
                self._states = optimizer.init_states(self._stored)
            optimizer.update(self.key, self._stored, grad, self._states)
        if self._master is not None:
            self._value[...] = self._master.astype(self.dtype)

    def pull(self, dtype: np.dtype) -> bytes:
        if dtype != self.dtype:
            raise BadRequest(self.key, f"pull as {dtype.name} of a {self.dtype.name} key")
        if self._payload is None:    # every worker pulls the same value after an update: serialize it once
            self._payload = self._value.tobytes()
        return self._payload

    def use_master_copy(self) -> None:
        """kSetMultiPrecision for a key already stored."""
        if self.dtype != np.float32:
            self._master = self._value.astype(np.float32)

    def reset_states(self, optimizer: Optimizer) -> None:
        self._states = None

    # -- optimizer states, for worker checkpoints (state_transfer)

    def state(self, index: int) -> np.ndarray:
        if index >= self.num_states:
            raise IndexError(f"key {self.key} has {self.num_states} optimizer states here, not {index + 1}")
        return self._states[index].reshape(-1)

    def set_state(self, index: int, flat: np.ndarray, optimizer: Optimizer) -> None:
        if self._states is None:
            self._states = optimizer.init_states(self._stored)
        if index >= len(self._states):
            raise IndexError(f"key {self.key} has {len(self._states)} optimizer states, not {index + 1}")
        self._states[index][...] = flat.reshape(self._states[index].shape)

    # -- snapshots and stats

    def snapshot(self, stream: bool = False) -> dict:
        """The value and states for a server snapshot: views, not copies (`stream` changes nothing here)."""
        return {"row_ids": np.zeros(1, np.uint64), "weights": self._stored.reshape(1, -1),
                "states": [s.reshape(1, -1) for s in (self._states or [])],
                "meta": {"kind": self.kind, "dtype": self.dtype.name}}

    def inspect(self) -> dict:
        """Everything a rejected request must leave alone, as bytes (tests compare it before and after)."""
        return {"dtype": self.dtype.name, "value": self._value.tobytes(),
                "master": None if self._master is None else self._master.tobytes(),
                "states": [s.tobytes() for s in self._states or []],
                "merged": None if not self.round.pending else np.asarray(self.round.merged).tobytes(),
                "round": self.round.describe()}

    def delta(self, stream: bool = False) -> dict:
        """What an incremental snapshot holds of this key: all of it (a dense value changes as a whole)."""
        return dict(self.snapshot(), mode="full")

    def snapshot_written(self) -> None:
        pass

    @classmethod
    def restore(cls, key: int, table: dict, multi_precision: bool) -> "DenseKey":
        dtype = np.dtype(table["meta"]["dtype"])
        entry = cls(key, table["weights"].reshape(-1).astype(dtype), multi_precision)
        if entry._master is not None:
            entry._master = table["weights"].reshape(-1).astype(np.float32)
        entry._states = [s.reshape(-1).copy() for s in table["states"]] or None
        return entry

    def nbytes(self) -> int:
        return self._value.nbytes + (self._master.nbytes if self._master is not None else 0)
