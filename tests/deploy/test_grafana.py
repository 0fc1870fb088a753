"""deploy/grafana/folio-dashboard.json: valid JSON in Grafana's dashboard shape, and every panel's PromQL reads
only metrics that exist: Folio's own, scraped from /metrics, or the vLLM-compatible names Folio offers."""

from __future__ import annotations

import json

import pytest

from tests import REPO
from tests.deploy.promql import metric_names

DASHBOARD = REPO / "deploy" / "grafana" / "folio-dashboard.json"

# the vLLM-compatible set (issue 17), by kind: a histogram is read through its _bucket/_sum/_count samples
VLLM_GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")
VLLM_COUNTERS = ("vllm:prompt_tokens_total", "vllm:generation_tokens_total")
VLLM_HISTOGRAMS = ("vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
                   "vllm:e2e_request_latency_seconds")
VLLM_SAMPLES = frozenset(VLLM_GAUGES + VLLM_COUNTERS
                         + tuple(h + s for h in VLLM_HISTOGRAMS for s in ("_bucket", "_sum", "_count")))


def panels(dashboard: dict) -> list[dict]:
    """Every panel, those inside rows too."""
    out = []
    for panel in dashboard["panels"]:
        out.append(panel)
        out.extend(panel.get("panels", []))
    return out


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def test_dashboard_is_grafana_json(dashboard: dict) -> None:
    assert dashboard["title"] and dashboard["uid"] and isinstance(dashboard["schemaVersion"], int)
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    ids = [p["id"] for p in panels(dashboard)]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for panel in panels(dashboard):
        assert set(panel["gridPos"]) == {"h", "w", "x", "y"} and panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24
        if panel["type"] == "row":
            continue
        assert panel["title"] and panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel
        assert panel["targets"], panel["title"]
        refs = [t["refId"] for t in panel["targets"]]
        assert len(refs) == len(set(refs)) and all(t["expr"].strip() for t in panel["targets"]), panel["title"]


def test_every_query_reads_metrics_folio_exports(dashboard: dict, exported_metric_names: set[str]) -> None:
    known = exported_metric_names | VLLM_SAMPLES
    for panel in panels(dashboard):
        for target in panel.get("targets", []):
            names = metric_names(target["expr"])
            assert names, (panel["title"], target["expr"])
            assert names <= known, (panel["title"], sorted(names - known))


def test_the_dashboard_covers_throughput_latency_batch_kv_cache_and_errors(dashboard: dict) -> None:
    used = {name for panel in panels(dashboard) for t in panel.get("targets", []) for name in metric_names(t["expr"])}
    folio = {"folio_generated_tokens_total", "folio_time_to_first_token_seconds_bucket",
             "folio_inter_token_latency_seconds_bucket", "folio_running_batch_size", "folio_queue_depth",
             "folio_requests_total", "folio_rejected_requests_total", "folio_failed_requests_total"}
    vllm = set(VLLM_GAUGES + VLLM_COUNTERS) | {h + "_bucket" for h in VLLM_HISTOGRAMS}
    assert folio | vllm <= used, sorted((folio | vllm) - used)
