"""Prometheus metrics of one server (KVSTORE_LAZY_METRICS_PORT), served over HTTP by ``prometheus_client``.

Owns: what the exported numbers are and how they cross from the server's loop to the HTTP thread. Does not own
any server state, and never reads it from the HTTP thread: the loop that owns every socket and key
(``runtime.ServerNode``) counts requests, bad requests, latencies and snapshots in plain Python numbers here
(:meth:`Exporter.request`, :meth:`Exporter.snapshot_written`), and every PUBLISH_INTERVAL seconds copies them,
``KVServer.stats()``, the optimizer's update counts and the van's byte counters into one immutable
:class:`Published` record (:meth:`Exporter.publish`). A scrape (``prometheus_client``'s HTTP thread calling
:meth:`Exporter.collect`) reads only the latest record, under a lock: every number in one scrape is from the same
moment, at most PUBLISH_INTERVAL (plus one loop poll) old, and ``kvstore_lazy_metrics_published_timestamp_seconds``
says when that moment was.

New counters need no code here: every number in ``KVServer.stats()`` is exported as a gauge, per row_sparse key
(``stats()["sparse"][key]``: ``kvstore_lazy_key_<field>{key="K"}``) or server-wide (``kvstore_lazy_<field>``,
nested dicts joined with ``_``, e.g. ``"lifecycle": {"evicted": n}`` -> ``kvstore_lazy_lifecycle_evicted``).

Label values come from bounded sets (request kinds, command names we know, stored keys), never from a peer's
free text, so a hostile peer cannot grow the exposition. prometheus_client is imported only when metrics are on
(about 54 ms and 5.5 MiB of RSS at import on the dev VM).
"""
from __future__ import annotations

import bisect
import logging
import math
import re
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping

from kvstore_lazy.protocol import ProtocolError
from kvstore_lazy.protocol import mxnet as mx
from kvstore_lazy.protocol.pbmeta import Meta

__all__ = ["Exporter", "Published", "address_from_env", "request_kind", "REQUEST_BOUNDS", "SNAPSHOT_BOUNDS"]

log = logging.getLogger("kvstore_lazy")

PORT_ENV, BIND_ENV = "KVSTORE_LAZY_METRICS_PORT", "KVSTORE_LAZY_METRICS_BIND"
PUBLISH_INTERVAL = 1.0     # s between the loop's copies of its numbers for the HTTP thread
PREFIX = "kvstore_lazy_"
# histogram bucket upper bounds (seconds); +Inf is implied
REQUEST_BOUNDS = (5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
SNAPSHOT_BOUNDS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)

COMMAND_NAMES = {
    mx.CONTROLLER: "controller", mx.SET_MULTI_PRECISION: "set_multi_precision", mx.STOP_SERVER: "stop_server",
    mx.SYNC_MODE: "sync_mode", mx.SET_GRADIENT_COMPRESSION: "set_gradient_compression",
    mx.SET_PROFILER_PARAMS: "set_profiler_params", mx.LAZY_DECLARE: "lazy_declare", mx.LAZY_STATS: "lazy_stats",
    mx.LAZY_ROWS: "lazy_rows", mx.LAZY_SNAPSHOT: "lazy_snapshot", mx.LAZY_ALIAS: "lazy_alias",
    mx.LAZY_SET_COUNTS: "lazy_set_counts",
}
STORED_TYPES = {mx.DEFAULT: "dense", mx.ROW_SPARSE: "row_sparse", mx.COMPRESSED: "compressed"}
MALFORMED = "malformed"    # frames that did not decode into a message (no kind known)

# stats() fields that have their own metric (or label) and are not exported again as plain gauges
STATS_SKIP = frozenset({"rank", "sparse", "bad_requests"})
# our own families: a stats() field of the same name is exported as kvstore_lazy_stats_<name>
OWN = frozenset({"metrics_published_timestamp_seconds", "server_info", "requests", "bad_requests",
                 "request_duration_seconds", "optimizer_updates", "optimizer_num_update", "received_bytes",
                 "sent_bytes", "snapshot_duration_seconds", "snapshot_last_timestamp_seconds",
                 "snapshot_age_seconds"})
HELP = {
    "key_rows": "Rows stored for a row_sparse key on this server (its part of the key).",
    "key_bytes": "Bytes held for a row_sparse key's stored rows: values, optimizer states and the row index.",
    "key_lazy": "1 if the key was declared lazily (init_lazy), 0 for a plain row_sparse key.",
    "key_local_rows": "Rows of the key in this server's range (its share of input_dim).",
    "key_row_offset": "Global row id of this server's first row of the key.",
    "dense_keys": "Dense keys stored on this server.",
    "dense_bytes": "Bytes of all dense keys' values (with float32 master copies under multi-precision).",
}
_NAME_UNSAFE = re.compile(r"[^a-zA-Z0-9_]")


def address_from_env(env: Mapping[str, str], local: bool = False) -> tuple[str, int] | None:
    """(bind address, port) from KVSTORE_LAZY_METRICS_PORT / _BIND, or None when metrics are off (no port set).
    Port 0 takes a free port (logged). The address defaults to 0.0.0.0 (a scraper on any host), or 127.0.0.1
    under DMLC_LOCAL (a single-machine job, as ps-lite then binds); ValueError names a bad value."""
    port_text = env.get(PORT_ENV, "").strip()
    if not port_text:
        return None
    try:
        port = int(port_text)
    except ValueError:
        raise ValueError(f"{PORT_ENV}={port_text!r} is not a port number") from None
    if not 0 <= port <= 65535:
        raise ValueError(f"{PORT_ENV}={port} is outside 0..65535")
    host = env.get(BIND_ENV, "").strip() or ("127.0.0.1" if local else "0.0.0.0")
    return host, port


def request_kind(meta: Meta) -> str:
    """The ``kind`` label of a request: ``command_<name>`` for SimpleApp commands, else ``<op>_<type>`` with op
    push, pull or pushpull and type dense, row_sparse or compressed (``unknown`` for heads no MXNet worker sends)."""
    if meta.simple_app:
        return "command_" + COMMAND_NAMES.get(meta.head, "unknown")
    op = "pushpull" if meta.push and meta.pull else "push" if meta.push else "pull"
    try:
        stored = STORED_TYPES[mx.decode_command(meta.head).request_type]
    except ProtocolError:
        stored = "unknown"
    return f"{op}_{stored}"


class Histogram:
    """Bucket counts (not cumulative; the last one is +Inf) and the sum, as plain numbers the loop updates."""

    __slots__ = ("bounds", "counts", "total")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.total = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1   # le: value <= bound
        self.total += value

    def copy(self) -> "Histogram":
        out = Histogram(self.bounds)
        out.counts, out.total = list(self.counts), self.total
        return out

    def buckets(self) -> list[tuple[str, float]]:
        """Cumulative (le, count) pairs as prometheus_client's HistogramMetricFamily takes them."""
        out: list[tuple[str, float]] = []
        running = 0
        for bound, count in zip(list(self.bounds) + [math.inf], self.counts):
            running += count
            out.append(("+Inf" if bound == math.inf else repr(float(bound)), running))
        return out


@dataclass(frozen=True)
class Published:
    """What one publish copied from the loop; read-only for the HTTP thread."""

    wall_time: float
    info: dict[str, str]
    stats: dict[str, Any]
    updates: dict[str, int]
    num_update: int | None
    bytes_received: int
    bytes_sent: int
    requests: dict[str, int]
    bad_requests: dict[str, int]
    latency: dict[str, Histogram]
    snapshots: dict[str, Histogram]
    snapshot_last: dict[str, tuple[float, float]]   # kind -> (wall time written, seconds it took)


@dataclass(eq=False)   # registered as a collector: hashed by identity
class Exporter:
    """The loop's side (request, malformed, snapshot_written, publish) and the HTTP thread's (collect)."""

    host: str
    port: int
    interval: float = PUBLISH_INTERVAL
    next_publish: float = 0.0          # time.monotonic() of the next publish the loop owes
    requests: dict[str, int] = field(default_factory=dict)
    bad_requests: dict[str, int] = field(default_factory=dict)
    latency: dict[str, Histogram] = field(default_factory=dict)
    snapshots: dict[str, Histogram] = field(default_factory=dict)
    snapshot_last: dict[str, tuple[float, float]] = field(default_factory=dict)
    _published: Published | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _httpd: Any = None

    # -- the HTTP server ------------------------------------------------------------------------------------------

    def start(self) -> int:
        """Listen (prometheus_client's threaded HTTP server on its own daemon thread); return the bound port.
        OSError says which address could not be used."""
        from prometheus_client import CollectorRegistry, ProcessCollector, start_http_server

        registry = CollectorRegistry(auto_describe=False)
        ProcessCollector(registry=registry)
        registry.register(self)
        try:
            self._httpd, _ = start_http_server(self.port, addr=self.host, registry=registry)
        except OSError as exc:
            raise OSError(f"metrics: cannot listen on {self.host}:{self.port} ({PORT_ENV}, {BIND_ENV}): "
                          f"{exc.strerror or exc}") from None
        self.port = int(self._httpd.server_address[1])
        log.info("metrics on http://%s:%d/metrics", self.host, self.port)
        return self.port

    def close(self) -> None:
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None

    # -- the loop's side ------------------------------------------------------------------------------------------

    def request(self, meta: Meta, seconds: float, bad: int) -> None:
        """One request handled in `seconds` (decode, handling and sending its replies); `bad` refusals counted for
        it by the KVServer (its bad_requests before and after)."""
        kind = request_kind(meta)
        self.requests[kind] = self.requests.get(kind, 0) + 1
        if bad:
            self.bad_requests[kind] = self.bad_requests.get(kind, 0) + bad
        hist = self.latency.get(kind)
        if hist is None:
            hist = self.latency[kind] = Histogram(REQUEST_BOUNDS)
        hist.observe(seconds)

    def malformed(self) -> None:
        """Frames dropped before they were a message (the runtime logged them)."""
        self.bad_requests[MALFORMED] = self.bad_requests.get(MALFORMED, 0) + 1

    def snapshot_written(self, kind: str, seconds: float) -> None:
        """A server snapshot of `kind` (``latest``: <dir>/rank<r>; ``tagged``: <dir>/tagged/rank<r>) was written."""
        hist = self.snapshots.get(kind)
        if hist is None:
            hist = self.snapshots[kind] = Histogram(SNAPSHOT_BOUNDS)
        hist.observe(seconds)
        self.snapshot_last[kind] = (time.time(), seconds)

    def publish(self, server: Any, van: Any, now: float) -> None:
        """Copy everything a scrape shows (on the loop: `server` is the KVServer or None before registration)."""
        self.next_publish = now + self.interval
        info: dict[str, str] = {}
        stats: dict[str, Any] = {}
        updates: dict[str, int] = {}
        num_update = None
        if server is not None:
            info = {"rank": str(server.rank), "num_servers": str(server.num_servers),
                    "num_workers": str(server.num_workers), "materialize": str(server.materialize)}
            stats = server.stats()
            if server.optimizer is not None:
                updates = {str(k): int(v) for k, v in server.optimizer.update_counts().items()}
                num_update = int(server.optimizer.num_update)
        published = Published(
            wall_time=time.time(), info=info, stats=stats, updates=updates, num_update=num_update,
            bytes_received=int(van.bytes_received), bytes_sent=int(van.bytes_sent),
            requests=dict(self.requests), bad_requests=dict(self.bad_requests),
            latency={k: h.copy() for k, h in self.latency.items()},
            snapshots={k: h.copy() for k, h in self.snapshots.items()}, snapshot_last=dict(self.snapshot_last))
        with self._lock:
            self._published = published

    # -- the HTTP thread's side (prometheus_client's Collector protocol) -----------------------------------------

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

        with self._lock:
            pub = self._published
        if pub is None:
            return
        gauge = GaugeMetricFamily(PREFIX + "metrics_published_timestamp_seconds",
                                  "When the server's loop last copied these numbers for the exporter (Unix time).")
        gauge.add_metric([], pub.wall_time)
        yield gauge
        if pub.info:
            info = GaugeMetricFamily(PREFIX + "server_info", "This server's rank, job size and row policy (1).",
                                     labels=sorted(pub.info))
            info.add_metric([pub.info[k] for k in sorted(pub.info)], 1)
            yield info
        yield from _stats_families(pub.stats, GaugeMetricFamily)

        for name, doc, values in (
                ("requests", "Requests handled, by kind.", pub.requests),
                ("bad_requests", "Requests refused or dropped as bad input, by kind (malformed: frames that did "
                                 "not decode).", pub.bad_requests)):
            counter = CounterMetricFamily(PREFIX + name, doc, labels=["kind"])
            for kind in sorted(values):
                counter.add_metric([kind], values[kind])
            yield counter
        hist = HistogramMetricFamily(PREFIX + "request_duration_seconds",
                                     "Server time per request: decoding, handling and sending its replies (a "
                                     "dist_sync round's update runs in the request that completes it).",
                                     labels=["kind"])
        for kind in sorted(pub.latency):
            hist.add_metric([kind], pub.latency[kind].buckets(), pub.latency[kind].total)
        yield hist

        updates = CounterMetricFamily(PREFIX + "optimizer_updates", "Optimizer updates applied to a key on this "
                                      "server (MXNet's per-index update count).", labels=["key"])
        for key in sorted(pub.updates, key=_key_order):
            updates.add_metric([key], pub.updates[key])
        yield updates
        if pub.num_update is not None:
            gauge = GaugeMetricFamily(PREFIX + "optimizer_num_update", "The optimizer's num_update (the largest "
                                      "update count; drives learning-rate schedules).")
            gauge.add_metric([], pub.num_update)
            yield gauge
        for name, doc, value in (("received_bytes", "Bytes received on the server's ZeroMQ socket.",
                                  pub.bytes_received),
                                 ("sent_bytes", "Bytes sent to peers.", pub.bytes_sent)):
            counter = CounterMetricFamily(PREFIX + name, doc)
            counter.add_metric([], value)
            yield counter
        yield from self._snapshot_families(pub)

    @staticmethod
    def _snapshot_families(pub: Any) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily

        hist = HistogramMetricFamily(PREFIX + "snapshot_duration_seconds", "Time to write a server snapshot, by "
                                     "kind (latest: <dir>/rank<r>; tagged: <dir>/tagged/rank<r>).", labels=["kind"])
        last = GaugeMetricFamily(PREFIX + "snapshot_last_timestamp_seconds", "When the last snapshot of a kind was "
                                 "written (Unix time).", labels=["kind"])
        age = GaugeMetricFamily(PREFIX + "snapshot_age_seconds", "Seconds since the last snapshot of a kind was "
                                "written, at scrape time.", labels=["kind"])
        now = time.time()
        for kind in sorted(pub.snapshots):
            hist.add_metric([kind], pub.snapshots[kind].buckets(), pub.snapshots[kind].total)
            written, _ = pub.snapshot_last[kind]
            last.add_metric([kind], written)
            age.add_metric([kind], max(now - written, 0.0))
        yield from (hist, last, age)


def _key_order(key: str) -> tuple[int, str]:
    return (int(key), "") if key.isdigit() else (-1, key)


def _numbers(values: Mapping[str, Any], skip: frozenset[str] = frozenset()) -> Iterator[tuple[str, float]]:
    """(name, value) for every number in `values` (bools as 0/1), nested dicts' names joined with '_'; strings
    and None are left out."""
    for name, value in values.items():
        if name in skip:
            continue
        name = _NAME_UNSAFE.sub("_", str(name))
        if isinstance(value, Mapping):
            for sub, number in _numbers(value):
                yield f"{name}_{sub}", number
        elif isinstance(value, (bool, int, float)):
            yield name, float(value)


def _help(name: str) -> str:
    return HELP.get(name, f"KVServer.stats() field {name!r}.")


def _stats_families(stats: Mapping[str, Any], family: Any) -> Iterator[Any]:
    """Gauges from one KVServer.stats(): per row_sparse key (labelled), then server-wide."""
    per_key: dict[str, Any] = {}
    for key in sorted(stats.get("sparse", {}), key=_key_order):
        for name, value in _numbers(stats["sparse"][key]):
            metric = per_key.get(name)
            if metric is None:
                metric = per_key[name] = family(PREFIX + "key_" + name, _help("key_" + name), labels=["key"])
            metric.add_metric([key], value)
    yield from per_key.values()
    for name, value in _numbers(stats, STATS_SKIP):
        name = "stats_" + name if name in OWN or name.startswith("key_") else name
        metric = family(PREFIX + name, _help(name))
        metric.add_metric([], value)
        yield metric
