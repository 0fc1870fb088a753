"""vLLM's and TGI's metric names on /metrics (app/http/vllm_metrics.py), scraped from a real `python -m app` after
generating: the token counters equal the tokens sent and generated (the warm-up left out), each histogram counts
a request once (inter-token latency: once per token after the first), the gauges follow a running request, and
the names carry vLLM's labels."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from app.http.vllm_metrics import ENGINE_INDEX
from app.testing import metric, serving
from model.engine import Engine

MODEL = "tiny-char"  # the served model id: the checkpoint's directory name (tests/app/conftest.py)
LABELS = {"model_name": MODEL, "engine": ENGINE_INDEX}
HISTOGRAMS = ("vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
              "vllm:e2e_request_latency_seconds")
# Engine.warmup's tokens (the server's batch holds WARMUP_ROWS), which Folio's counter counts and vLLM's names do not
WARMUP_TOKENS = Engine.WARMUP_ROWS * Engine.WARMUP_NEW_TOKENS


@pytest.fixture(scope="module")
def base(char_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with serving(char_checkpoint, tmp_path_factory.mktemp("vllm-metrics") / "server.log") as (url, _):
        yield url


def scrape(base: str) -> str:
    return httpx.get(f"{base}/metrics", timeout=30, trust_env=False).text


def vllm(text: str, name: str, **labels: str) -> float:
    return metric(text, name, **LABELS, **labels)


def generate(client: httpx.Client, prompt: str, **parameters: object) -> dict:
    r = client.post("/generate", json={"inputs": prompt, "parameters": {"details": True, **parameters}})
    assert r.status_code == 200, r.text
    return r.json()["details"]


def test_counts_after_generating(base: str) -> None:
    before = scrape(base)
    with httpx.Client(base_url=base, timeout=60, trust_env=False) as client:
        whole = generate(client, "To be", max_new_tokens=9)
        text = client.post("/generate", json={"inputs": "ROMEO:", "parameters": {"max_new_tokens": 12}}).json()
        stop = text["generated_text"][4:6]  # greedy again, stopped by two characters it makes at 5 and 6
        stopped = generate(client, "ROMEO:", max_new_tokens=12, stop=[stop])
        streamed = client.post("/v1/completions", json={"prompt": "Hello there", "max_tokens": 6, "stream": True,
                                                        "stream_options": {"include_usage": True}})
        assert client.post("/generate", json={"inputs": "x", "parameters": {"top_k": -3}}).status_code == 422
    assert stopped["finish_reason"] == "stop_sequence" and whole["finish_reason"] == "length"
    assert '"completion_tokens":6' in streamed.text, streamed.text
    prompts = [len("To be"), len("ROMEO:"), len("ROMEO:"), len("Hello there")]
    generated = [whole["generated_tokens"], 12, stopped["generated_tokens"], 6]
    after = scrape(base)

    def grew(name: str, **labels: str) -> float:
        return metric(after, name, **labels) - metric(before, name, **labels)

    assert grew("vllm:prompt_tokens_total", **LABELS) == sum(prompts)
    assert grew("vllm:generation_tokens_total", **LABELS) == sum(generated) == 27 + stopped["generated_tokens"]
    # Folio's own counter counts the warm-up too, vLLM's name does not
    assert metric(after, "folio_generated_tokens_total") - vllm(after, "vllm:generation_tokens_total") == WARMUP_TOKENS
    assert grew("vllm:time_to_first_token_seconds_count", **LABELS) == 4
    assert grew("vllm:e2e_request_latency_seconds_count", **LABELS) == 4
    assert grew("vllm:inter_token_latency_seconds_count", **LABELS) == sum(g - 1 for g in generated)
    assert grew("tgi_request_duration_count") == 4
    assert grew("vllm:request_success_total", **LABELS, finished_reason="length") == 3
    assert grew("vllm:request_success_total", **LABELS, finished_reason="stop") == 1
    for name in HISTOGRAMS:  # every observation in the +Inf bucket; a positive sum
        assert vllm(after, name + "_bucket", le="+Inf") == vllm(after, name + "_count")
        assert grew(name + "_sum", **LABELS) > 0
    # each request's first token comes before its end: so do the sums
    assert grew("vllm:time_to_first_token_seconds_sum", **LABELS) <= grew("vllm:e2e_request_latency_seconds_sum",
                                                                           **LABELS)
    assert grew("vllm:e2e_request_latency_seconds_sum", **LABELS) == pytest.approx(grew("tgi_request_duration_sum"))


def test_types_and_labels_are_vllms(base: str) -> None:
    families = {f.name: f for f in text_string_to_metric_families(scrape(base))}
    kinds = {"vllm:num_requests_running": "gauge", "vllm:num_requests_waiting": "gauge",
             "vllm:kv_cache_usage_perc": "gauge", "vllm:prompt_tokens": "counter",
             "vllm:generation_tokens": "counter", "vllm:request_success": "counter",
             **{name: "histogram" for name in HISTOGRAMS},
             "tgi_queue_size": "gauge", "tgi_batch_current_size": "gauge", "tgi_request_duration": "histogram"}
    for name, kind in kinds.items():
        assert families[name].type == kind, (name, families[name].type)
        for sample in families[name].samples:
            if name.startswith("vllm:"):
                assert {k: sample.labels[k] for k in LABELS} == LABELS, sample
            else:
                assert set(sample.labels) <= {"le"}, sample


def wait_for(base: str, condition: str, check: object, timeout: float = 30.0) -> str:
    deadline = time.monotonic() + timeout
    while True:
        text = scrape(base)
        if check(text) or time.monotonic() > deadline:  # type: ignore[operator]
            assert check(text), (condition, text)  # type: ignore[operator]
            return text
        time.sleep(0.05)


def test_gauges_follow_a_running_request_and_a_cancelled_one_ends_no_e2e(base: str) -> None:
    """A stream of 4096 tokens (slow: the test server slides its window by one token) holds one of the 16 rows."""
    before = scrape(base)
    with httpx.Client(base_url=base, timeout=60, trust_env=False) as client:
        with client.stream("POST", "/generate_stream", json={"inputs": "To be",
                                                             "parameters": {"max_new_tokens": 4096}}) as r:
            lines = r.iter_lines()  # kept: a dropped generator closes the connection, which cancels the stream
            assert next(lines).startswith("data: ")
            during = scrape(base)
    assert vllm(during, "vllm:num_requests_running") == metric(during, "tgi_batch_current_size") == 1
    assert vllm(during, "vllm:kv_cache_usage_perc") == pytest.approx(1 / 16)
    assert vllm(during, "vllm:num_requests_waiting") == metric(during, "tgi_queue_size") == 0
    ttft = "vllm:time_to_first_token_seconds_count"
    after = wait_for(base, "the cancelled stream is gone and counted", lambda t: vllm(t, ttft) == vllm(before, ttft) + 1
                     and vllm(t, "vllm:num_requests_running") == 0)
    assert vllm(after, "vllm:kv_cache_usage_perc") == 0
    for name in ("vllm:e2e_request_latency_seconds_count", "tgi_request_duration_count"):
        assert metric(after, name, **(LABELS if name.startswith("vllm") else {})) == metric(
            before, name, **(LABELS if name.startswith("vllm") else {}))  # a cancelled request did not finish


def test_a_request_ended_by_its_constraint_counts_as_a_stop(base: str) -> None:
    """Structured output ends a generation with the engine's "stop" (its grammar is done): a success like an EOS,
    counted under vLLM's finished_reason "stop" and in the end-to-end latency."""
    before = scrape(base)
    with httpx.Client(base_url=base, timeout=60, trust_env=False) as client:
        r = client.post("/v1/completions", json={"prompt": "Call", "max_tokens": 20,
                                                 "structured_outputs": {"regex": "[0-9]{3}"}})
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "stop", r.text
    after = scrape(base)
    for name, labels in (("vllm:request_success_total", {"finished_reason": "stop"}),
                         ("vllm:e2e_request_latency_seconds_count", {})):
        assert metric(after, name, **LABELS, **labels) - metric(before, name, **LABELS, **labels) == 1, name


def test_speculative_decodings_counters_where_the_server_speculates(base: str, char_checkpoint: Path,
                                                                    tmp_path: Path) -> None:
    """vLLM's spec-decode counters: absent without --speculative-model; with it, they count the drafts a request
    verified (not the warm-up's), none for a request that opted out, and the text is the one plain decoding gives."""
    assert "vllm:spec_decode" not in scrape(base)
    prompt = "To be, or not to be, that is the question: To be, or not"
    with httpx.Client(base_url=base, timeout=60, trust_env=False) as client:
        plain = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 40, "temperature": 0}).json()
    with serving(char_checkpoint, tmp_path / "server.log", "--speculative-model", "[ngram]") as (url, _), \
            httpx.Client(base_url=url, timeout=60, trust_env=False) as client:
        before = scrape(url)
        assert vllm(before, "vllm:spec_decode_num_draft_tokens_total") == 0  # the warm-up's are left out
        body = {"prompt": prompt, "max_tokens": 40, "temperature": 0}
        opted_out = client.post("/v1/completions", json={**body, "speculate": False}).json()
        middle = scrape(url)
        spec = client.post("/v1/completions", json=body).json()
        after = scrape(url)
    assert spec["choices"][0]["text"] == opted_out["choices"][0]["text"] == plain["choices"][0]["text"]
    counts = {name: [vllm(text, f"vllm:{name}_total") for text in (before, middle, after)]
              for name in ("spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens")}
    assert all(c[0] == c[1] for c in counts.values())  # nothing drafted for the request that opted out
    drafts, tokens, accepted = (counts[name][2] for name in counts)
    assert 0 < drafts <= tokens and 0 <= accepted <= tokens
