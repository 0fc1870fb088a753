"""Metric names that dashboards, autoscalers and benchmarks written for vLLM or TGI already read, exported on
/metrics beside Folio's own (`folio_*`, app/http/metrics.py), so that they work against Folio unchanged.

vLLM's (as vllm/v1/metrics/loggers.py defines them: types, help, buckets, and the labels `model_name`, the served
model id, and `engine`, "0"):
- `vllm:num_requests_running`, `vllm:num_requests_waiting` (gauges): the engine's running batch and waiting queue.
- `vllm:kv_cache_usage_perc` (gauge, 0 to 1): the share of the KV cache that requests hold. Folio's cache is one
  preallocated row of `block_size` positions per batch slot, which a request holds whole from its prefill to its
  end: rows held / rows, so 1 means a new request waits (vLLM counts the blocks of its paged cache; both say how
  close the cache is to making requests wait).
- `vllm:prompt_tokens_total`, `vllm:generation_tokens_total` (counters): prompt tokens prefilled and tokens
  generated, the engine's own counters read at scrape time, less the warm-up's (which vLLM does not count).
- `vllm:time_to_first_token_seconds` (histogram): from the request's arrival to its first token; once per request
  that got one.
- `vllm:inter_token_latency_seconds` (histogram): between a request's consecutive tokens, as the engine made them;
  once per token after the first.
- `vllm:e2e_request_latency_seconds` (histogram): from arrival to the end of the response; once per request whose
  generation finished (not cancelled, not failed), which `vllm:request_success_total{finished_reason}` counts by
  vLLM's reason: `stop` (end of text or a stop string) or `length`.
- `vllm:spec_decode_num_drafts_total`, `vllm:spec_decode_num_draft_tokens_total`,
  `vllm:spec_decode_num_accepted_tokens_total` (counters, only where the server speculates: --speculative-model):
  drafts verified, the tokens they held and those accepted (acceptance rate: accepted / draft tokens), the engine's
  counters less the warm-up's.
TGI's (no labels): `tgi_queue_size`, `tgi_batch_current_size` (gauges), `tgi_request_duration` (histogram, TGI's
buckets: the same end-to-end time, of the same requests).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from app.api.openai.protocol import FINISH_REASONS  # vLLM's finish reasons are OpenAI's
from app.http.requestlog import RequestRecord
from model.engine import Engine

LABELS = ("model_name", "engine")
ENGINE_INDEX = "0"  # one engine per server
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
               960.0, 1920.0, 7680.0)
# speculative decoding's counters (vLLM's names and help, without the _total the exposition adds)
SPEC_DECODE_COUNTERS = {
    "spec_decode_num_drafts": "Number of spec decoding drafts.",
    "spec_decode_num_draft_tokens": "Number of draft tokens.",
    "spec_decode_num_accepted_tokens": "Number of accepted tokens.",
}
TGI_DURATION_BUCKETS = tuple(0.0001 * 1.5**k for k in range(1, 36))  # TGI's router: 35 buckets from 0.15 ms


@dataclass
class _Bound:
    """The labelled series of the served model."""

    ttft: Histogram
    itl: Histogram
    e2e: Histogram
    success: dict[str, Counter]


class VllmMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              LABELS, buckets=TTFT_BUCKETS, registry=registry)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             LABELS, buckets=ITL_BUCKETS, registry=registry)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                             LABELS, buckets=E2E_BUCKETS, registry=registry)
        self.success = Counter("vllm:request_success", "Count of successfully processed requests.",
                               (*LABELS, "finished_reason"), registry=registry)
        self.tgi_duration = Histogram("tgi_request_duration", "End-to-end generate request duration (in seconds)",
                                      buckets=TGI_DURATION_BUCKETS, registry=registry)
        self._bound: _Bound | None = None

    def bind(self, engine: Engine, model_name: str) -> None:
        """Start exporting for `engine` serving `model_name`; call it once the warm-up is done."""
        values = (model_name, ENGINE_INDEX)
        self._bound = _Bound(self.ttft.labels(*values), self.itl.labels(*values), self.e2e.labels(*values),
                             {r: self.success.labels(*values, r) for r in sorted(set(FINISH_REASONS.values()))})
        self.registry.register(EngineGauges(engine, values))

    def token_gap(self, seconds: float) -> None:
        """One inter-token latency: the time between a request's token and its previous one."""
        if self._bound is not None:
            self._bound.itl.observe(seconds)

    def observe(self, record: RequestRecord) -> None:
        """A request's figures, once it has ended (requests that did not generate are not counted)."""
        bound = self._bound
        if bound is None or record.prompt_tokens is None:
            return
        if (ttft := record.ttft) is not None:
            bound.ttft.observe(ttft)
        reason = FINISH_REASONS.get(record.finish_reason or "")
        if reason is not None:
            bound.e2e.observe(record.total)
            bound.success[reason].inc()
            self.tgi_duration.observe(record.total)


class EngineGauges(Collector):
    """The engine's figures, read at scrape time: the gauges, and the token counters (less the warm-up's)."""

    def __init__(self, engine: Engine, values: tuple[str, str]) -> None:
        self.engine = engine
        self.values = list(values)
        self.prompt_base = engine.stats.prompt_tokens_total
        self.generated_base = engine.stats.generated_tokens_total
        self.speculates = engine.config.speculative_model is not None
        self.spec_base = {name: getattr(engine.stats, name + "_total") for name in SPEC_DECODE_COUNTERS}

    def _family(self, kind: type[GaugeMetricFamily] | type[CounterMetricFamily], name: str, doc: str,
                value: float) -> Metric:
        family = kind(name, doc, labels=LABELS)
        family.add_metric(self.values, value)
        return family

    def collect(self) -> Iterator[Metric]:
        s, rows = self.engine.stats, self.engine.config.max_batch_size
        yield self._family(GaugeMetricFamily, "vllm:num_requests_running",
                           "Number of requests in model execution batches.", s.running)
        yield self._family(GaugeMetricFamily, "vllm:num_requests_waiting",
                           "Number of requests waiting to be processed.", s.waiting)
        yield self._family(GaugeMetricFamily, "vllm:kv_cache_usage_perc",
                           "KV-cache usage. 1 means 100 percent usage.", min(1.0, s.running / rows))
        yield self._family(CounterMetricFamily, "vllm:prompt_tokens", "Number of prefill tokens processed.",
                           s.prompt_tokens_total - self.prompt_base)
        yield self._family(CounterMetricFamily, "vllm:generation_tokens", "Number of generation tokens processed.",
                           s.generated_tokens_total - self.generated_base)
        if self.speculates:
            for name, doc in SPEC_DECODE_COUNTERS.items():
                yield self._family(CounterMetricFamily, f"vllm:{name}", doc,
                                   getattr(s, name + "_total") - self.spec_base[name])
        yield GaugeMetricFamily("tgi_queue_size", "Current queue size", value=s.waiting)
        yield GaugeMetricFamily("tgi_batch_current_size", "Current batch size", value=s.running)
