"""deploy/grafana/: each dashboard is valid JSON in Grafana's dashboard shape, and every panel's PromQL reads only
metrics the server exports, scraped from /metrics: Folio's own names (folio-dashboard.json), and the vLLM and
TGI names it exports beside them (vllm-dashboard.json, filterable by vLLM's `model_name` label)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests import REPO
from tests.deploy.promql import metric_names

GRAFANA = REPO / "deploy" / "grafana"
FOLIO_DASHBOARD = GRAFANA / "folio-dashboard.json"
VLLM_DASHBOARD = GRAFANA / "vllm-dashboard.json"

# the vLLM-compatible set (issue 17), by kind: a histogram is read through its _bucket/_sum/_count samples
VLLM_GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")
VLLM_COUNTERS = ("vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:request_success_total")
VLLM_HISTOGRAMS = ("vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
                   "vllm:e2e_request_latency_seconds")
TGI_NAMES = ("tgi_queue_size", "tgi_batch_current_size", "tgi_request_duration_bucket")


def panels(dashboard: dict) -> list[dict]:
    """Every panel, those inside rows too."""
    out = []
    for panel in dashboard["panels"]:
        out.append(panel)
        out.extend(panel.get("panels", []))
    return out


def queries(dashboard: dict) -> list[tuple[str, str]]:
    """(panel title, PromQL) of every target."""
    return [(panel["title"], t["expr"]) for panel in panels(dashboard) for t in panel.get("targets", [])]


def used(dashboard: dict) -> set[str]:
    return {name for _, expr in queries(dashboard) for name in metric_names(expr)}


def load(path: Path) -> dict:
    return json.loads(path.read_text())


def test_the_dashboards_are_these() -> None:
    assert sorted(GRAFANA.glob("*.json")) == sorted([FOLIO_DASHBOARD, VLLM_DASHBOARD])


@pytest.mark.parametrize("path", [FOLIO_DASHBOARD, VLLM_DASHBOARD], ids=lambda p: p.name)
def test_dashboard_is_grafana_json(path: Path) -> None:
    dashboard = load(path)
    assert dashboard["title"] and dashboard["uid"] and isinstance(dashboard["schemaVersion"], int)
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    for variable in variables.values():
        if variable["type"] == "query":
            assert variable["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, variable
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


@pytest.mark.parametrize("path", [FOLIO_DASHBOARD, VLLM_DASHBOARD], ids=lambda p: p.name)
def test_every_query_reads_metrics_folio_exports(path: Path, exported_metric_names: set[str]) -> None:
    for title, expr in queries(load(path)):
        names = metric_names(expr)
        assert names, (title, expr)
        assert names <= exported_metric_names, (title, sorted(names - exported_metric_names))


def test_the_folio_dashboard_covers_throughput_latency_batch_and_errors() -> None:
    folio = {"folio_generated_tokens_total", "folio_time_to_first_token_seconds_bucket",
             "folio_inter_token_latency_seconds_bucket", "folio_running_batch_size", "folio_queue_depth",
             "folio_requests_total", "folio_rejected_requests_total", "folio_failed_requests_total"}
    assert folio <= used(load(FOLIO_DASHBOARD)), sorted(folio - used(load(FOLIO_DASHBOARD)))


def test_the_vllm_dashboard_reads_every_vllm_and_tgi_name_by_model(exported_metric_names: set[str]) -> None:
    dashboard = load(VLLM_DASHBOARD)
    wanted = set(VLLM_GAUGES + VLLM_COUNTERS + TGI_NAMES) | {h + "_bucket" for h in VLLM_HISTOGRAMS}
    assert wanted <= used(dashboard), sorted(wanted - used(dashboard))
    exported_families = {n for n in exported_metric_names if n.startswith("vllm:") and not n.endswith("_created")}
    assert exported_families <= used(dashboard) | {h + s for h in VLLM_HISTOGRAMS for s in ("_sum", "_count")}
    for title, expr in queries(dashboard):  # as vLLM's own dashboards: one model's series, or all of them
        if any(name.startswith("vllm:") for name in metric_names(expr)):
            assert expr.count("vllm:") == expr.count('{model_name=~"$model_name"}'), (title, expr)
