"""Copies of structured records as opaque bytes.

Owns: :func:`pick`, :func:`put_at` and :func:`join`, the record copies of the store and the disk tier. Numpy
copies a structured dtype with subarray fields field by field, several times slower than one opaque copy of each
record: these view the records as ``V<itemsize>`` for the copy. Does not own: the record layout (:mod:`.layout`).
"""
from __future__ import annotations

import numpy as np


def pick(records: np.ndarray, index: np.ndarray) -> np.ndarray:
    """``records[index]`` (an index array or a mask) for structured records, as bytes: numpy copies a structured
    dtype with subarray fields field by field, several times slower than one opaque copy of each record."""
    raw = np.dtype((np.void, records.dtype.itemsize))
    return records.view(raw)[index].view(records.dtype)


def put_at(out: np.ndarray, index: np.ndarray, records: np.ndarray) -> None:
    """``out[index] = records`` for structured records, as bytes (see :func:`pick`)."""
    raw = np.dtype((np.void, out.dtype.itemsize))
    out.view(raw)[index] = records.view(raw)


def join(parts: list) -> np.ndarray:
    """np.concatenate of structured records of one dtype, as bytes (see :func:`pick`)."""
    dtype = parts[0].dtype
    raw = np.dtype((np.void, dtype.itemsize))
    return np.concatenate([p.view(raw) for p in parts]).view(dtype)
