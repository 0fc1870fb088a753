"""Scoring and the rest of the completions API: prompt logprobs (`max_tokens: 0` with `echo`), `n` and `best_of`,
batches of prompts, token-id prompts, OpenAI's sampling controls, TGI's `decoder_input_details` and `best_of`,
/detokenize. Values are checked against the model's own logits and against requests made one at a time."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from fastapi.testclient import TestClient

from app.testing import parse_sse
from model.checkpoint import load_checkpoint
from model.eval import score
from tests.app.api.calls import PROMPT


def complete(client: TestClient, **body: Any) -> dict[str, Any]:
    r = client.post("/v1/completions", json={"prompt": PROMPT, **body})
    assert r.status_code == 200, r.text
    return r.json()


def texts(body: dict[str, Any]) -> list[str]:
    assert [c["index"] for c in body["choices"]] == list(range(len(body["choices"])))
    return [c["text"] for c in body["choices"]]


@pytest.fixture(scope="module")
def logprobs_of(char_checkpoint: Path):  # noqa: ANN201
    """The model's own log-probabilities for each position of a text: (ids, (n, vocab) log-softmax rows)."""
    ck = load_checkpoint(char_checkpoint)

    def run(text: str) -> tuple[list[int], torch.Tensor]:
        ids = ck.tokenizer.encode(text)
        with torch.inference_mode():
            logits = ck.model(torch.tensor([ids]))[0, :, : ck.tokenizer.n_vocab].double()
        return ids, torch.log_softmax(logits, dim=-1)

    return run


def test_max_tokens_0_with_echo_scores_the_prompt_against_the_models_logits(client: TestClient,
                                                                               logprobs_of) -> None:
    body = complete(client, max_tokens=0, echo=True, logprobs=20)
    choice = body["choices"][0]
    assert choice["text"] == PROMPT and choice["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": len(PROMPT), "completion_tokens": 0, "total_tokens": len(PROMPT)}
    lp = choice["logprobs"]
    ids, rows = logprobs_of(PROMPT)
    assert lp["tokens"] == list(PROMPT) and lp["text_offset"] == list(range(len(PROMPT)))
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None  # no context: OpenAI's and vLLM's null
    for i in range(1, len(ids)):
        assert lp["token_logprobs"][i] == pytest.approx(rows[i - 1, ids[i]].item(), abs=1e-4)
        values, top_ids = torch.topk(rows[i - 1], 20)
        want = {client.app.state.service.token_text(t): v for t, v in zip(top_ids.tolist(), values.tolist())}
        got = lp["top_logprobs"][i]
        assert len(got) == len(want) and all(got[k] == pytest.approx(v, abs=1e-4) for k, v in want.items())
    streamed = parse_sse(client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 0, "echo": True,
                                                               "logprobs": 2, "stream": True}).text)
    assert streamed[-1] == "[DONE]" and "".join(c["choices"][0]["text"] for c in streamed[:-1]) == PROMPT
    assert streamed[0]["choices"][0]["logprobs"]["token_logprobs"] == pytest.approx(lp["token_logprobs"], abs=1e-6)


def test_the_eval_cli_and_the_servers_prompt_logprobs_give_the_same_number(client: TestClient,
                                                                             char_checkpoint: Path) -> None:
    text = "ROMEO: but soft, what light through yonder window breaks"
    ck = load_checkpoint(char_checkpoint)
    offline = score(ck.model, ck.tokenizer, ck.tokenizer.encode(text))
    lp = complete(client, prompt=text, max_tokens=0, echo=True, logprobs=0)["choices"][0]["logprobs"]
    assert -sum(lp["token_logprobs"][1:]) == pytest.approx(offline.nll, rel=1e-5)
    assert offline.tokens == len(text) - 1


def test_n_choices_are_the_requests_for_seed_plus_i_alone(client: TestClient) -> None:
    together = complete(client, n=3, seed=40, max_tokens=8)
    alone = [texts(complete(client, seed=40 + i, max_tokens=8))[0] for i in range(3)]
    assert texts(together) == alone and len(set(alone)) > 1
    assert together["usage"]["completion_tokens"] == 24 and together["usage"]["prompt_tokens"] == len(PROMPT)
    chunks = parse_sse(client.post("/v1/completions", json={"prompt": PROMPT, "n": 3, "seed": 40, "max_tokens": 8,
                                                             "stream": True}).text)
    assert chunks[-1] == "[DONE]"
    per_index = ["", "", ""]
    for c in chunks[:-1]:
        (choice,) = c["choices"]
        per_index[choice["index"]] += choice["text"]
    assert per_index == alone


def test_best_of_returns_the_samples_of_highest_mean_logprob(client: TestClient) -> None:
    def mean_logprob(seed: int) -> tuple[float, str]:
        c = complete(client, seed=seed, max_tokens=6, logprobs=0)["choices"][0]
        return sum(c["logprobs"]["token_logprobs"]) / 6, c["text"]

    ranked = sorted((mean_logprob(7 + i) for i in range(4)), reverse=True)
    assert texts(complete(client, seed=7, max_tokens=6, best_of=4)) == [ranked[0][1]]
    assert texts(complete(client, seed=7, max_tokens=6, best_of=4, n=2)) == [ranked[0][1], ranked[1][1]]


def test_a_batch_of_prompts_text_or_token_ids(client: TestClient) -> None:
    tokenizer = client.app.state.service.tokenizer
    prompts = ["To be", "or not"]
    batch = complete(client, prompt=prompts, n=2, seed=3, max_tokens=5, echo=True)
    want = [texts(complete(client, prompt=p, seed=3 + i, max_tokens=5, echo=True))[0] for p in prompts
            for i in range(2)]
    assert texts(batch) == want and batch["usage"]["prompt_tokens"] == sum(map(len, prompts))
    ids = [tokenizer.encode(p) for p in prompts]
    assert texts(complete(client, prompt=ids, n=2, seed=3, max_tokens=5, echo=True)) == want
    assert texts(complete(client, prompt=ids[0], seed=3, max_tokens=5, echo=True)) == want[:1]


def test_openai_sampling_controls_equal_the_reference_loop(client: TestClient, reference) -> None:
    greedy = texts(complete(client, temperature=0, max_tokens=8))[0]
    banned = client.app.state.service.tokenizer.encode(greedy[0])[0]
    cases = [
        ({"logit_bias": {str(banned): -100}}, {"logit_bias": {banned: -100.0}}),
        ({"presence_penalty": 1.5, "frequency_penalty": 0.7}, {"presence_penalty": 1.5, "frequency_penalty": 0.7}),
        ({"min_p": 0.2, "seed": 5, "temperature": 1.0}, {"min_p": 0.2, "seed": 5, "temperature": 1.0,
                                                         "do_sample": True}),
    ]
    for body, params in cases:
        params = params if "seed" in params else {**params, "greedy": True}
        got = texts(complete(client, max_tokens=8, **({"temperature": 0} | body)))[0]
        assert got == reference(PROMPT, 8, **params)[1], body
    forced = texts(complete(client, temperature=0, max_tokens=6, logit_bias={str(banned): 100}))[0]
    assert forced == greedy[0] * 6
    assert texts(complete(client, temperature=0, max_tokens=8, logit_bias={str(banned): -100}))[0][0] != greedy[0]


def test_min_tokens_and_ignore_eos_keep_generating(bpe_client: TestClient) -> None:
    eos = bpe_client.app.state.service.engine.eos_id
    bias = {"logit_bias": {str(eos): 100}, "temperature": 0}  # EOS every step unless it is held back
    stopped = bpe_client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 8, **bias}).json()
    assert stopped["choices"][0]["finish_reason"] == "stop" and stopped["usage"]["completion_tokens"] == 1
    held = bpe_client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 8, "min_tokens": 5, **bias}).json()
    assert held["choices"][0]["finish_reason"] == "stop" and held["usage"]["completion_tokens"] == 6
    ignored = bpe_client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 8, "ignore_eos": True,
                                                        **bias}).json()
    assert ignored["choices"][0]["finish_reason"] == "length" and ignored["usage"]["completion_tokens"] == 8


def test_tgi_decoder_input_details_carry_the_prompts_logprobs(client: TestClient) -> None:
    r = client.post("/generate", json={"inputs": PROMPT, "parameters": {"max_new_tokens": 2, "details": True,
                                                                         "decoder_input_details": True}})
    prefill = r.json()["details"]["prefill"]
    echo = complete(client, max_tokens=0, echo=True, logprobs=0)["choices"][0]["logprobs"]
    assert [t["text"] for t in prefill] == echo["tokens"]
    assert "logprob" in prefill[0] and prefill[0]["logprob"] is None  # no context: null, as TGI writes it
    assert [t["logprob"] for t in prefill[1:]] == pytest.approx(echo["token_logprobs"][1:], abs=1e-6)


def test_tgi_best_of_answers_the_best_and_lists_the_others(client: TestClient) -> None:
    def sample(seed: int) -> dict[str, Any]:
        r = client.post("/generate", json={"inputs": PROMPT, "parameters": {
            "max_new_tokens": 6, "do_sample": True, "seed": seed, "details": True}})
        return r.json()

    orders = set()
    for seed in range(11, 19):  # seeds where the first sample is the better one, and where the second is
        singles = [sample(seed), sample(seed + 1)]
        means = [sum(t["logprob"] for t in s["details"]["tokens"]) / 6 for s in singles]
        r = client.post("/generate", json={"inputs": PROMPT, "parameters": {
            "max_new_tokens": 6, "do_sample": True, "seed": seed, "best_of": 2, "details": True}})
        body = r.json()
        best, other = (0, 1) if means[0] >= means[1] else (1, 0)
        orders.add(best)
        assert body["generated_text"] == singles[best]["generated_text"], seed
        (seq,) = body["details"]["best_of_sequences"]
        assert seq["generated_text"] == singles[other]["generated_text"] and seq["seed"] == seed + other
    assert orders == {0, 1}  # both cases were exercised
    stream = client.post("/generate_stream", json={"inputs": PROMPT, "parameters": {"best_of": 2, "do_sample": True}})
    assert stream.status_code == 422 and "best_of" in stream.json()["error"]


def test_detokenize_inverts_tokenize(client: TestClient, bpe_client: TestClient) -> None:
    for c, text in ((client, PROMPT), (bpe_client, "emoji 😀 and 中文 ok")):
        ids = [t["id"] for t in c.post("/tokenize", json={"inputs": text}).json()]
        r = c.post("/detokenize", json={"tokens": ids})
        assert r.status_code == 200 and r.json() == {"prompt": text}
    r = client.post("/detokenize", json={"tokens": [0, 10**6]})
    assert r.status_code == 422 and "tokens" in r.json()["error"] and "1000000" in r.json()["error"]
    assert math.isfinite(len(client.post("/detokenize", json={"tokens": []}).json()["prompt"]) + 0.0)
