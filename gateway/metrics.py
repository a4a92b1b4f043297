"""Prometheus metrics: what each request did (counted as it passes), and what the gateway holds (read
from the admin stats when Prometheus scrapes).

- ``RequestMetrics`` wraps each API's ASGI app: requests by API, operation and status; latency
  histograms per operation (lookups, GET, PUT, batch-get ...); bytes in and out; and, from the
  native lookups, keys hit and missed. Operations are named by the API that served them: the native
  API's from its path (``get_chunk``, ``exists``, ``batch-get`` ...), the S3 API's as S3 names them
  (``GetObject`` ...; the S3 app puts the name in ``scope["kvgw.op"]``); of those, the requests a client
  marked as retries (``kvgw_retried_requests``, where an API can tell: ``scope[RETRIED]``).
- ``StatsCollector`` turns the admin stats (``gateway.stats.gateway_stats``: usage and capacity per
  bucket and tier, lifecycle actions, promotions, bytes moved, write-through backlog, the S3 breaker,
  the cluster's feed and leader) into metric families at scrape time, so nothing on the request path
  pays for them.

``GET /metrics`` (the control plane) serves the registry, protected like ``/v1/admin/stats``.
Everything here runs on the event loop (the request path's counts are plain additions: ``gateway.tally``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any, get_args

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gateway.api.http import BODY_PARTS, RETRIED, THREADED_BODY, ZEROCOPY, Message, Receive, Scope, Send
from gateway.chunks import ThreadedBody, ThreadedOutcome
from gateway.tally import SpreadFamily, TallyCollector, TallyFamily

ASGIApp = Callable[[Scope, Receive, Send], Any]

LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                   2.5, 5.0, 10.0, 30.0)
"""From 100 µs (an index-only lookup) to 30 s (a large transfer from a slow client)."""

MAX_REMEMBERED_CHILDREN = 1024

NATIVE_CHUNK_OPS = {"GET": "get_chunk", "PUT": "put_chunk", "HEAD": "head_chunk", "DELETE": "delete_chunk"}


def native_op(method: str, path: str, calls: frozenset[str]) -> str:
    """``/v1/buckets/{bucket}/chunks/{key}`` → ``<method>_chunk``; ``/v1/buckets/{bucket}/exists`` → ``exists``
    (a POST of one of ``calls``, the API's batch calls; anything else is ``unknown``)."""
    parts = path.split("/", 5)  # "", "v1", "buckets", bucket, "chunks" | call, key
    if len(parts) < 5:
        return "unknown"
    if parts[4] == "chunks":
        return NATIVE_CHUNK_OPS.get(method, "unknown")
    return parts[4] if method == "POST" and parts[4] in calls else "unknown"


class RequestMetrics:
    """The per-request families, and the wrapper that fills them."""

    def __init__(self, registry: CollectorRegistry) -> None:
        # the request path's families: plain additions on the event loop (gateway.tally)
        self.requests = TallyFamily("kvgw_requests", "Requests answered, by API, operation and status.",
                                    ["api", "op", "status"])
        self.latency = SpreadFamily("kvgw_request_seconds", "Time from a request's start to its last response byte.",
                                    ["api", "op"], LATENCY_BUCKETS)
        self.retried = TallyFamily(
            "kvgw_retried_requests", "Requests answered that the client marked as a retry of an earlier attempt "
            "(the S3 API: AWS SDKs' amz-sdk-request: attempt=N, N >= 2), by API, operation and status; included in "
            "kvgw_requests. Clients retry after a timeout or a broken connection, so a rise means answers came "
            "late or were lost on the way.",
            ["api", "op", "status"])
        self.bytes_in = TallyFamily("kvgw_request_body_bytes", "Request body bytes received.", ["api"])
        self.bytes_out = TallyFamily("kvgw_response_body_bytes", "Response body bytes sent.", ["api"])
        self.lookup_keys = TallyFamily("kvgw_lookup_keys", "Keys asked about by exists, prefix and HEAD, by result.",
                                       ["op", "result"])
        lane = TallyFamily("kvgw_lane_requests", "Lookups the lookup lane answered, and those it handed to the API.",
                           ["result"])
        self.lane_answered, self.lane_handed_over = lane.labels("answered"), lane.labels("handed_over")
        receives = TallyFamily(
            "kvgw_threaded_receives",
            "PUT bodies offered to a threaded receive (gateway.dataplane.intake), by how it ended: "
            "complete, slow (the event loop read the rest), gone (the client went away), skipped (not tried: no "
            "thread free, TLS, or the body already in).",
            ["result"])
        registry.register(TallyCollector([self.requests, self.latency, self.retried, self.bytes_in, self.bytes_out,
                                          self.lookup_keys, lane, receives]))
        self._threaded_outcomes = {outcome: receives.labels(outcome) for outcome in get_args(ThreadedOutcome)}

        # labelled children by label values, looked up once per label set (the sets are few and fixed)
        self._lookup_children: dict[tuple[str, str], Any] = {}
        self._request_children: dict[tuple[str, str, int], tuple[Any, Any]] = {}
        self._byte_children: dict[str, tuple[Any, Any]] = {}

    def count_lookup(self, op: str, hits: int, misses: int) -> None:
        if hits:
            self._lookup_child(op, "hit").inc(hits)
        if misses:
            self._lookup_child(op, "miss").inc(misses)

    def _lookup_child(self, op: str, result: str) -> Any:
        child = self._lookup_children.get((op, result))
        if child is None:
            child = self._lookup_children[(op, result)] = self.lookup_keys.labels(op, result)
        return child

    def _request_child(self, api: str, op: str, status: int) -> tuple[Any, Any]:
        """The (requests counter, latency histogram) children of one API, operation and status."""
        children = self._request_children.get((api, op, status))
        if children is None:
            children = (self.requests.labels(api, op, str(status)), self.latency.labels(api, op))
            if len(self._request_children) < MAX_REMEMBERED_CHILDREN:  # the control plane's ops are paths
                self._request_children[(api, op, status)] = children
        return children

    def _bytes_children(self, api: str) -> tuple[Any, Any]:
        """The (body bytes in, body bytes out) counters of one API."""
        children = self._byte_children.get(api)
        if children is None:
            children = self._byte_children[api] = (self.bytes_in.labels(api), self.bytes_out.labels(api))
        return children

    def answered(self, api: str, op: str, status: int, seconds: float, body_in: int, body_out: int,
                 retried: bool = False) -> None:
        """One request answered without an ASGI app (``gateway.dataplane.lane``), counted as ``wrap`` counts."""
        requests, latency = self._request_child(api, op, status)
        requests.inc()
        latency.observe(seconds)
        if retried:
            self.retried.labels(api, op, str(status)).inc()
        bytes_in, bytes_out = self._bytes_children(api)
        if body_in:
            bytes_in.inc(body_in)
        if body_out:
            bytes_out.inc(body_out)

    def wrap(self, api: str, app: ASGIApp, op_of: Callable[[Scope], str]) -> ASGIApp:
        """``app`` measured as ``api``; ``op_of(scope)`` names the operation once the request is done."""
        request_child = self._request_child
        bytes_in, bytes_out = self._bytes_children(api)
        threaded_outcomes = self._threaded_outcomes

        async def measured(scope: Scope, receive: Receive, send: Send) -> None:
            start = time.perf_counter()
            status = 0

            async def counting_receive() -> Message:
                message = await receive()
                body = message.get("body")
                if body:
                    bytes_in.inc(len(body))
                return message

            async def counting_send(message: Message) -> None:
                nonlocal status
                kind = message["type"]
                if kind == "http.response.body":
                    body = message.get("body")
                    if body:
                        bytes_out.inc(len(body))
                elif kind == ZEROCOPY:
                    bytes_out.inc(message["count"])
                elif kind == BODY_PARTS:
                    bytes_out.inc(sum(memoryview(part).nbytes for part in message["parts"]))
                elif kind == "http.response.start":
                    status = message["status"]
                await send(message)

            extensions = scope.get("extensions")
            if extensions is not None and THREADED_BODY in extensions:
                body = extensions[THREADED_BODY]
                extensions[THREADED_BODY] = _MeasuredThreadedBody(body, bytes_in, threaded_outcomes)
            try:
                await app(scope, counting_receive, counting_send)
            finally:
                op = op_of(scope)
                status = status or 499  # went away unanswered
                requests, latency = request_child(api, op, status)
                requests.inc()
                latency.observe(time.perf_counter() - start)
                if scope.get(RETRIED):
                    self.retried.labels(api, op, str(status)).inc()

        return measured


class _MeasuredThreadedBody:
    """A ``ThreadedBody`` whose bytes count as received (``kvgw_request_body_bytes``, as ``wrap``'s
    ``receive`` counts the rest) and whose outcome is counted (``kvgw_threaded_receives``)."""

    def __init__(self, body: ThreadedBody, bytes_in: Any, outcomes: Mapping[str, Any]) -> None:
        self._body = body
        self._bytes_in = bytes_in
        self._outcomes = outcomes

    async def consume_in_thread(self, consume: Callable[[memoryview], None]) -> ThreadedOutcome:
        received = 0

        def counted(piece: memoryview) -> None:
            nonlocal received
            consume(piece)
            received += len(piece)

        try:
            outcome = await self._body.consume_in_thread(counted)
        finally:
            if received:
                self._bytes_in.inc(received)
        self._outcomes[outcome].inc()
        return outcome


class StatsCollector(Collector):
    """Metric families from the admin stats document, built when Prometheus scrapes."""

    def __init__(self, stats: Callable[[], Mapping[str, Any]]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        doc = self._stats()
        labels = ["bucket", "tier"]
        usage = GaugeMetricFamily("kvgw_tier_usage_bytes", "Bytes a tier holds for a bucket.", labels=labels)
        chunks = GaugeMetricFamily("kvgw_tier_chunks", "Chunks a tier holds for a bucket.", labels=labels)
        for bucket, tiers in sorted(doc.get("usage", {}).items()):
            for name, value in sorted(tiers.items()):
                tier, _, unit = name.partition("_")
                (usage if unit == "bytes" else chunks).add_metric([bucket, tier], value)
        yield usage
        yield chunks
        capacity = GaugeMetricFamily("kvgw_tier_capacity_bytes", "A bucket's capacity on a tier (absent: none).",
                                     labels=["bucket", "tier"])
        for bucket, tiers in sorted(doc.get("capacity", {}).items()):
            for tier, value in sorted(tiers.items()):
                if value is not None:
                    capacity.add_metric([bucket, tier], value)
        yield capacity
        actions = CounterMetricFamily("kvgw_lifecycle_chunks", "Chunks the lifecycle acted on, by action.",
                                      labels=["action"])
        for action, value in sorted(doc.get("lifecycle", {}).items()):
            actions.add_metric([action], value)
        yield actions
        yield CounterMetricFamily("kvgw_promotions", "S3-only chunks copied back into the filesystem tier.",
                                  value=doc.get("promotions", 0))
        hidden = CounterMetricFamily("kvgw_fs_hidden_chunks", "Chunk files listed in their directory that a "
                                     "lookup here missed (a cached negative lookup), by outcome.", labels=["outcome"])
        for outcome, value in sorted(doc.get("fs_hidden", {}).items()):
            hidden.add_metric([outcome], value)
        yield hidden
        ahead = doc.get("fs_read_ahead", {})
        read_ahead = CounterMetricFamily("kvgw_fs_read_ahead_frames", "Batch-read frames whose chunk was opened "
                                         "ahead (taken) or came before the read-ahead pass reached it (missed).",
                                         labels=["outcome"])
        for outcome in ("taken", "missed"):
            read_ahead.add_metric([outcome], ahead.get(outcome, 0))
        yield read_ahead
        yield GaugeMetricFamily("kvgw_fs_read_ahead_bytes", "Bytes of chunks opened ahead and not sent yet.",
                                value=ahead.get("bytes", 0))
        moved = CounterMetricFamily("kvgw_moved_bytes", "Bytes copied between tiers, by direction.",
                                    labels=["direction"])
        for direction, value in sorted(doc.get("moved_bytes", {}).items()):
            moved.add_metric([str(direction)], value)
        yield moved
        admission = CounterMetricFamily(
            "kvgw_admission", "New chunks written (native API) while their bucket's filesystem tier was at its low "
            "watermark: admitted, or declined (507 Declined) and why.", labels=["bucket", "outcome"])
        for bucket, outcomes in sorted(doc.get("admission", {}).items()):
            for outcome, value in sorted(outcomes.items()):
                admission.add_metric([bucket, outcome], value)
        yield admission
        yield GaugeMetricFamily("kvgw_write_through_backlog", "Chunks queued for write-through to S3.",
                                value=doc.get("write_through_pending", 0))
        yield GaugeMetricFamily("kvgw_chunks_indexed", "Chunks in this gateway's index.",
                                value=doc.get("chunks_indexed", 0))
        breaker = doc.get("s3_breaker")
        if breaker is not None:
            state = GaugeMetricFamily("kvgw_s3_breaker_open", "1 while the S3 tier's circuit breaker is open.")
            state.add_metric([], 1.0 if breaker != "closed" else 0.0)
            yield state
        yield from _cluster_families(doc.get("cluster"))


def _cluster_families(cluster: Any) -> Iterator[Metric]:
    """The cluster section's numbers as gauges ``kvgw_cluster_<path>`` (feed lag, leader, members ...)."""
    if not isinstance(cluster, Mapping):
        return
    for path, value in _numbers(cluster, ()):
        yield GaugeMetricFamily("kvgw_cluster_" + "_".join(path), f"cluster stats: {'.'.join(path)}", value=value)


def _numbers(doc: Mapping[str, Any], prefix: tuple[str, ...]) -> Iterator[tuple[tuple[str, ...], float]]:
    for key, value in sorted(doc.items()):
        name = "".join(c if c.isalnum() else "_" for c in str(key)).strip("_").lower()
        if isinstance(value, bool | int | float):
            yield (*prefix, name), float(value)
        elif isinstance(value, Mapping) and len(prefix) < 2:
            yield from _numbers(value, (*prefix, name))
