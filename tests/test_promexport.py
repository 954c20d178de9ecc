"""The Prometheus exporter (kvstore_lazy.node.promexport) over a real KVServer and a real HTTP scrape on 127.0.0.1.

A scrape shows the last record the loop published and nothing newer (the HTTP thread never reads the server);
that record equals KVServer.stats() at the moment of publish; request kinds, bad requests and histograms count
what was fed; every number a future stats() field carries is exported without code; bad settings are refused
with the variable named. Every HTTP request has a timeout and every exporter is closed.
"""
from __future__ import annotations

import json
import math
import socket
import urllib.request

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from fakepeer import F32, F64, WORKER1, Requests
from kvstore_lazy.node.promexport import (REQUEST_BOUNDS, Exporter, Histogram, _stats_families, address_from_env,
                                     request_kind)
from kvstore_lazy.protocol import mxnet as mx
from kvstore_lazy.protocol.pbmeta import Meta
from kvstore_lazy.server.core import KVServer

# what KVStore.set_optimizer sends for mx.optimizer.SGD(learning_rate=0.1, momentum=0.9): pickle.dumps(opt, 0),
# captured from mxnet 1.9.1 (this file also runs on the server's Python, which has no mxnet)
SGD_MOMENTUM = (
    b"ccopy_reg\n_reconstructor\np0\n(cmxnet.optimizer.optimizer\nSGD\np1\nc__builtin__\nobject\np2\n"
    b"Ntp3\nRp4\n(dp5\nVrescale_grad\np6\nF1.0\nsVlr_scheduler\np7\nNsVlr\np8\nF0.1\nsVwd\np9\nF0.0\n"
    b"sVlr_mult\np10\n(dp11\nsVwd_mult\np12\n(dp13\nsVbegin_num_update\np14\nI0\nsVnum_update\np15\nI0\n"
    b"sV_all_index_update_counts\np16\n(dp17\nI0\n(dp18\nssV_index_update_count\np19\ng18\n"
    b"sVclip_gradient\np20\nNsVmulti_precision\np21\nI00\nsVaggregate_num\np22\nI4\nsVidx2name\np23\n"
    b"(dp24\nsVsym_info\np25\n(tsVallow_np_array\np26\nI00\nsVmomentum\np27\nF0.9\nsVlazy_update\np28\n"
    b"I01\nsb.")


class Van:
    """The two byte counters publish reads from the transport (the real one needs sockets)."""

    bytes_received, bytes_sent = 1234, 5678


def scrape(port: int) -> dict:
    """{(sample name, sorted label items): value} of one scrape."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def value(samples: dict, name: str, **labels):
    return samples.get((name, tuple(sorted(labels.items()))))


@pytest.fixture
def exporter():
    made = Exporter("127.0.0.1", 0)
    made.start()
    yield made
    made.close()


class Fed:
    """A KVServer fed requests the way runtime.ServerNode._dispatch feeds them to the exporter."""

    def __init__(self, exporter: Exporter) -> None:
        self.server = KVServer(0, 1, 2)
        self.exporter = exporter
        self.req = Requests()

    def send(self, msg, seconds: float = 0.001) -> list:
        bad = self.server.bad_requests
        replies = self.server.handle(msg)
        self.exporter.request(msg.meta, seconds, self.server.bad_requests - bad)
        return replies

    def publish(self) -> None:
        self.exporter.publish(self.server, Van(), now=0.0)


def trained(fed: Fed) -> None:
    r = fed.req
    fed.send(r.command(mx.SYNC_MODE))
    fed.send(r.command(mx.CONTROLLER, SGD_MOMENTUM))
    fed.send(r.command(mx.LAZY_DECLARE, json.dumps({"key": 3, "rows": 1000, "row_shape": [4], "dtype": "float32",
                                                    "init": '["zero", {}]', "seed": 1, "bound": 1_000_000})))
    fed.send(r.rsp_push(3, [], np.zeros((0, 4), np.float32)))             # the lazy init: no rows
    fed.send(r.push(5, np.ones(6, np.float32)))                            # dense init
    other = Requests(node_id=WORKER1)
    for _ in range(3):
        fed.send(r.rsp_push(3, [1, 7], np.ones((2, 4), np.float32)))
        fed.send(other.rsp_push(3, [7, 9], np.ones((2, 4), np.float32)))
        fed.send(r.push(5, np.ones(6, np.float32)))
        fed.send(other.push(5, np.ones(6, np.float32)))
    fed.send(r.pull(5))
    fed.send(r.rsp_pull(3, [1, 2]))


def test_a_scrape_equals_stats_at_publish_and_nothing_newer(exporter):
    fed = Fed(exporter)
    assert not any(name.startswith("kvstore_lazy") for name, _ in scrape(exporter.port))   # nothing published
    trained(fed)
    fed.publish()
    stats = fed.server.stats()
    samples = scrape(exporter.port)
    assert value(samples, "kvstore_lazy_key_rows", key="3") == stats["sparse"]["3"]["rows"] == 3
    assert value(samples, "kvstore_lazy_key_bytes", key="3") == stats["sparse"]["3"]["bytes"] > 0
    assert value(samples, "kvstore_lazy_key_lazy", key="3") == 1
    assert value(samples, "kvstore_lazy_dense_keys") == stats["dense_keys"] == 1
    assert value(samples, "kvstore_lazy_dense_bytes") == stats["dense_bytes"] == 24
    assert value(samples, "kvstore_lazy_server_info", rank="0", num_servers="1", num_workers="2",
                 materialize="push") == 1
    assert value(samples, "kvstore_lazy_optimizer_updates_total", key="3") == 3
    assert value(samples, "kvstore_lazy_optimizer_updates_total", key="5") == 3
    assert value(samples, "kvstore_lazy_received_bytes_total") == 1234
    assert value(samples, "kvstore_lazy_sent_bytes_total") == 5678
    assert value(samples, "kvstore_lazy_requests_total", kind="push_row_sparse") == 7
    assert value(samples, "kvstore_lazy_requests_total", kind="push_dense") == 7
    assert value(samples, "kvstore_lazy_requests_total", kind="pull_dense") == 1
    assert value(samples, "kvstore_lazy_requests_total", kind="pull_row_sparse") == 1
    assert value(samples, "kvstore_lazy_requests_total", kind="command_controller") == 1
    assert value(samples, "process_resident_memory_bytes") > 0

    # the server moves on; until the loop publishes again a scrape shows the old record
    fed.send(fed.req.rsp_push(3, [20, 21], np.ones((2, 4), np.float32)))
    fed.send(Requests(node_id=WORKER1).rsp_push(3, [22], np.ones((1, 4), np.float32)))
    assert fed.server.stats()["sparse"]["3"]["rows"] == 6
    assert value(scrape(exporter.port), "kvstore_lazy_key_rows", key="3") == 3
    fed.publish()
    assert value(scrape(exporter.port), "kvstore_lazy_key_rows", key="3") == 6


def test_bad_requests_by_kind_add_up_to_the_servers_count(exporter):
    fed = Fed(exporter)
    trained(fed)
    fed.send(fed.req.command(mx.LAZY_DECLARE, "not json"))                   # a bad command
    fed.send(fed.req.rsp_pull(3, [5000]))                                   # a row past the key's rows
    fed.send(fed.req.push(5, np.ones(6, np.float64), flag=F64))             # wrong dtype for the dense key
    fed.send(fed.req.push(5, np.ones(6, np.float32), flag=F32))             # fine
    exporter.malformed()
    fed.publish()
    samples = scrape(exporter.port)
    bad = {dict(labels)["kind"]: v for (name, labels), v in samples.items()
           if name == "kvstore_lazy_bad_requests_total"}
    assert bad == {"command_lazy_declare": 1, "pull_row_sparse": 1, "push_dense": 1, "malformed": 1}
    assert sum(v for k, v in bad.items() if k != "malformed") == fed.server.stats()["bad_requests"] == 3


def test_latency_histograms_count_every_request_in_its_bucket(exporter):
    fed = Fed(exporter)
    for seconds in (0.00005, 0.0003, 0.0003, 0.02, 30.0):   # 5e-5 sits on a bound: le counts it there
        fed.send(fed.req.command(mx.SYNC_MODE), seconds)
    fed.publish()
    samples = scrape(exporter.port)

    def bucket(le):
        return value(samples, "kvstore_lazy_request_duration_seconds_bucket", kind="command_sync_mode", le=le)

    assert bucket("5e-05") == 1 and bucket("0.00025") == 1 and bucket("0.0005") == 3 and bucket("0.025") == 4
    assert bucket("10.0") == 4 and bucket("+Inf") == 5
    assert value(samples, "kvstore_lazy_request_duration_seconds_count", kind="command_sync_mode") == 5
    assert math.isclose(value(samples, "kvstore_lazy_request_duration_seconds_sum", kind="command_sync_mode"),
                        30.02065)


def test_snapshots_give_duration_last_time_and_age(exporter):
    exporter.snapshot_written("latest", 0.2)
    exporter.snapshot_written("latest", 0.4)
    exporter.snapshot_written("tagged", 3.0)
    exporter.publish(None, Van(), now=0.0)
    samples = scrape(exporter.port)
    assert value(samples, "kvstore_lazy_snapshot_duration_seconds_count", kind="latest") == 2
    assert value(samples, "kvstore_lazy_snapshot_duration_seconds_bucket", kind="tagged", le="2.5") == 0
    assert value(samples, "kvstore_lazy_snapshot_duration_seconds_bucket", kind="tagged", le="5.0") == 1
    written = value(samples, "kvstore_lazy_snapshot_last_timestamp_seconds", kind="tagged")
    published = value(samples, "kvstore_lazy_metrics_published_timestamp_seconds")
    assert 0 < written <= published
    assert 0 <= value(samples, "kvstore_lazy_snapshot_age_seconds", kind="latest") < 60
    assert value(samples, "kvstore_lazy_server_info") is None      # before registration: no server yet


@pytest.mark.parametrize("meta, kind", [
    (Meta(head=mx.command_code(mx.DEFAULT, F32), push=True), "push_dense"),
    (Meta(head=mx.command_code(mx.DEFAULT, F64), pull=True), "pull_dense"),
    (Meta(head=mx.command_code(mx.DEFAULT, F32), push=True, pull=True), "pushpull_dense"),
    (Meta(head=mx.command_code(mx.ROW_SPARSE, F32), push=True), "push_row_sparse"),
    (Meta(head=mx.command_code(mx.ROW_SPARSE, F32), pull=True), "pull_row_sparse"),
    (Meta(head=mx.command_code(mx.COMPRESSED, F32), push=True), "push_compressed"),
    (Meta(head=mx.command_code(7, F32), push=True), "push_unknown"),
    (Meta(head=mx.STOP_SERVER, simple_app=True), "command_stop_server"),
    (Meta(head=mx.LAZY_SET_COUNTS, simple_app=True), "command_lazy_set_counts"),
    (Meta(head=4242, simple_app=True), "command_unknown"),      # a peer's head never becomes a label
])
def test_request_kinds(meta, kind):
    assert request_kind(meta) == kind


def test_every_number_of_a_new_stats_field_is_exported():
    """What issue 13's lifecycle counters look like in stats(): exported with no code in promexport."""
    from prometheus_client.core import GaugeMetricFamily

    stats = {"rank": 0, "bad_requests": 2, "dense_keys": 0, "dense_bytes": 0,
             "sparse": {"3": {"rows": 5, "bytes": 640, "lazy": True, "evicted": 2, "policy": "lru"},
                        "12": {"rows": 1, "bytes": 128, "lazy": False}},
             "lifecycle": {"memory_budget": None, "accounted_bytes": 768, "evict": "lru", "budget": {"passes": 4}},
             "requests": 9}
    got = {(f.name, tuple(s.labels.items())): s.value for f in _stats_families(stats, GaugeMetricFamily)
           for s in f.samples}
    assert got == {
        ("kvstore_lazy_key_rows", (("key", "3"),)): 5, ("kvstore_lazy_key_rows", (("key", "12"),)): 1,
        ("kvstore_lazy_key_bytes", (("key", "3"),)): 640, ("kvstore_lazy_key_bytes", (("key", "12"),)): 128,
        ("kvstore_lazy_key_lazy", (("key", "3"),)): 1, ("kvstore_lazy_key_lazy", (("key", "12"),)): 0,
        ("kvstore_lazy_key_evicted", (("key", "3"),)): 2,
        ("kvstore_lazy_dense_keys", ()): 0, ("kvstore_lazy_dense_bytes", ()): 0,
        ("kvstore_lazy_lifecycle_accounted_bytes", ()): 768, ("kvstore_lazy_lifecycle_budget_passes", ()): 4,
        ("kvstore_lazy_stats_requests", ()): 9,    # would collide with kvstore_lazy_requests_total's family
    }


def test_histogram_buckets_are_cumulative():
    hist = Histogram(REQUEST_BOUNDS)
    for seconds in (1e-6, 1e-6, 0.003, 99.0):
        hist.observe(seconds)
    buckets = dict(hist.buckets())
    assert buckets["5e-05"] == 2 and buckets["0.0025"] == 2 and buckets["0.005"] == 3 and buckets["+Inf"] == 4
    assert list(buckets.values()) == sorted(buckets.values())


@pytest.mark.parametrize("env, local, expected", [
    ({}, False, None),
    ({"KVSTORE_LAZY_METRICS_PORT": " "}, False, None),
    ({"KVSTORE_LAZY_METRICS_PORT": "9100"}, False, ("0.0.0.0", 9100)),
    ({"KVSTORE_LAZY_METRICS_PORT": "9100"}, True, ("127.0.0.1", 9100)),
    ({"KVSTORE_LAZY_METRICS_PORT": "0", "KVSTORE_LAZY_METRICS_BIND": "10.1.2.3"}, False, ("10.1.2.3", 0)),
])
def test_address_from_env(env, local, expected):
    assert address_from_env(env, local) == expected


@pytest.mark.parametrize("port, says", [("http", "KVSTORE_LAZY_METRICS_PORT='http' is not a port number"),
                                        ("70000", "KVSTORE_LAZY_METRICS_PORT=70000 is outside 0..65535"),
                                        ("-1", "outside 0..65535")])
def test_a_bad_port_is_refused_by_name(port, says):
    with pytest.raises(ValueError, match=says):
        address_from_env({"KVSTORE_LAZY_METRICS_PORT": port})


def test_a_busy_port_says_which_address():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(OSError, match=f"metrics: cannot listen on 127.0.0.1:{port} .*in use"):
            Exporter("127.0.0.1", port).start()
