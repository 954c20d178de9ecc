"""Shared bits of the worker scripts the integration tests run (each one a stock mxnet==1.9.1 worker)."""
import os

import numpy as np


def rank_file(out: str, rank: int) -> str:
    return f"{out}.rank{rank}.npz"


def save(out: str, rank: int, results: dict) -> None:
    np.savez(rank_file(out, rank), **{k: np.asarray(v) for k, v in results.items()})


def load(out: str, rank: int) -> dict:
    with np.load(rank_file(out, rank), allow_pickle=False) as data:
        return {k: data[k] for k in data.files}
