"""Row lifecycle policies with real stock MXNet 1.9.1 workers and scheduler (tests/workers/lifecycle.py).

- Per-row policies (admission by count, by probability, both, TTL in rounds), one key each, 1 and 2 servers,
  dist_sync and dist_async: the rows that exist at the end (listed by the worker's fetch_rows) are exactly the ones
  tests/lifecycle_model.py predicts from the id stream, and the same for 1 and 2 servers; the servers' stats log
  lines (pending, admitted, dropped, evicted) add up to the model's counts.
- A memory budget from the environment (KVSTORE_LAZY_MEMORY_BUDGET, the path of patched Gluon/Module jobs that
  never call init_lazy with policy arguments): the rows each server keeps are the LRU prediction for its part.
- kill -9 of a server mid-run under a budget with eviction (and admission by count), restarted from its snapshot
  chain and journal: the job ends bit for bit where an undisturbed run ends, server tables included.
"""
from __future__ import annotations

import json
import re

import numpy as np
import pytest

import faultjob
import lifecycle_model as lm
from common import load
from kvstore_lazy.persist import checkpoint
from kvstore_lazy.protocol.mxnet import row_partition
from lifecycle_stream import ids_for

pytestmark = pytest.mark.integration

ROWS, DIM, STEPS, BATCH, SEED = 50_000, 4, 30, 64, 42
POLICIES = {3: {"admit_min_count": 2}, 5: {"admit_prob": 0.4}, 6: {"ttl_rounds": 6},
            8: {"admit_min_count": 2, "admit_prob": 0.7, "ttl_rounds": 10}}
STATS = re.compile(r"stats \(at shutdown\): key (\d+) rows (\d+) bytes \d+ pending (\d+) admitted (\d+) "
                   r"dropped (\d+) evicted (\d+)")


def run_job(job_factory, name, servers, mode, keys, server_env=None, steps=STEPS):
    job = job_factory(name, num_workers=2, num_servers=servers, server="lazy",
                      mode_env={"MXNET_KVSTORE_BIGARRAY_BOUND": "1000"})       # partitioned over the servers
    job.start(server_env=dict({"KVSTORE_LAZY_SNAPSHOT_DIR": str(job.tmp / "snap")}, **(server_env or {})))
    out = str(job.tmp / "res")
    job.run_workers("lifecycle.py", ["--out", out, "--mode", mode, "--keys", json.dumps(keys), "--rows", str(ROWS),
                                     "--dim", str(DIM), "--steps", str(steps), "--batch", str(BATCH),
                                     "--seed", str(SEED)], timeout=240)
    return load(out, 0), job


def stats_lines(job, servers) -> dict[int, list[int]]:
    """key -> [rows, pending, admitted, dropped, evicted] summed over the servers' shutdown stats lines."""
    out: dict[int, list[int]] = {}
    for rank in range(servers):
        for m in STATS.finditer(job.log(f"server{rank}")):
            counts = out.setdefault(int(m.group(1)), [0] * 5)
            for i, v in enumerate(m.groups()[1:]):
                counts[i] += int(v)
    return out


def predict(keys, mode, steps=STEPS, part=None, budget=0):
    """The model run over the worker's id stream; `part`: (first, count) of the global rows one server holds."""
    models = {k: lm.KeyModel(k, SEED, min_count=p.get("admit_min_count", 1), prob=p.get("admit_prob", 1.0),
                             ttl_rounds=p.get("ttl_rounds", 0), row_size=DIM, num_states=1, tracked=True,
                             budget_managed=bool(budget)) for k, p in keys.items()}
    world = lm.ServerModel(list(models.values()), budget=budget)
    lo, hi = (0, ROWS) if part is None else (part[0], part[0] + part[1])
    for step in range(1, steps + 1):
        for key in sorted(keys):
            model = models[key]
            pushes = [[i for i in ids_for(key, r, step, ROWS, BATCH).tolist() if lo <= i < hi] for r in range(2)]
            for ids in pushes:       # (the servers' default materialization, push: pulls create no rows)
                model.pull(ids, touch=False)
            if mode == "dist_sync":
                model.push_round(pushes[0] + pushes[1])
            else:
                model.push_async_round(pushes)
            world.end_round(key)
    return models


@pytest.mark.parametrize("mode", ["dist_sync", "dist_async"])
def test_per_row_policies_keep_the_predicted_rows_on_1_and_2_servers(job_factory, mode):
    models = predict(POLICIES, mode)
    for key, model in models.items():      # the stream exercises every policy
        assert model.dropped > 0 or model.evicted > 0, key
        assert 0 < len(model.rows) < len({i for r in range(2) for s in range(1, STEPS + 1)
                                          for i in ids_for(key, r, s, ROWS, BATCH).tolist()}), key
    seen = {}
    for servers in (1, 2):
        res, job = run_job(job_factory, f"{mode}-{servers}", servers, mode, POLICIES)
        counts = stats_lines(job, servers)
        for key, model in models.items():
            rows = res[f"rows{key}"].tolist()
            assert rows == sorted(model.rows), (servers, key, len(rows), len(model.rows))
            m = model
            assert counts[key] == [len(m.rows), len(m.pending), m.admitted, m.dropped, m.evicted], (servers, key)
        seen[servers] = {key: res[f"rows{key}"].tolist() for key in POLICIES}
    assert seen[1] == seen[2]


@pytest.mark.parametrize("servers,mode", [(1, "dist_sync"), (2, "dist_async")])
def test_memory_budget_from_the_environment_keeps_the_lru_rows(job_factory, servers, mode):
    budget = 8192 + 500 * 49            # index + 500 rows (4 + 4 floats, 8 B of columns, 1 change flag, 8 B id)
    env = {"KVSTORE_LAZY_MEMORY_BUDGET": str(budget), "KVSTORE_LAZY_EVICT": "lru"}
    keys = {3: {}}
    res, job = run_job(job_factory, f"budget-{servers}", servers, mode, keys, server_env=env)
    want, evicted = [], 0
    for rank in range(servers):
        model = predict(keys, mode, part=row_partition(ROWS, servers, rank), budget=budget)[3]
        want += sorted(model.rows)
        evicted += model.evicted
        assert model.nbytes() <= budget
    assert evicted > 200
    assert res["rows3"].tolist() == sorted(want)
    assert stats_lines(job, servers)[3][4] == evicted


# ----------------------------------------------------------------------------------------------------------------
# kill -9 under a budget, recovered from the snapshot chain and the journal

# fault_train.py's rows: 8 + 8 floats (SGD momentum), 8 B of columns, a change flag, the id: 81 B. Its Zipf ids fall
# mostly on server rank 0 (the lower half of the rows), which evicts a few hundred rows under this budget.
BUDGET_ENV = {"KVSTORE_LAZY_MEMORY_BUDGET": str(8192 + 400 * 81), "KVSTORE_LAZY_ADMIT_MIN_COUNT": "2",
              "KVSTORE_LAZY_SNAPSHOT_DELTAS": "4"}


def server_tables(out) -> dict:
    """Each server's key tables at shutdown (rows, weights, states, per-row columns, pending ids) and counters."""
    tables = {}
    for rank in range(2):
        loaded = checkpoint.load_snapshot(out / "snap", rank)
        for key, table in loaded.tables.items():
            tables[(rank, key)] = {name: np.asarray(table[name]).tobytes() for name in ("row_ids", "weights")}
            tables[(rank, key)].update({f"state{i}": s.tobytes() for i, s in enumerate(table["states"])})
            tables[(rank, key)].update({n: a.tobytes() for n, a in table["arrays"].items()})
            policy = table["meta"].get("policy_state")
            if policy:
                tables[(rank, key)]["counters"] = policy["counters"]
    return tables


@pytest.fixture(scope="module")
def budget_reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("budget-reference")
    outcome = faultjob.run(faultjob.make_job(out, server_env=BUDGET_ENV), out)
    assert outcome.code == 0, outcome.log[-5000:]
    return faultjob.final(out), server_tables(out), outcome.log


def test_killed_server_under_a_budget_recovers_bit_identical(tmp_path, budget_reference):
    final, tables, reference_log = budget_reference
    evicted = tables[(0, 3)]["counters"]["evicted_budget"]
    assert evicted > 100, "the budget must evict during the run on the server that is killed"
    assert "(delta)" in reference_log, "periodic snapshots must be deltas"
    out = tmp_path / "run"
    outcome = faultjob.run(faultjob.make_job(out, sleep=0.0, server_env=BUDGET_ENV), out,
                           fault=faultjob.kill_rank(0, delay=0.03), at_step=25)
    log = outcome.log
    assert outcome.code == 0, log[-6000:]
    assert "was killed by SIGKILL; restarting it" in log and "journaled requests replayed" in log
    assert faultjob.same_model(faultjob.final(out), final), "the model differs from an undisturbed run"
    assert faultjob.updates_lost(out) == 0
    assert server_tables(out) == tables, "the servers' tables differ from an undisturbed run"
    assert faultjob.processes_left(outcome.job) == []


def test_killed_server_replays_its_clock_ticks(tmp_path):
    """ttl_seconds runs on the server's clock, whose ticks are journaled: a server killed with kill -9 replays them
    in order with the requests. (An undisturbed run cannot be the reference here: wall-clock TTL depends on how
    fast a run goes.)"""
    out = tmp_path / "run"
    env = {"KVSTORE_LAZY_TTL_SECONDS": "2", "KVSTORE_LAZY_SNAPSHOT_INTERVAL": "60"}   # the journal: from the start
    outcome = faultjob.run(faultjob.make_job(out, sleep=0.05, server_env=env), out,
                           fault=faultjob.kill_rank(0, delay=0.03), at_step=40)
    log = outcome.log
    assert outcome.code == 0, log[-6000:]
    m = re.search(r"journaled requests replayed \(and (\d+) clock ticks\)", log)
    assert m and int(m.group(1)) > 0, log[-4000:]
    assert faultjob.updates_lost(out) == 0
    evicted = sum(t.get("counters", {}).get("evicted_ttl", 0) for t in server_tables(out).values())
    assert evicted > 0, "rows must expire by time during the run"
    assert faultjob.processes_left(outcome.job) == []
