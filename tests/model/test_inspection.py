"""`model.inspection`: attention weights against an independent softmax(q k^T / sqrt(d)) reference, the logit lens at
the last layer against the model's own distribution, next-token scores, limits, and the PNG command."""

from __future__ import annotations

import contextlib

import pytest
import torch

from model import kernels
from model.checkpoint import load_checkpoint
from model.config import GPTConfig
from model.gpt import GPT
from model.inspection import (
    MAX_ATTENTION_ROWS,
    InspectError,
    InspectOptions,
    check_options,
    inspect,
    main,
)
from model.sampler import usable_logits
from model.tokenizer import CharTokenizer
from tests.model.references import reference_attention


@pytest.fixture(scope="module")
def bundled(repo):
    return load_checkpoint(repo / "weights" / "shakespeare-char")


@pytest.fixture(scope="module")
def gpt2_shape():
    """GPT-2 small's widths (12 heads of 64, vocabulary 50304) with two layers, over a character tokenizer."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=64, vocab_size=50304, n_layer=2, n_head=12, n_embd=768)).eval()
    return model, CharTokenizer([chr(c) for c in range(32, 127)])


@pytest.mark.parametrize("path", ["kernels", "torch"])
def test_attention_equals_the_reference_on_the_bundled_model(bundled, path) -> None:
    ids = bundled.tokenizer.encode("ROMEO:\nWherefore art thou Romeo?")
    if path == "kernels":  # the queries and keys then come from the kernels' linear (31 rows: their range)
        assert kernels.load(), kernels.status()
    with contextlib.nullcontext() if path == "kernels" else kernels.disabled():
        result = inspect(bundled.model, bundled.tokenizer, ids)
    cfg = bundled.config
    assert result.dense and len(result.attention) == cfg.n_layer * cfg.n_head
    for layer in range(cfg.n_layer):
        want = reference_attention(bundled.model, ids, layer)
        for head in range(cfg.n_head):
            got = next(a for a in result.attention if (a.layer, a.head) == (layer, head))
            assert [len(row) for row in got.weights] == list(range(1, len(ids) + 1))  # causal: keys 0..query
            for q, row in enumerate(got.weights):
                torch.testing.assert_close(torch.tensor(row), want[head, q, : q + 1], rtol=0, atol=1e-5)


def test_attention_over_an_fp16_cache_is_the_reference_with_keys_and_values_rounded(bundled) -> None:
    """As an engine with an fp16 cache serves it: every layer attends to keys and values rounded to fp16, and the
    maps are the reference's with the same rounding, not the fp32 one's (3.6e-4 and 5.5e-4 away). Through torch's
    products, as the reference's. Layer 0's keys are the reference's bit for bit (the same ops on the same inputs):
    equal to 1e-5. Layer 1 attends to keys computed from layer 0's rounded values, which the inspector sums in
    SDPA's order and the reference in its own: a key that lands within that difference of a rounding midpoint
    rounds to the neighbouring half (one step, 2^-11 of it), and moved weights by up to 2.8e-5 (5 of 13,824 on an
    AMX Xeon; within 1e-5 on the AMD EPYC of earlier runs): within 1e-4, where the fp32 reference is not. Deeper
    layers amplify such steps (~2e-4 by layer 5)."""
    ids = bundled.tokenizer.encode("ROMEO:\nWherefore art thou Romeo? Deny thy father")
    with kernels.disabled():
        result = inspect(bundled.model, bundled.tokenizer, ids, InspectOptions(layers=(0, 1), lens=False),
                         kv_dtype=torch.float16)
    for layer, tolerance in ((0, 1e-5), (1, 1e-4)):
        got = torch.zeros(bundled.config.n_head, len(ids), len(ids))
        for a in result.attention:
            for q, row in enumerate(a.weights if a.layer == layer else []):
                got[a.head, q, : q + 1] = torch.tensor(row)
        want = reference_attention(bundled.model, ids, layer, kv_dtype=torch.float16)
        torch.testing.assert_close(got, want, rtol=0, atol=tolerance)
        assert not torch.allclose(got, reference_attention(bundled.model, ids, layer), rtol=0, atol=1e-4)


def test_attention_equals_the_reference_on_a_gpt2_shape_sparse(gpt2_shape) -> None:
    model, tok = gpt2_shape
    ids = tok.encode("It was the best of times, it was the worst of times.")
    opts = InspectOptions(layers=(1,), heads=(0, 7, 11), dense_max_tokens=8, sparse_threshold=0.05, sparse_top=4)
    result = inspect(model, tok, ids, opts)
    assert not result.dense and result.sparse_threshold == 0.05
    want = reference_attention(model, ids, 1)
    for got in result.attention:
        for q, (keys, weights) in enumerate(zip(got.keys, got.weights)):
            ref = want[got.head, q, : q + 1]
            top = torch.topk(ref, min(4, q + 1))
            expect = [(k, w) for k, w in zip(top.indices.tolist(), top.values.tolist()) if w >= 0.05]
            assert keys == [k for k, _ in expect]
            assert weights == pytest.approx([w for _, w in expect], abs=1e-5)


def test_logit_lens_last_layer_is_the_models_distribution_and_scores_match(bundled) -> None:
    ids = bundled.tokenizer.encode("KING HENRY:\nOnce more unto the breach")
    result = inspect(bundled.model, bundled.tokenizer, ids, InspectOptions(attention=False, lens_top=3, top_n=4))
    assert [layer.layer for layer in result.lens] == list(range(bundled.config.n_layer + 1))
    with torch.no_grad():
        logits = usable_logits(bundled.model(torch.tensor([ids]))[0].float(), bundled.tokenizer.n_vocab)
    probs, logprobs = logits.softmax(-1), logits.log_softmax(-1)
    last = result.lens[-1]
    for pos, top in enumerate(last.top):
        want = torch.topk(probs[pos], 3)
        assert [i for i, _ in top] == want.indices.tolist()
        assert [p for _, p in top] == pytest.approx(want.values.tolist(), abs=1e-5)
    assert result.next_tokens[0].logprob is None and [t.id for t in result.next_tokens] == ids
    for pos in range(1, len(ids)):
        assert result.next_tokens[pos].logprob == pytest.approx(logprobs[pos - 1, ids[pos]].item(), abs=1e-5)
        assert [a.id for a in result.next_tokens[pos].top_tokens] == torch.topk(logprobs[pos - 1], 4).indices.tolist()
    assert [text for text, _, _ in result.spans] == list("KING HENRY:\nOnce more unto the breach")


def test_limits_are_refused_before_any_work(bundled, gpt2_shape) -> None:
    model, tok = gpt2_shape
    cases = [(InspectOptions(layers=(6,)), "layers", "[0, 5]"), (InspectOptions(heads=(-1,)), "heads", "[0, 5]"),
             (InspectOptions(lens_top=21), "lens_top", "[0, 20]")]
    for opts, field, part in cases:
        with pytest.raises(InspectError) as e:
            inspect(bundled.model, bundled.tokenizer, [1, 2, 3], opts)
        assert e.value.field == field and part in e.value.message
    with pytest.raises(InspectError) as e:
        inspect(bundled.model, bundled.tokenizer, [1] * 129)
    assert e.value.field == "text" and "128" in e.value.message
    with pytest.raises(InspectError) as e:  # the budget of attention rows: layers x heads x tokens
        big = GPT(GPTConfig(block_size=1024, vocab_size=65, n_layer=20, n_head=12, n_embd=24))
        check_options(InspectOptions(lens=False), 1024, big, 65)
    assert e.value.field == "layers" and str(MAX_ATTENTION_ROWS) in e.value.message
    with pytest.raises(InspectError) as e:  # the lens budget: lens layers x tokens x vocabulary
        check_options(InspectOptions(attention=False), 1024, GPT(GPTConfig(block_size=1024, vocab_size=50304,
                      n_layer=16, n_head=2, n_embd=8)), 50304)  # 17 x 1024 x 50304 > the budget
    assert e.value.field == "lens_layers"


def test_the_command_writes_the_heatmaps(repo, tmp_path) -> None:
    out = tmp_path / "maps"
    assert main(["--checkpoint", str(repo / "weights" / "shakespeare-char"), "--text", "To be, or not",
                 "--out", str(out), "--layers", "0", "--heads", "1"]) == 0
    files = sorted(p.name for p in out.iterdir())
    assert files == ["attention-L0-H1.png", "logit-lens.png"]
    assert all((out / f).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for f in files)
    assert main(["--checkpoint", str(repo / "weights" / "shakespeare-char"), "--text", "\u00e9\u00e9",
                 "--out", str(out)]) == 2  # characters the model does not know: one error line


def test_the_lm_head_runs_a_chunk_of_positions_per_step_with_the_same_answer(gpt2_shape, monkeypatch) -> None:
    from model import inspection as module

    model, tok = gpt2_shape
    ids = tok.encode("It was the best of times")  # 24 tokens
    whole = inspect(model, tok, ids, InspectOptions(attention=False, top_n=3))
    monkeypatch.setattr(module, "LENS_STEP_LOGITS", 5 * model.config.vocab_size)  # 5 positions a step
    inspector = module.Inspector(model, tok, ids, InspectOptions(attention=False, top_n=3))
    # 3 read-outs (embeddings, 2 blocks) of 5 chunks each: 4 steps between chunks and 1 after each read-out
    assert sum(1 for _ in inspector.steps()) == 3 * 5
    chunked = inspector.result
    assert [layer.layer for layer in chunked.lens] == [0, 1, 2]
    for a, b in zip(whole.lens, chunked.lens):
        assert [[i for i, _ in pos] for pos in a.top] == [[i for i, _ in pos] for pos in b.top]
        assert [p for pos in a.top for _, p in pos] == pytest.approx([p for pos in b.top for _, p in pos], abs=1e-6)
    assert [t.id for t in chunked.next_tokens] == ids and chunked.next_tokens[0].logprob is None
    assert [t.logprob for t in chunked.next_tokens[1:]] == pytest.approx(
        [t.logprob for t in whole.next_tokens[1:]], abs=1e-5)
    assert [[a.id for a in t.top_tokens] for t in chunked.next_tokens] == [
        [a.id for a in t.top_tokens] for t in whole.next_tokens]


def test_weights_and_lens_probabilities_rounded_to_the_decimals_asked(bundled) -> None:
    ids = bundled.tokenizer.encode("To be, or not to be")
    exact = inspect(bundled.model, bundled.tokenizer, ids, InspectOptions(layers=(2,), heads=(3,)))
    rounded = inspect(bundled.model, bundled.tokenizer, ids, InspectOptions(layers=(2,), heads=(3,), decimals=6))
    for a, b in zip(exact.attention[0].weights, rounded.attention[0].weights):
        assert b == pytest.approx([round(w, 6) for w in a], abs=1e-12) and b == pytest.approx(a, abs=5e-7)
    for a, b in zip(exact.lens, rounded.lens):
        assert [[i for i, _ in pos] for pos in a.top] == [[i for i, _ in pos] for pos in b.top]
        assert [p for pos in b.top for _, p in pos] == pytest.approx([round(p, 6) for pos in a.top for _, p in pos],
                                                                     abs=1e-12)
