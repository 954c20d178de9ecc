"""The id stream of tests/workers/lifecycle.py, shared with the tests that predict its rows: which row ids worker
`rank` pulls and pushes for `key` at `step` (1-based). Zipf-distributed over the key's rows, so many ids come once."""
import numpy as np


def ids_for(key: int, rank: int, step: int, rows: int, batch: int) -> np.ndarray:
    rng = np.random.RandomState(10007 * key + 1000 * step + rank)
    return np.unique(np.minimum(rng.zipf(1.2, batch) - 1, rows - 1)).astype(np.int64)


def grad_for(ids: np.ndarray, dim: int, step: int, rank: int) -> np.ndarray:
    return ((ids[:, None] * 3 + np.arange(dim)[None, :] + step + rank) % 11 - 5).astype(np.float32) / 4
