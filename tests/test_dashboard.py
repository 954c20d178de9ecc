"""The Grafana dashboard (docker/grafana/kvstore-lazy.json) queries only metrics the servers export.

A real Exporter (kvstore_lazy.node.promexport) on 127.0.0.1 publishes a real KVServer that served a few requests
with a memory budget and a disk tier (so rows went to disk and came back), and a snapshot; every metric name a
panel's PromQL uses must be in that scrape. tests/test_metrics_integration.py checks the numbers; this checks the
names, the panels' selectors and the dashboard's shape. Whether every panel returns data from a real Prometheus
scraping a real job is the opt-in `make check-dashboard` (scripts/prometheus_check.py).
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from fakepeer import WORKER1, Requests
from kvstore_lazy.node.promexport import Exporter
from kvstore_lazy.server import core
from kvstore_lazy.server.core import KVServer
from test_promexport import Fed, scrape, trained

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "docker" / "grafana" / "kvstore-lazy.json"
GUIDE = ROOT / "docs" / "guides" / "metrics.md"
SERIES_SUFFIXES = ("_bucket", "_count", "_sum", "_created")
# PromQL words that are not metric names
FUNCTIONS = {"rate", "sum", "by", "histogram_quantile", "time", "le", "kind", "key", "instance", "job"}
IDENTIFIER = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
SELECTOR = '{job=~"$job", instance=~"$instance"}'


def panels() -> list[dict]:
    board = json.loads(DASHBOARD.read_text())
    return [p for p in board["panels"] if p["type"] != "row"]


def metric_names(expr: str) -> set[str]:
    """The metric names of one PromQL expression (label matchers, ranges and numbers removed)."""
    bare = re.sub(r"\{[^}]*\}|\[[^\]]*\]|\"[^\"]*\"|\b\d+(\.\d+)?\b", " ", expr)
    return {word for word in IDENTIFIER.findall(bare) if word not in FUNCTIONS}


def queried() -> dict[str, set[str]]:
    """{metric name: titles of the panels that query it}."""
    out: dict[str, set[str]] = {}
    for panel in panels():
        for target in panel["targets"]:
            for name in metric_names(target["expr"]):
                out.setdefault(name, set()).add(panel["title"])
    return out


class FakeVan:
    bytes_received, bytes_sent = 10, 20


@pytest.fixture
def scraped(tmp_path):
    """The sample names of one scrape of a budgeted server with a disk tier, after a few rounds and pulls."""
    settings = core.Settings.from_env({"KVSTORE_LAZY_MEMORY_BUDGET": "1KiB",
                                       "KVSTORE_LAZY_DISK_DIR": str(tmp_path / "disk")})
    exporter = Exporter("127.0.0.1", 0)
    exporter.start()
    try:
        fed = Fed(exporter)
        fed.server = KVServer(0, 1, 2, lifecycle=settings)
        trained(fed)
        other = Requests(node_id=WORKER1)
        for step in range(4):     # more rows than the budget holds: the budget moves some to disk
            ids = list(range(20 * step, 20 * step + 20))
            fed.send(fed.req.rsp_push(3, ids, np.ones((20, 4), np.float32)))
            fed.send(other.rsp_push(3, ids, np.ones((20, 4), np.float32)))
        fed.send(fed.req.rsp_pull(3, list(range(80))))          # brings rows back from disk
        exporter.snapshot_written("latest", 0.1)
        exporter.malformed()
        exporter.publish(fed.server, FakeVan(), now=0.0)
        stats = fed.server.stats()["sparse"]["3"]
        assert stats["disk_rows"] > 0 and stats["promoted"] > 0   # the disk tier was used both ways
        samples = scrape(exporter.port)
    finally:
        exporter.close()
    return {name for name, _ in samples}


def test_every_metric_a_panel_queries_is_exported(scraped):
    missing = {name: sorted(titles) for name, titles in queried().items() if name not in scraped}
    assert not missing, f"panels query metrics the exporter does not emit: {missing}"


def test_the_guide_explains_every_metric_the_exporter_emits(scraped):
    guide = GUIDE.read_text()
    families = {re.sub("|".join(s + "$" for s in SERIES_SUFFIXES), "", name) for name in scraped
                if name.startswith("kvstore_lazy_")}
    unexplained = sorted(name for name in families if f"`{name}`" not in guide)
    assert not unexplained, f"metrics docs/guides/metrics.md does not explain: {unexplained}"


def test_the_dashboard_covers_what_operators_watch():
    names = set(queried())
    for wanted in ("kvstore_lazy_key_rows", "kvstore_lazy_key_bytes", "kvstore_lazy_lifecycle_accounted_bytes",
                   "kvstore_lazy_lifecycle_memory_budget", "kvstore_lazy_key_disk_rows", "kvstore_lazy_key_hit_rate",
                   "kvstore_lazy_key_promoted", "kvstore_lazy_requests_total",
                   "kvstore_lazy_request_duration_seconds_bucket", "kvstore_lazy_snapshot_age_seconds"):
        assert wanted in names


def test_every_selector_follows_the_dashboards_variables():
    for panel in panels():
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            for name in metric_names(target["expr"]):
                assert f"{name}{SELECTOR}" in target["expr"], (panel["title"], name)
            assert target["datasource"]["uid"] == "${datasource}"


def test_metric_names_of_an_expression():
    expr = 'histogram_quantile(0.99, sum by (le, kind) (rate(kvstore_lazy_x_bucket{job=~"$job"}[$__rate_interval])))'
    assert metric_names(expr) == {"kvstore_lazy_x_bucket"}
    assert metric_names('time() - a_b{x="y"} / c') == {"a_b", "c"}
