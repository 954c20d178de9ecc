"""Shared bits of the Gluon and Module training worker scripts (gluon_train.py / module_train.py and gluon_lazy.py /
module_lazy.py), so both APIs train under the same options, optimizer settings and step order and write the same
results. Stock mxnet only: nothing here imports kvstore_lazy (the lazy tests check that a worker with the switch off
never does)."""
import argparse
import sys
import time

import mxnet as mx
import numpy as np

from common import save

CATEGORIES = [3, 31337, 99998]   # the 3 values the categorical feature takes (all < the smallest input_dim used)


def train_parser() -> argparse.ArgumentParser:
    """The options of both train scripts: the job, the optimizer and the model and batch sizes."""
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--mode", default="dist_sync")
    p.add_argument("--optimizer", default="sgd", help="sgd (momentum) | adam")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--hidden", type=int, default=80)   # 80 x 16 = 1280 elements: partitioned when the bound is 1000
    p.add_argument("--batch", type=int, default=16)
    return p


def lazy_parser(batch: int) -> argparse.ArgumentParser:
    """The options of both lazy scripts: the job, the optimizer, the embedding sizes, and what a stock run needs to be
    comparable with a lazy one or a crash needs to be a crash."""
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--mode", default="dist_sync")
    p.add_argument("--input-dim", type=int, default=100000)
    p.add_argument("--dim", type=int, default=8)
    p.add_argument("--optimizer", default="sgd", help="sgd (momentum) | adam")
    p.add_argument("--batch", type=int, default=batch)
    p.add_argument("--no-states", action="store_true", help="skip optimizer states (stock mxnet refuses them on dist)")
    p.add_argument("--linger", action="store_true", help="after saving, wait to be killed (a crash, not an exit)")
    p.add_argument("--constant-init", action="store_true",
                   help="Constant(0.05) for both sparse weights: no random draws for them, so a stock and a lazy run "
                        "start from the same weights (the dense layers draw the same Xavier values)")
    return p


def connect(mode: str):
    """The dist kvstore, its rank and number of workers; then the global seeds, so every run draws the same initial
    weights."""
    kv = mx.kv.create(mode)
    mx.random.seed(42)
    np.random.seed(42)
    return kv, kv.rank, kv.num_workers


def optimizer_params(optimizer: str, batch: int, num_workers: int) -> dict:
    """The optimizer settings every script uses, rescale_grad set up front (step(1) / update() keep it)."""
    opt_params = {"rescale_grad": 1.0 / (batch * num_workers)}
    if optimizer == "sgd":
        opt_params.update(learning_rate=0.5, momentum=0.9, wd=1e-3)
    elif optimizer == "adam":
        opt_params.update(learning_rate=0.05, wd=1e-4)
    else:
        raise SystemExit(f"unknown optimizer {optimizer}")
    return opt_params


def train_steps(kv, mode: str, steps: int, train_step, weights, results: dict) -> None:
    """Run train_step(0 .. steps-1), then record what the servers hold at the end (weights("final_")).

    In dist_async the workers take turns (rank 0 trains a step, waits for its pushes to be answered, barrier, rank 1
    trains a step, ...), so the order in which the server applies updates is fixed and two runs can be compared."""
    rank, nw = kv.rank, kv.num_workers
    for step in range(steps):
        if "async" not in mode:
            train_step(step)
            continue
        for turn in range(nw):
            if turn == rank:
                # what the servers hold right before and right after this rank's step: the test checks that one
                # rank's "after" is the next rank's "before", i.e. the servers applied the steps in turn order
                results.update(weights(f"before{step}_"))
                train_step(step)
                mx.nd.waitall()   # every push and pushpull of this step answered by the servers
                results.update(weights(f"after{step}_"))
            kv._barrier()
    mx.nd.waitall()
    kv._barrier()
    results.update(weights("final_"))


def finish_train(kv, out: str, results: dict) -> None:
    """Write the results once every rank is done pulling: nobody exits (and stops the servers) while another rank
    still pulls."""
    kv._barrier()
    save(out, kv.rank, results)
    print("worker", kv.rank, "done", flush=True)


def read_back(path: str, results: dict) -> None:
    """What mx.nd.load reads back from the checkpoint `path`, into results (the stype of each array, and its
    indices and data if row_sparse, else its value)."""
    for name, value in mx.nd.load(path).items():
        results[f"ckpt_stype_{name}"] = np.array(value.stype)
        if value.stype == "row_sparse":
            results[f"ckpt_indices_{name}"] = value.indices.asnumpy()
            results[f"ckpt_data_{name}"] = value.data.asnumpy()
        else:
            results[f"ckpt_value_{name}"] = value.asnumpy()


def finish_lazy(kv, out: str, results: dict, linger: bool) -> None:
    """After every rank's checkpoint work: record the peak RSS and whether kvstore_lazy was imported, write the
    results, then (linger) wait to be SIGKILLed, a crash rather than an exit."""
    kv._barrier()
    with open("/proc/self/status") as fh:
        results["vmhwm_kb"] = np.array(next(int(line.split()[1]) for line in fh if line.startswith("VmHWM:")))
    results["kvstore_lazy_imported"] = np.array("kvstore_lazy.worker.integration" in sys.modules)
    save(out, kv.rank, results)
    print("worker", kv.rank, "done; VmHWM", int(results["vmhwm_kb"]), "kB", flush=True)
    if linger:
        time.sleep(600)
