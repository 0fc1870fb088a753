"""POST /inspect against the real app: attention equal to an independent softmax(q k^T / sqrt(d)) reference on the
bundled model and on a GPT-2-shaped BPE model (dense and sparse), the logit lens' last layer and the token scores
equal to the model's own distribution, a prompt plus a generation request, the limits (413) and bad inputs (422)
naming the field, the API key, and a running stream that keeps streaming while an inspection runs."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from fastapi.testclient import TestClient

from app.api.inspect import router as inspect_api
from app.api.inspect.protocol import InspectRequest, InspectResponse
from app.api.inspect.router import estimated_bytes
from app.testing import assert_tgi_error, parse_sse, strict_json
from model import inspection as model_inspect
from model.checkpoint import load_checkpoint
from model.config import GPTConfig
from model.engine.attention import MAX_REQUEST_WEIGHTS, MAX_TOKEN_WEIGHTS
from model.inspection import InspectTooLarge, check_options
from model.quantize import Int8Linear, quantize
from model.sampler import usable_logits
from model.testing import make_char_checkpoint, make_gpt2_shaped_checkpoint
from model.tokenizer import BPETokenizer
from tests.app.api.calls import engine_of, generate
from tests.model.conftest import INT8_GEMMS, gemm, int8_product_as_served, kernel_variant  # noqa: F401 (a fixture)
from tests.model.references import reference_attention

TEXT = "ROMEO:\nWherefore art thou Romeo? Deny thy father and refuse thy name."
BPE_TEXT = ("It was the best of times, it was the worst of times, it was the age of wisdom, it was the age of "
            "foolishness, it was the epoch of belief, it was the epoch of incredulity, it was the season of Light, "
            "it was the season of Darkness, it was the spring of hope, it was the winter of despair.")


@pytest.fixture(scope="module")
def bundled(repo: Path) -> Path:
    return repo / "weights" / "shakespeare-char"


@pytest.fixture(scope="module")
def bundled_client(make_client: Callable[..., TestClient], bundled: Path) -> TestClient:
    return make_client(bundled)


@pytest.fixture(scope="module")
def gpt2_shaped(tmp_path_factory: pytest.TempPathFactory, gpt2_tok: BPETokenizer) -> Path:
    """GPT-2's vocabulary and BPE, 12 heads (of 8), 2 layers, context 256."""
    return make_gpt2_shaped_checkpoint(tmp_path_factory.mktemp("ckpt") / "gpt2-shaped", gpt2_tok, n_layer=2,
                                       n_head=12, head_size=8, block_size=256)


@pytest.fixture(scope="module")
def gpt2_client(make_client: Callable[..., TestClient], gpt2_shaped: Path) -> TestClient:
    return make_client(gpt2_shaped)


def inspect(client: TestClient, **body: Any) -> dict:
    r = client.post("/inspect", json=body)
    assert r.status_code == 200, r.text
    answer = strict_json(r.text)
    InspectResponse.model_validate(answer)  # the documented schema, every field present
    assert list(answer) == list(InspectResponse.model_fields)
    return answer


def maps_of(answer: dict) -> dict[tuple[int, int], dict]:
    return {(m["layer"], m["head"]): m for m in answer["attention"]["maps"]}


def test_attention_on_the_bundled_model_equals_the_reference(bundled_client: TestClient, bundled: Path) -> None:
    answer = inspect(bundled_client, inputs=TEXT, lens=False)
    ck = load_checkpoint(bundled)  # a fresh copy: plain torch modules, no kernels
    ids = ck.tokenizer.encode(TEXT)
    assert [t["id"] for t in answer["tokens"]] == ids
    assert "".join(t["text"] for t in answer["tokens"]) == TEXT
    assert [(t["start"], t["stop"]) for t in answer["tokens"]] == [(i, i + 1) for i in range(len(TEXT))]
    att = answer["attention"]
    assert (att["format"], att["threshold"], att["top"]) == ("dense", None, None)
    maps = maps_of(answer)
    assert sorted(maps) == [(layer, head) for layer in range(6) for head in range(6)]
    for layer in range(ck.config.n_layer):
        want = reference_attention(ck.model, ids, layer)  # (n_head, T, T)
        for head in range(ck.config.n_head):
            rows = maps[layer, head]["weights"]
            assert [len(row) for row in rows] == list(range(1, len(ids) + 1)) and "keys" not in maps[layer, head]
            for q, row in enumerate(rows):
                torch.testing.assert_close(torch.tensor(row), want[head, q, : q + 1], rtol=0, atol=1e-5)


def test_attention_on_a_gpt2_shaped_model_sparse_and_dense(gpt2_client: TestClient, gpt2_shaped: Path) -> None:
    ck = load_checkpoint(gpt2_shaped)
    ids = ck.tokenizer.encode(BPE_TEXT)
    assert 40 < len(ids) < 128
    # sparse: per query the 4 largest weights of at least 0.05, with the threshold stated
    answer = inspect(gpt2_client, inputs=BPE_TEXT, layers=[1], heads=[0, 5, 11], dense_max_tokens=16,
                     sparse_threshold=0.05, sparse_top=4, lens=False)
    assert [t["id"] for t in answer["tokens"]] == ids
    assert (answer["attention"]["format"], answer["attention"]["threshold"], answer["attention"]["top"]) == (
        "sparse", 0.05, 4)
    want = reference_attention(ck.model, ids, 1)
    kept = 0
    for (layer, head), m in maps_of(answer).items():
        assert layer == 1 and head in (0, 5, 11) and len(m["keys"]) == len(ids)
        for q, (keys, weights) in enumerate(zip(m["keys"], m["weights"])):
            top = torch.topk(want[head, q, : q + 1], min(4, q + 1))
            expect = [(k, w) for k, w in zip(top.indices.tolist(), top.values.tolist()) if w >= 0.05]
            assert keys == [k for k, _ in expect]
            assert weights == pytest.approx([w for _, w in expect], abs=1e-5)
            kept += len(keys)
    assert len(ids) < kept < 3 * 4 * len(ids)  # peaked enough that something is kept, sparse enough to drop some
    # dense on request, every layer and head
    dense = maps_of(inspect(gpt2_client, inputs=BPE_TEXT, dense_max_tokens=256, lens=False))
    assert len(dense) == 2 * 12
    for layer in range(2):
        want = reference_attention(ck.model, ids, layer)
        for head in range(12):
            for q, row in enumerate(dense[layer, head]["weights"]):
                torch.testing.assert_close(torch.tensor(row), want[head, q, : q + 1], rtol=0, atol=1e-5)


@pytest.mark.parametrize("which", ["bundled", "gpt2"])
def test_lens_last_layer_and_scores_are_the_models_own(which: str, request: pytest.FixtureRequest) -> None:
    client = request.getfixturevalue(f"{'bundled' if which == 'bundled' else 'gpt2'}_client")
    ck = load_checkpoint(request.getfixturevalue("bundled" if which == "bundled" else "gpt2_shaped"))
    text = TEXT if which == "bundled" else BPE_TEXT
    answer = inspect(client, inputs=text, attention=False, lens_top=4, top_n=3)
    ids = ck.tokenizer.encode(text)
    with torch.no_grad():
        logits = usable_logits(ck.model(torch.tensor([ids]))[0].float(), ck.tokenizer.n_vocab)
    probs, logprobs = logits.softmax(-1), logits.log_softmax(-1)
    assert answer["attention"] is None
    assert [layer["layer"] for layer in answer["lens"]] == list(range(ck.config.n_layer + 1))
    last = answer["lens"][-1]["top"]
    for pos, top in enumerate(last):
        want = torch.topk(probs[pos], 4)
        assert [i for i, _ in top] == want.indices.tolist()
        assert [p for _, p in top] == pytest.approx(want.values.tolist(), abs=1e-5)
    assert set(answer["vocab"]) == {str(i) for layer in answer["lens"] for pos in layer["top"] for i, _ in pos}
    assert all(answer["vocab"][str(i)] == ck.tokenizer.decode([i]) for i, _ in last[0])
    tokens = answer["tokens"]
    assert tokens[0]["logprob"] is None and tokens[0]["top_tokens"] == []
    for pos in range(1, len(ids)):
        assert tokens[pos]["logprob"] == pytest.approx(logprobs[pos - 1, ids[pos]].item(), abs=1e-5)
        want = torch.topk(logprobs[pos - 1], 3)
        assert [a["id"] for a in tokens[pos]["top_tokens"]] == want.indices.tolist()
        assert [a["text"] for a in tokens[pos]["top_tokens"]] == [ck.tokenizer.decode([i]) for i in want.indices]


def test_a_vocabulary_smaller_than_the_alternatives_asked_for_gives_all_of_it(
        make_client: Callable[..., TestClient], tmp_path: Path) -> None:
    """A 2-symbol model and the default top_n and lens_top of 5 (before: 424 "selected index k out of range"):
    each position's alternatives and lens entries are the whole vocabulary, in the model's own order."""
    ck = load_checkpoint(make_char_checkpoint(tmp_path / "two", chars=["a", "b"]))
    client = make_client(ck.path)
    text = "abbab"
    answer = inspect(client, inputs=text)
    ids = ck.tokenizer.encode(text)
    with torch.no_grad():
        logprobs = ck.model(torch.tensor([ids]))[0].float().log_softmax(-1)
    for pos in range(1, len(ids)):
        want = torch.topk(logprobs[pos - 1], 2)
        got = answer["tokens"][pos]["top_tokens"]
        assert [a["id"] for a in got] == want.indices.tolist()
        assert [a["logprob"] for a in got] == pytest.approx(want.values.tolist(), abs=1e-5)
    last = answer["lens"][-1]["top"]
    assert [[i for i, _ in top] for top in last] == torch.topk(logprobs, 2).indices.tolist()
    assert all(sum(p for _, p in top) == pytest.approx(1, abs=1e-5) for layer in answer["lens"] for top in layer["top"])


def test_a_prompt_and_a_generation_request(bundled_client: TestClient) -> None:
    params = {"max_new_tokens": 24, "do_sample": True, "temperature": 0.9, "seed": 5}
    answer = inspect(bundled_client, inputs="JULIET:", parameters=params, layers=[5], heads=[2], lens_layers=[6])
    plain = generate(bundled_client, "JULIET:", **params)["generated_text"]
    assert answer["generated_text"] == plain
    assert "".join(t["text"] for t in answer["tokens"]) == "JULIET:" + plain
    assert [t["generated"] for t in answer["tokens"]] == [False] * 7 + [True] * 24
    assert len(maps_of(answer)[5, 2]["weights"]) == 31 and [layer["layer"] for layer in answer["lens"]] == [6]
    # truncate: the last 10 of them
    cut = inspect(bundled_client, inputs="JULIET:", parameters=params, truncate=10, lens=False)
    assert [t["id"] for t in cut["tokens"]] == [t["id"] for t in answer["tokens"][-10:]]
    assert all(t["generated"] for t in cut["tokens"]) and cut["tokens"][0]["start"] == 0


def test_the_limits_answer_413_naming_the_field_limit_and_value(make_client: Callable[..., TestClient],
                                                                bundled_client: TestClient,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    short = make_client(max_tokenize_chars=40)
    assert_tgi_error(short.post("/inspect", json={"inputs": "a" * 41}), 413, "payload_too_large",
                     "inputs:", "at most 40 characters", "got 41")
    n = len(TEXT)  # one token a character
    cases = [(model_inspect, "MAX_ATTENTION_ROWS", 1000, {}, "layers:", f"is {36 * n}", "more than 1000"),
             (model_inspect, "MAX_LENS_LOGITS", 10_000, {"attention": False}, "lens_layers:", f"is {7 * n * 65}",
              "more than 10000"),
             (inspect_api, "MAX_RESPONSE_BYTES", 100_000, {"lens": False}, "layers:", "more than the limit of 100000",
              "fewer layers")]
    for module, name, value, body, *needles in cases:
        with monkeypatch.context() as m:
            m.setattr(module, name, value)
            r = bundled_client.post("/inspect", json={"inputs": TEXT, **body})
        assert_tgi_error(r, 413, "payload_too_large", *needles)
    # with a generation request the limits count the tokens it may add: refused before generating
    before = engine_of(bundled_client).stats.generated_tokens_total
    with monkeypatch.context() as m:
        m.setattr(model_inspect, "MAX_ATTENTION_ROWS", 36 * 40)
        r = bundled_client.post("/inspect", json={"inputs": "ROMEO:", "parameters": {"max_new_tokens": 40}})
    assert_tgi_error(r, 413, "payload_too_large", "layers:", f"is {36 * 46}")
    assert engine_of(bundled_client).stats.generated_tokens_total == before


BAD = [
    ({"inputs": ""}, "inputs:", "1 to 128 tokens", "got 0"),
    ({"inputs": "x" * 129}, "inputs:", "1 to 128 tokens", "got 129", "truncate"),
    ({"inputs": "caf\u00e9"}, "inputs:", "outside this model's vocabulary"),
    ({"inputs": "ab", "layers": [6]}, "layers:", "[0, 5]", "[6]"),
    ({"inputs": "ab", "heads": [-1, 2]}, "heads:", "[0, 5]", "[-1]"),
    ({"inputs": "ab", "layers": []}, "layers:", "at least 1 item"),
    ({"inputs": "ab", "lens_layers": [7]}, "lens_layers:", "[0, 6]", "[7]"),
    ({"inputs": "ab", "top_n": 21}, "top_n:", "[0, 20]", "got 21"),
    ({"inputs": "ab", "lens_top": 0}, "lens_top:", "[1, 20]", "got 0"),
    ({"inputs": "ab", "sparse_threshold": 0}, "sparse_threshold:", "(0, 1]"),
    ({"inputs": "ab", "truncate": 0}, "truncate:", "got 0"),
    ({"inputs": "ab", "layers": "all"}, "layers:", "got 'all'"),
    ({"inputs": "ab", "layers": [1.5]}, "layers.0:", "got 1.5"),
    ({"inputs": "ab", "colour": True}, "colour: unknown field"),
    ({"text": "ab"}, "inputs:", "required"),
    ({"inputs": "ab", "parameters": {"max_new_tokens": 0}}, "parameters.max_new_tokens:", "got 0"),
    ({"inputs": "ab", "parameters": {"max_new_tokens": 127}}, "parameters.max_new_tokens:", "context of 128",
     "got 129"),
    ({"inputs": "ab", "parameters": {"temperature": -1}}, "parameters.temperature:", "got -1"),
    ({"inputs": "ab", "parameters": {"attention": {}}}, "parameters.attention:", "its own attention maps"),
    ({"inputs": "ab", "parameters": {"best_of": 2, "do_sample": True}}, "parameters.best_of:", "must be 1", "got 2"),
]


def test_the_defaults_admit_gpt2_smalls_whole_context() -> None:
    """Every layer and head and the whole lens of a 1,024-token text on GPT-2 small: within each budget and the
    answer's limit (sparse attention), so the limits refuse only what is larger than that."""
    config = GPTConfig(block_size=1024, vocab_size=50304, n_layer=12, n_head=12, n_embd=768)
    options = InspectRequest(inputs="x").to_options()
    check_options(options, 1024, SimpleNamespace(config=config), 50257)  # raises beyond a budget
    attention, rest = estimated_bytes(1024, options, config)
    assert attention + rest <= inspect_api.MAX_RESPONSE_BYTES
    with pytest.raises(InspectTooLarge):  # one more layer's lens is beyond it
        check_options(options, 1024, SimpleNamespace(config=replace(config, n_layer=13)), 50257)


@pytest.mark.parametrize("case", BAD, ids=[str(i) for i in range(len(BAD))])
def test_bad_inputs_are_422_naming_the_field(bundled_client: TestClient, case: tuple) -> None:
    body, *needles = case
    assert_tgi_error(bundled_client.post("/inspect", json=body), 422, "validation", *needles)


def test_the_api_key_guards_inspect_not_its_limits(make_client: Callable[..., TestClient]) -> None:
    client = make_client(api_key="s3cret")
    r = client.post("/inspect", json={"inputs": "ab"})
    assert_tgi_error(r, 401, "authentication", "API key")
    assert client.post("/inspect", json={"inputs": "ab"}, headers={"Authorization": "Bearer s3cret"}).status_code == 200
    limits = client.get("/inspect/limits").json()
    assert limits["model"] == {"n_layer": 2, "n_head": 2, "block_size": 64, "n_vocab": 96}
    assert limits["stream_attention"] == {"max_token_weights": MAX_TOKEN_WEIGHTS,
                                          "max_request_weights": MAX_REQUEST_WEIGHTS}
    assert (limits["max_response_bytes"], limits["max_top"], limits["decimals"]) == (32 * 2**20, 20, 6)


def test_a_running_stream_keeps_streaming_while_an_inspection_runs(bundled_client: TestClient) -> None:
    """The inspection's steps (7 on the bundled model: embeddings and 6 blocks) take turns with the stream's decode
    steps on the engine thread; the stream ends with the tokens it has alone."""
    engine = engine_of(bundled_client)
    order: list[str] = []
    decoding = threading.Event()
    submit_job = engine.submit_job

    def recording(steps, result, **kwargs):  # noqa: ANN001, ANN202
        def stepped():
            for step in steps:
                order.append("job")
                yield step

        return submit_job(stepped(), result, **kwargs)

    def fault_hook(reqs: list) -> None:
        order.append("decode")
        decoding.set()

    body = {"inputs": "ROMEO:", "parameters": {"max_new_tokens": 250, "seed": 3, "do_sample": True}}
    alone = parse_sse(bundled_client.post("/generate_stream", json=body).text)
    engine.submit_job, engine.fault_hook = recording, fault_hook
    try:
        with ThreadPoolExecutor(1) as pool:
            stream = pool.submit(bundled_client.post, "/generate_stream", json=body)
            assert decoding.wait(10)
            answer = inspect(bundled_client, inputs=TEXT, lens_top=1)
            events = parse_sse(stream.result(timeout=60).text)
    finally:
        engine.submit_job, engine.fault_hook = submit_job, None
    assert [e["token"]["id"] for e in events] == [e["token"]["id"] for e in alone]
    assert len(answer["attention"]["maps"]) == 36
    first, last = order.index("job"), len(order) - order[::-1].index("job")
    assert order.count("job") == 7 and order[first:last].count("decode") >= 6  # a decode step between every two


def served_int8_product(q: Int8Linear, x: torch.Tensor) -> torch.Tensor:
    """An `Int8Linear`'s product as the served model's kernels compute it for a forward of these rows, in float64
    (`int8_product_as_served`: the rows rounded to int8 in an int8 GEMM, to int16 in the avx512vnni kernels, else
    as they are), rounded to fp32 as the model passes it on."""
    rows = x.reshape(-1, x.shape[-1])
    y = int8_product_as_served(rows, q.stored, q.scale, q.bias, packed=True)  # a served model's weights are packed
    return y.float().view(*x.shape[:-1], -1)


def unrounded_int8_product(q: Int8Linear, x: torch.Tensor) -> torch.Tensor:
    """The product with the dequantized weight, the rows as they are, in float64 rounded to fp32."""
    y = x.double() @ q.dequantized().double().T + (0 if q.bias is None else q.bias.double())
    return y.float()


def served_attention_tolerance(model: torch.nn.Module, ids: list[int], layer: int) -> float:
    """How far the served weights of `layer` may be from the reference with the products as served: fp32's
    summation order (1e-5, as for the fp32 model) where the kernels multiply the rows as they are (avx2, avx512),
    and in layer 0, whose products' inputs differ from the reference's by the layer norm's summation order alone.
    Where they round the rows to int16 first (avx512vnni), a value that the served model computes in another order
    than the reference and lies within that difference of a rounding midpoint rounds to the other side: a whole
    step where the rounding moves each value by half a step at most. So twice the rounding's own effect on the
    reference's weights is allowed besides (the bundled model by layer 5: ~1.5e-4, that of fp32-sized differences
    before the rounding ~1.2e-4)."""
    if layer == 0:
        return 1e-5
    rounded = reference_attention(model, ids, layer, served_int8_product)
    return 1e-5 + 2 * (rounded - reference_attention(model, ids, layer, unrounded_int8_product)).abs().max().item()


@pytest.mark.usefixtures("kernel_variant")
def test_attention_with_int8_weights_equals_the_reference_of_the_served_products(
        make_client: Callable[..., TestClient], bundled: Path) -> None:
    """`--quantize int8`, in every kernel variant this CPU runs: the queries and keys come from the kernels' int8
    products (the bundled model's are too small for the int8 GEMM), which round the rows to int16 in the avx512vnni
    variant and multiply them as they are in the others. The weights of an inspection, and those each step of a
    stream reports, equal the reference run with those products computed independently, within the bounds of that
    arithmetic (`served_attention_tolerance`). With an fp32 cache: in an fp16 one a key the two sum in another order
    can round to the neighbouring half (one step: 2^-11 of it), which moved weights by 2.5e-5 in layer 0 and 2e-4
    by layer 5 in every variant (measured); the inspector's fp16 cache is tested through torch's products, whose
    order the reference shares (tests/model/test_inspection.py)."""
    client = make_client(bundled, quantize="int8", kv_cache_dtype="fp32")
    text = TEXT[:40]  # 40 tokens
    answer = inspect(client, inputs=text, layers=[0, 5], lens=False)
    ck = load_checkpoint(bundled)
    quantize(ck.model, "int8")
    ids = ck.tokenizer.encode(text)
    assert not any(gemm(len(ids), m.stored) in INT8_GEMMS for m in ck.model.modules() if isinstance(m, Int8Linear))
    maps = maps_of(answer)
    for layer in (0, 5):
        want = reference_attention(ck.model, ids, layer, served_int8_product)
        tolerance = served_attention_tolerance(ck.model, ids, layer)
        for head in range(6):
            for q, row in enumerate(maps[layer, head]["weights"]):
                torch.testing.assert_close(torch.tensor(row), want[head, q, : q + 1], rtol=0, atol=tolerance)
    # a stream of 3 + 4 tokens, all in the kernels: each step's attention is the reference's over the whole text,
    # as an inspection of it sees it
    short = TEXT[:3]
    events = parse_sse(client.post("/generate_stream", json={"inputs": short, "parameters": {
        "max_new_tokens": 4, "greedy": True, "attention": {"layers": [5], "heads": [2]}}}).text)
    whole = ck.tokenizer.encode(short + "".join(e["token"]["text"] for e in events))
    inspected = maps_of(inspect(client, inputs=ck.tokenizer.decode(whole), layers=[5], heads=[2], lens=False))
    want = reference_attention(ck.model, whole, 5, served_int8_product)[2]
    tolerance = served_attention_tolerance(ck.model, whole, 5)
    for i, ev in enumerate(events):
        q = len(short) + i - 1
        assert ev["attention"]["weights"][0] == pytest.approx(want[q, : q + 1].tolist(), abs=tolerance)
        assert inspected[5, 2]["weights"][q] == pytest.approx(want[q, : q + 1].tolist(), abs=tolerance)
