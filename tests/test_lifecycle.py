"""Row lifecycle policies in the server, sans-IO (server.lifecycle, the RowSparseKey hooks): admission by count and
by probability, TTL in rounds and seconds, the memory budget (LRU, LFU), dist_sync and dist_async clocks, strict
declarations and environment, stats, and snapshot/restore continuing exactly. Predictions come from
tests/lifecycle_model.py (written from the documentation), never from the server's own code."""
from __future__ import annotations

import json
import re

import numpy as np
import pytest

import lifecycle_model as lm
from fakepeer import WORKER0, WORKER1, Requests
from kvstore_lazy.protocol import mxnet as proto
from kvstore_lazy.server.core import KVServer
from kvstore_lazy.server.modes import MATERIALIZE_ON_TOUCH
from kvstore_lazy.server.declaration import LazySpec
from kvstore_lazy.server import lifecycle as lifecycle_module
from kvstore_lazy.server.lifecycle import Policy, Settings, admission_coin, kth_smallest, parse_bytes
from kvstore_lazy.worker import lazy_spec_body
from test_server import Peer, initial, optimizer_body

KEY, ROWS, DIM, SEED = 7, 100_000, 4, 42
UNIFORM = '["uniform", {"scale": 0.07}]'


def server(num_workers=2, sync=True, settings=None, optimizer=("sgd", {"learning_rate": 0.1, "momentum": 0.9}),
           materialize=MATERIALIZE_ON_TOUCH, **policy):
    """A server with one lazy key (KEY) with `policy`; pulls create rows (touch) unless a policy says otherwise."""
    peer = Peer(KVServer(0, 1, num_workers, materialize=materialize, lifecycle=settings))
    workers = [Requests(WORKER0), Requests(WORKER1)][:num_workers]
    if sync:
        peer.ok(workers[0].command(proto.SYNC_MODE))
    if optimizer:
        peer.ok(workers[0].command(proto.CONTROLLER, optimizer_body(optimizer[0], **optimizer[1])))
    peer.ok(workers[0].command(proto.LAZY_DECLARE, lazy_spec_body(KEY, (ROWS, DIM), "float32", UNIFORM, SEED,
                                                                  **policy)))
    peer.ok(workers[0].rsp_push(KEY, [], np.zeros((0, DIM))))     # kv.init: no rows
    return peer, workers


def grad(ids, step=0):
    ids = np.asarray(ids, np.int64)
    return ((ids[:, None] % 5) + np.arange(DIM) + step).astype(np.float32) / 8 - 0.3


def sync_round(peer, workers, per_worker, step=0):
    """One dist_sync round: worker w pushes per_worker[w] (sorted unique ids); all replies come at the end."""
    for w, ids in zip(workers, per_worker):
        out = peer.send(w.rsp_push(KEY, ids, grad(ids, step)))
    assert len(out) == len(workers)


def rows_of(peer) -> list[int]:
    return peer.server.snapshot()[1][KEY]["row_ids"].tolist()


def key_stats(peer) -> dict:
    return peer.server.stats()["sparse"][str(KEY)]


def streams(rounds=30, workers=2, seed=0, span=300, batch=25):
    rng = np.random.default_rng(seed)
    return [[np.unique(np.minimum(rng.zipf(1.3, batch) - 1, span - 1)) for _ in range(workers)]
            for _ in range(rounds)]


# ---------------------------------------------------------------------------------------------------------------
# declarations and the environment: checked strictly


def test_policy_fields_are_checked_strictly():
    good = json.loads(lazy_spec_body(KEY, (ROWS, DIM), "float32", UNIFORM, 1, admit_min_count=2, admit_prob=0.5,
                                     ttl_rounds=10, ttl_seconds=None))
    spec = LazySpec.from_json(good)
    assert spec.policy == {"admit_min_count": 2, "admit_prob": 0.5, "ttl_rounds": 10}
    assert LazySpec.from_json(spec.to_json()).to_json() == spec.to_json()
    assert "policy" not in LazySpec.from_json(json.loads(lazy_spec_body(KEY, (5, 2)))).to_json()   # as before
    for bad, words in [({"admit_min_count": 0}, "admit_min_count must be an integer in [1"),
                       ({"admit_min_count": 2.0}, "admit_min_count"), ({"admit_min_count": True}, "admit_min_count"),
                       ({"admit_prob": 0}, "admit_prob must be a number in (0.0, 1.0]"),
                       ({"admit_prob": 1.5}, "admit_prob"), ({"admit_prob": "0.5"}, "admit_prob"),
                       ({"ttl_rounds": -1}, "ttl_rounds"), ({"ttl_seconds": float("nan")}, "ttl_seconds"),
                       ({"ttl": 3}, "unknown policy field(s) 'ttl'"), ([], "policy must be a JSON object")]:
        with pytest.raises(ValueError, match=re.escape(words)):
            LazySpec.from_json(dict(good, policy=bad))


def test_a_bad_policy_declaration_is_refused_and_changes_nothing(caplog):
    peer = Peer(KVServer(0, 1, 1))
    w = Requests(WORKER0)
    body = json.loads(lazy_spec_body(KEY, (ROWS, DIM)))
    before = peer.server.inspect()
    peer.call(w.command(proto.LAZY_DECLARE, json.dumps(dict(body, policy={"admit_prob": 2}))), good=False)
    assert peer.server.inspect() == before and KEY not in peer.server.specs
    assert any("admit_prob must be a number" in r.getMessage() for r in caplog.records)


def test_settings_from_environment():
    s = Settings.from_env({"KVSTORE_LAZY_MEMORY_BUDGET": "512MiB", "KVSTORE_LAZY_EVICT": "LFU",
                           "KVSTORE_LAZY_ADMIT_MIN_COUNT": "3", "KVSTORE_LAZY_TTL_SECONDS": "2.5",
                           "KVSTORE_LAZY_LOW_WATERMARK": "0.8", "KVSTORE_LAZY_ADMIT_CAP": "1000"})
    assert (s.memory_budget, s.evict, s.low_watermark, s.admit_cap) == (512 << 20, "lfu", 0.8, 1000)
    assert s.defaults == Policy(admit_min_count=3, ttl_seconds=2.5)
    assert Settings.from_env({}) == Settings()
    assert [parse_bytes(t) for t in ("8GiB", "1.5GB", "1000", "64 KiB", "3mb")] == [8 << 30, 1_500_000_000, 1000,
                                                                                    64 << 10, 3_000_000]
    for env, words in [({"KVSTORE_LAZY_MEMORY_BUDGET": "8 gigs"}, "KVSTORE_LAZY_MEMORY_BUDGET: '8 gigs' is not a"),
                       ({"KVSTORE_LAZY_MEMORY_BUDGET": "-1"}, "KVSTORE_LAZY_MEMORY_BUDGET"),
                       ({"KVSTORE_LAZY_EVICT": "fifo"}, "KVSTORE_LAZY_EVICT: evict must be one of lru, lfu"),
                       ({"KVSTORE_LAZY_ADMIT_PROB": "0"}, "KVSTORE_LAZY_ADMIT_PROB: admit_prob"),
                       ({"KVSTORE_LAZY_ADMIT_MIN_COUNT": "two"}, "KVSTORE_LAZY_ADMIT_MIN_COUNT='two' is not an int"),
                       ({"KVSTORE_LAZY_TTL_ROUNDS": "1.5"}, "KVSTORE_LAZY_TTL_ROUNDS"),
                       ({"KVSTORE_LAZY_LOW_WATERMARK": "1.2"}, "KVSTORE_LAZY_LOW_WATERMARK")]:
        with pytest.raises(ValueError, match=words):
            Settings.from_env(env)


def test_admission_coin_matches_the_documented_formula():
    rng = np.random.default_rng(3)
    ids = rng.integers(0, 2**63, 200, dtype=np.uint64)
    counts = rng.integers(1, 9, 200).astype(np.uint32)
    got = admission_coin(-5, 9, ids, counts)
    want = [lm.coin(-5, 9, int(i), int(c)) for i, c in zip(ids, counts)]
    assert got.tolist() == want
    assert 0.4 < (got < 0.5).mean() < 0.6


# ---------------------------------------------------------------------------------------------------------------
# admission


def test_min_count_counts_rounds_drops_gradients_and_pulls_store_nothing():
    peer, (w0, w1) = server(admit_min_count=2)
    pulled = peer.values(w0.rsp_pull(KEY, [3, 4])).reshape(2, DIM)
    np.testing.assert_array_equal(pulled, initial([3, 4], ROWS, DIM))
    assert rows_of(peer) == []                                   # touch mode, but rows wait for admission
    sync_round(peer, (w0, w1), [[3, 4], [4]])                   # round 1: 3 and 4 counted once each
    assert rows_of(peer) == [] and key_stats(peer)["pending"] == 2 and key_stats(peer)["dropped"] == 2
    assert peer.server.optimizer.update_count(KEY) == 1          # a round without its rows still counts
    np.testing.assert_array_equal(peer.values(w1.rsp_pull(KEY, [4])), initial([4], ROWS, DIM)[0])   # dropped
    sync_round(peer, (w0, w1), [[4], [5]])                       # round 2: 4 admitted, its gradient applied
    assert rows_of(peer) == [4]
    s = key_stats(peer)
    assert (s["pending"], s["admitted"], s["dropped"], s["evicted"]) == (2, 1, 3, 0)
    want = initial([4], ROWS, DIM)[0] - 0.1 * grad([4])[0]       # SGD from the initial value, fresh momentum
    np.testing.assert_allclose(peer.values(w0.rsp_pull(KEY, [4])), want, rtol=1e-6)


@pytest.mark.parametrize("policy", [dict(admit_min_count=3), dict(admit_prob=0.3),
                                    dict(admit_min_count=2, admit_prob=0.5)], ids=["count", "prob", "both"])
def test_admission_keeps_exactly_the_predicted_rows(policy):
    peer, workers = server(**policy)
    model = lm.KeyModel(KEY, SEED, min_count=policy.get("admit_min_count", 1), prob=policy.get("admit_prob", 1.0))
    for step, per_worker in enumerate(streams()):
        peer.values(workers[0].rsp_pull(KEY, per_worker[0]))
        model.pull(per_worker[0])
        sync_round(peer, workers, per_worker, step)
        model.push_round(np.concatenate(per_worker).tolist())
        assert rows_of(peer) == sorted(model.rows)
    s = key_stats(peer)
    assert (s["pending"], s["admitted"], s["dropped"]) == (len(model.pending), model.admitted, model.dropped)
    assert s["bytes"] + s["pending_bytes"] == model.nbytes()


def test_async_counts_pushes_not_rounds():
    peer, workers = server(sync=False, admit_min_count=2)
    w0, w1 = workers
    peer.ok(w0.rsp_push(KEY, [8], grad([8])))
    peer.ok(w1.rsp_push(KEY, [8], grad([8])))                   # the second push of 8: admitted, applied
    assert rows_of(peer) == [8]
    np.testing.assert_allclose(peer.values(w0.rsp_pull(KEY, [8])), initial([8], ROWS, DIM)[0] - 0.1 * grad([8])[0],
                               rtol=1e-6)


# ---------------------------------------------------------------------------------------------------------------
# age


def test_ttl_rounds_sweeps_and_an_evicted_row_comes_back_fresh():
    peer, workers = server(ttl_rounds=16)                        # sweeps every 2 rounds
    model = lm.KeyModel(KEY, SEED, ttl_rounds=16)
    history = streams(rounds=60, span=400)
    for step, per_worker in enumerate(history):
        peer.values(workers[1].rsp_pull(KEY, per_worker[1]))
        model.pull(per_worker[1])
        sync_round(peer, workers, per_worker, step)
        model.push_round(np.concatenate(per_worker).tolist())
        model.sweep()
        assert rows_of(peer) == sorted(model.rows), step
    assert model.evicted > 20 and key_stats(peer)["evicted_ttl"] == model.evicted
    # a row that came back after its eviction trains from its initial value and a zero momentum again (an
    # optimizer's step count, e.g. Adam's bias correction, is per key in MXNet, not per row: it goes on)
    gone = max(i for i in np.concatenate([np.concatenate(h) for h in history]).tolist() if i not in model.rows)
    sync_round(peer, workers, [[gone], []])
    np.testing.assert_allclose(peer.values(workers[0].rsp_pull(KEY, [gone])),
                               initial([gone], ROWS, DIM)[0] - 0.1 * grad([gone])[0], rtol=1e-6)


def test_ttl_seconds_follow_the_server_clock():
    peer, (w0, w1) = server(ttl_seconds=80.0)                    # sweeps once the clock moved 10 s
    clock = peer.server.lifecycle
    assert clock.wants_clock
    clock.set_clock(1000.0)
    sync_round(peer, (w0, w1), [[1, 2], [3]])
    clock.set_clock(1050.0)
    sync_round(peer, (w0, w1), [[2], []])
    clock.set_clock(1085.0)
    sync_round(peer, (w0, w1), [[], []])                         # 1 and 3 were last pushed at 1000: > 80 s
    assert rows_of(peer) == [2]
    clock.set_clock(1084.0)                                      # the clock never goes back
    assert clock.clock == 1085.0


# ---------------------------------------------------------------------------------------------------------------
# the memory budget


@pytest.mark.parametrize("score_chunk", [None, 7])
def test_budget_lru_keeps_the_predicted_rows_and_bounds_the_bytes(score_chunk, monkeypatch):
    """The rows the documentation predicts, whether a budget pass reads the scores at once or 7 slots at a time."""
    if score_chunk:
        monkeypatch.setattr(lifecycle_module, "SCORE_CHUNK", score_chunk)
    budget = 30_000
    settings = Settings(memory_budget=budget, low_watermark=0.8)
    peer, workers = server(settings=settings)
    model = lm.KeyModel(KEY, SEED, budget_managed=True)
    world = lm.ServerModel([model], budget=budget, low=0.8)
    for step, per_worker in enumerate(streams(rounds=50, span=2000, batch=40)):
        sync_round(peer, workers, per_worker, step)
        model.push_round(np.concatenate(per_worker).tolist())
        world.end_round(KEY)
        assert rows_of(peer) == sorted(model.rows), step
        assert peer.server.lifecycle.accounted(peer.server.keys) == world.accounted() <= budget
    assert model.evicted > 100
    assert key_stats(peer)["evicted_budget"] == model.evicted


def test_budget_keeps_its_reserve_for_the_phases_buffers(monkeypatch):
    """The rows are held to the budget less its reserve (documented: 1/8 of what is over the floor, at most the
    cap), so the same stream keeps the rows the model predicts for that smaller budget; the stats and the warning
    still name the budget the user set."""
    from kvstore_lazy.server import policy as policy_module
    monkeypatch.setattr(policy_module, "RESERVE_FLOOR", 10_000)
    monkeypatch.setattr(policy_module, "RESERVE_MAX", 2_000)
    budget = 30_000
    rows_budget = budget - min(2_000, (budget - 10_000) // 8)          # 28,000: the cap holds
    settings = Settings(memory_budget=budget, low_watermark=0.8)
    assert (settings.reserve, settings.row_budget) == (2_000, rows_budget)
    peer, workers = server(settings=settings)
    model = lm.KeyModel(KEY, SEED, budget_managed=True)
    world = lm.ServerModel([model], budget=rows_budget, low=0.8)
    for step, per_worker in enumerate(streams(rounds=50, span=2000, batch=40)):
        sync_round(peer, workers, per_worker, step)
        model.push_round(np.concatenate(per_worker).tolist())
        world.end_round(KEY)
        assert rows_of(peer) == sorted(model.rows), step
        assert peer.server.lifecycle.accounted(peer.server.keys) == world.accounted() <= rows_budget
    assert model.evicted > 100
    assert peer.server.lifecycle.stats(peer.server.keys)["memory_budget"] == budget


@pytest.mark.parametrize("budget", [0, 1 << 20, 32 << 20, (32 << 20) + 7, 100 << 20, 1 << 30, 1100 << 20, 8 << 30])
def test_the_reserve_is_a_share_of_the_budget_over_its_floor_and_budget_for_inverts_it(budget):
    settings = Settings(memory_budget=budget)
    assert settings.reserve == min(128 << 20, max(0, budget - (32 << 20)) // 8)
    assert settings.row_budget == budget - settings.reserve
    want = Settings.budget_for(settings.row_budget)
    assert Settings(memory_budget=want).row_budget >= settings.row_budget
    assert want <= budget
    if budget:      # the smallest
        assert Settings(memory_budget=want - 1).row_budget < settings.row_budget


@pytest.mark.parametrize("score_chunk", [None, 2])
def test_budget_lfu_evicts_the_rarely_pushed_rows_first(score_chunk, monkeypatch):
    if score_chunk:
        monkeypatch.setattr(lifecycle_module, "SCORE_CHUNK", score_chunk)
    # a row: 4 x 4 weights + 4 x 4 momentum + 8 of columns + 8 of id = 48 bytes; the index 2048 x 4
    peer, workers = server(num_workers=1, settings=Settings(memory_budget=2048 * 4 + 10 * 48, evict="lfu",
                                                            low_watermark=1.0))
    for _ in range(3):
        sync_round(peer, workers, [[1, 2, 3]])                   # pushed in 3 rounds each
    sync_round(peer, workers, [list(range(10, 20))])             # 13 rows: over the budget by 3 rows
    assert rows_of(peer) == [1, 2, 3] + list(range(13, 20))      # 3 of those pushed once go, the smallest ids


def test_pulls_never_store_beyond_the_budget_for_long():
    """A pull (touch) may create rows between eviction points; the next round end evicts them again."""
    peer, workers = server(num_workers=1, settings=Settings(memory_budget=2048 * 4 + 100 * 48))
    (w,) = workers
    peer.values(w.rsp_pull(KEY, list(range(500))))
    assert len(rows_of(peer)) == 500
    sync_round(peer, workers, [[0]])
    assert len(rows_of(peer)) <= 100 and 0 in rows_of(peer)     # the pushed row is the most recent


# ---------------------------------------------------------------------------------------------------------------
# snapshots carry the policy state: a restored server continues exactly


@pytest.mark.parametrize("policy,settings", [(dict(admit_min_count=2, ttl_rounds=8), None),
                                             (dict(admit_prob=0.5), Settings(memory_budget=20_000))],
                         ids=["count+ttl", "prob+budget"])
def test_restored_server_continues_exactly(policy, settings):
    history = streams(rounds=40, span=1500, batch=40)
    a, wa = server(settings=settings, **policy)
    for step, per_worker in enumerate(history[:20]):
        sync_round(a, wa, per_worker, step)
    meta, tables = a.server.snapshot()
    b = Peer(KVServer(0, 1, 2, lifecycle=settings))
    b.server.restore(json.loads(json.dumps(meta)), tables)
    wb = [Requests(WORKER0), Requests(WORKER1)]
    assert b.server.inspect() == a.server.inspect()
    for step, per_worker in enumerate(history[20:], start=20):
        sync_round(a, wa, per_worker, step)
        sync_round(b, wb, per_worker, step)
    assert b.server.inspect() == a.server.inspect()
    assert b.server.stats()["sparse"] == a.server.stats()["sparse"]
    assert key_stats(a)["admitted"] > 0


def test_pending_ids_are_capped_stalest_first():
    peer, workers = server(num_workers=1, settings=Settings(admit_cap=10), admit_min_count=3)
    for step in range(4):
        sync_round(peer, workers, [list(range(step * 4, step * 4 + 4))])   # 16 ids, each pushed once
    s = key_stats(peer)
    # over 10 pending ids, the oldest are forgotten down to 9: after round 3 (12 ids) 3 went, after round 4 4 more
    assert (s["pending"], s["forgotten"]) == (9, 7)
    pending = peer.server.snapshot()[1][KEY]["arrays"]["pending_ids"].tolist()
    assert pending == list(range(7, 16))


def test_server_environment_errors_stop_the_start():
    from kvstore_lazy.node.runtime import Config, StartupError
    base = {"DMLC_ROLE": "server", "DMLC_PS_ROOT_URI": "127.0.0.1", "DMLC_PS_ROOT_PORT": "9", "DMLC_NUM_WORKER": "1",
            "DMLC_NUM_SERVER": "1", "DMLC_NODE_HOST": "127.0.0.1"}
    with pytest.raises(StartupError, match="KVSTORE_LAZY_EVICT"):
        Config.from_env(dict(base, KVSTORE_LAZY_EVICT="random"))
    cfg = Config.from_env(dict(base, KVSTORE_LAZY_MEMORY_BUDGET="1GiB", KVSTORE_LAZY_SNAPSHOT_DIR="/s"))
    assert cfg.lifecycle.memory_budget == 1 << 30 and cfg.lifecycle.track_changes
    assert not Config.from_env(base).lifecycle.track_changes


@pytest.mark.parametrize("dtype,span", [(np.int32, 300), (np.int32, 2**31 - 1), (np.int64, 2**40)])
def test_the_budget_finds_the_kth_smallest_score_as_a_sort_does(dtype, span):
    """A budget pass's threshold: a histogram for narrow int32 scores (LRU's rounds), a partition otherwise."""
    rng = np.random.default_rng(3)
    for n in (1, 2, 17, 5000):
        values = (rng.integers(0, span, n) - span // 2).astype(dtype)
        for k in (0, n // 3, n - 1):
            for parts in ([values], np.array_split(values, 3)):
                kept = [p.copy() for p in parts]
                got = kth_smallest(parts, k)
                assert got == np.sort(values)[k] and type(got) is dtype
                assert all(np.array_equal(p, q) for p, q in zip(parts, kept))     # left as they were
                # the same given as chunks, as a budget pass reads the scores of a large table
                chunked = [lambda p=p: iter(np.array_split(p, 4)) for p in parts]
                assert kth_smallest(chunked, k) == got


def test_a_budget_plain_row_sparse_keys_outgrow_is_named_with_the_remedy(caplog):
    """Rows of a row_sparse key that was not declared lazy cannot be evicted: the warning names them, their bytes and
    the declaration that would let the budget evict them."""
    import logging
    caplog.set_level(logging.WARNING, logger="kvstore_lazy")
    peer, workers = server(settings=Settings(memory_budget=4 << 10))
    plain = KEY + 1
    peer.ok(workers[0].rsp_push(plain, list(range(500)), np.ones(500 * DIM, np.float32)))   # kv.init with rows
    sync_round(peer, workers, [np.arange(3), np.arange(3)])
    said = [r.getMessage() for r in caplog.records if "memory budget" in r.getMessage()]
    assert len(said) == 1, said
    assert re.search(r"rows of row_sparse keys not declared lazy, \d+ bytes \(the budget evicts only lazy keys' "
                     r"rows: declare them with kvstore_lazy.worker.init_lazy", said[0]), said[0]
    assert "disk tier" not in said[0]
