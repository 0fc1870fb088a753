"""Prometheus metrics, one registry per app (so tests can build many apps), and the ASGI middleware that
counts requests by route and status."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.http.vllm_metrics import VllmMetrics
from model import heap
from model.engine import Engine

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
PAUSE_LE = [*map(str, heap.PAUSE_BUCKETS), "+Inf"]  # folio_gc_pause_seconds' `le` labels, bucket by bucket


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("folio_requests", "HTTP requests by route and status", ["route", "status"],
                                registry=r)
        self.ttft = Histogram("folio_time_to_first_token_seconds", "submission to first token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("folio_inter_token_latency_seconds", "time between tokens of a stream",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.connections_closed = Counter(
            "folio_connections_closed", "connections answered and closed by a limit of the HTTP layer "
            "(app/http/connection.py): header_timeout, body_timeout, head_too_large, malformed, "
            "too_many_connections", ["reason"], registry=r)
        self.vllm = VllmMetrics(r)  # the same figures under vLLM's and TGI's names (app/http/vllm_metrics.py)
        r.register(GcCollector())

    def bind(self, engine: Engine) -> None:
        """Engine figures are read from the engine itself at scrape time."""
        self.registry.register(EngineCollector(engine))


class GcCollector(Collector):
    """The garbage collector's pauses by generation (model/heap.py's, recorded where the server watches them: zero
    in a process that does not) and the objects frozen out of its reach."""

    def collect(self):  # noqa: ANN201 (prometheus_client's protocol)
        family = HistogramMetricFamily("folio_gc_pause_seconds", "each garbage collection's duration, by "
                                       "generation: the event loop and the engine thread stand still meanwhile",
                                       labels=["generation"])
        for generation, g in enumerate(heap.pauses.snapshot()):
            cumulative, buckets = 0, []
            for le, n in zip(PAUSE_LE, g.buckets, strict=True):
                cumulative += n
                buckets.append((le, cumulative))
            family.add_metric([str(generation)], buckets, g.seconds)
        yield family
        yield GaugeMetricFamily("folio_gc_frozen_objects", "objects frozen out of the collector's reach (--gc-freeze)",
                                value=heap.frozen_count())


class EngineCollector(Collector):
    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def collect(self):  # noqa: ANN201 (prometheus_client's protocol)
        s = self.engine.stats
        yield GaugeMetricFamily("folio_queue_depth", "requests waiting for a batch slot", value=s.waiting)
        yield GaugeMetricFamily("folio_running_batch_size", "requests in the running batch (prefilling or decoding)",
                                value=s.running)
        yield GaugeMetricFamily("folio_reserved_slots", "slots held by admitted requests not in the engine yet "
                                "(being parsed or tokenised) and by /tokenize requests", value=self.engine.reserved)
        yield CounterMetricFamily("folio_generated_tokens", "tokens generated", value=s.generated_tokens_total)
        yield CounterMetricFamily("folio_cancelled_requests", "requests cancelled (client gone)",
                                  value=s.cancelled_total)
        yield CounterMetricFamily("folio_rejected_requests",
                                  "requests refused as overloaded (429; 529 on Anthropic's routes)",
                                  value=s.rejected_total)
        yield CounterMetricFamily("folio_failed_requests", "requests that failed in generation",
                                  value=s.failed_total)


class RequestMetricsMiddleware:
    """Counts every HTTP request by its route template and final status (pure ASGI: streaming-safe)."""

    def __init__(self, app: ASGIApp, get_metrics: Callable[[], Metrics | None]) -> None:
        self.app = app
        self.get_metrics = get_metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = {"code": 500}

        async def send_wrapper(message: Message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            metrics = self.get_metrics()
            if metrics is not None:
                route = scope.get("route")
                label = getattr(route, "path", None) or "unmatched"
                metrics.requests.labels(label, str(status["code"])).inc()
