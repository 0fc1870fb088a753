"""Speculative decoding in the engine (`speculative_model="[ngram]"`): the drafted tokens verified in the decode
step's forward give plain decoding's greedy tokens exactly, alone and batched, under stops, max_new_tokens, penalties,
the window and int8 weights; rejected tokens leave nothing behind in the cache; the requests that cannot speculate
decode plainly; the counters count."""

from __future__ import annotations

import copy
import random
import re

import pytest

from model.quantize import quantize
from model.sampling_params import AttentionSpec, SamplingParams
from model.structured import ConstraintCompiler, ConstraintSpec
from tests.engine.references import naive, together
from tests.sampling.distributions import same_distribution_ok

SPEC = {"speculative_model": "[ngram]", "num_speculative_tokens": 4}


def prompts(tok, n: int, seed: int = 0) -> list[list[int]]:
    """Prompts that repeat themselves (prompt lookup finds drafts in them), and some random ones."""
    rng = random.Random(seed)
    out = [tok.encode("abcabcabcab"), tok.encode("the cat sat. the cat"), tok.encode("hello world, hello w")]
    while len(out) < n:
        piece = [rng.randrange(tok.n_vocab) for _ in range(rng.randrange(2, 7))]
        out.append((piece * 4)[: rng.randrange(3, 20)] if rng.random() < 0.7 else piece)
    return out


def drafted(engine) -> tuple[int, int]:
    return engine.stats.spec_decode_num_draft_tokens_total, engine.stats.spec_decode_num_accepted_tokens_total


@pytest.mark.parametrize("weights", ["fp32", "int8"])
def test_greedy_tokens_equal_plain_decoding_alone_and_batched(make_checkpoint, make_engine, weights: str) -> None:
    ck = make_checkpoint(block_size=64)
    if weights == "int8":
        ck = copy.copy(ck)
        ck.model = copy.deepcopy(ck.model)
        quantize(ck.model, "int8")
    plain, spec = make_engine(ck, max_batch_size=4), make_engine(ck, max_batch_size=4, **SPEC)
    lengths = [30, 7, 1, 2, 45, 13, 3, 30]
    jobs = [(p, SamplingParams(max_new_tokens=n)) for p, n in zip(prompts(ck.tokenizer, 8), lengths)]
    want = [plain.generate(p, q).token_ids for p, q in jobs]
    for p, q in jobs:  # alone
        assert spec.generate(p, q).token_ids == want[jobs.index((p, q))]
    batches = (jobs[:4], jobs[4:], jobs[1:5])
    for batch in batches:  # batched: rows drafting and rows not in the same steps
        assert [r.token_ids for r in together(spec, batch)] == [want[jobs.index(j)] for j in batch]
    drafts, accepted = drafted(spec)
    assert 0 < accepted < drafts  # drafts were verified, some taken and some rejected
    assert spec.stats.generated_tokens_total == sum(map(len, want)) + sum(q.max_new_tokens for b in batches
                                                                        for _, q in b)
    if weights == "fp32":  # and plain decoding is the naive loop's
        assert all(naive(ck, p, q)[0] == w for (p, q), w in zip(jobs, want))


def test_greedy_equals_plain_with_stops_penalties_and_a_sliding_window(make_checkpoint, make_engine) -> None:
    ck = make_checkpoint(block_size=32)
    plain, spec = make_engine(ck, max_batch_size=3), make_engine(ck, max_batch_size=3, **SPEC)
    tok = ck.tokenizer
    cases = [
        SamplingParams(max_new_tokens=80),  # past the window: slides between verified steps
        SamplingParams(max_new_tokens=40, stop=("ca",)),
        SamplingParams(max_new_tokens=40, repetition_penalty=1.3),
        SamplingParams(max_new_tokens=40, presence_penalty=0.5, frequency_penalty=0.3, min_tokens=10),
        SamplingParams(max_new_tokens=40, logit_bias=((0, 2.0),), top_n_tokens=3),
    ]
    for p in prompts(tok, 5, seed=3):
        for params in cases:
            want, got = plain.generate(p, params), spec.generate(p, params)
            assert got.token_ids == want.token_ids
            assert got.text == want.text and got.finished.finish_reason == want.finished.finish_reason
            assert got.finished.window_slides == want.finished.window_slides
            for a, b in zip(got.tokens, want.tokens):  # logprobs and alternatives as plain decoding reports them
                assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
                assert [t.id for t in a.top_tokens] == [t.id for t in b.top_tokens]
    assert drafted(spec)[1] > 0


def test_a_stop_inside_an_accepted_draft_ends_there(make_checkpoint, make_engine) -> None:
    ck = make_checkpoint(block_size=64)
    plain, spec = make_engine(ck), make_engine(ck, **SPEC)
    prompt = ck.tokenizer.encode("abcabcabcab")
    free = plain.generate(prompt, SamplingParams(max_new_tokens=40))
    text = free.text
    stop = text[len(text) // 2: len(text) // 2 + 2]  # a string of the output's middle
    for params in (SamplingParams(max_new_tokens=40, stop=(stop,)), SamplingParams(max_new_tokens=len(text) // 2)):
        want, got = plain.generate(prompt, params), spec.generate(prompt, params)
        assert got.token_ids == want.token_ids and got.text == want.text
        assert got.finished.finish_reason == want.finished.finish_reason
    assert drafted(spec)[1] > 0


def test_rejected_tokens_are_not_kept_by_the_prefix_cache(make_checkpoint, make_engine) -> None:
    """After a speculating request (ended by a stop string, where its last step may verify a draft it rejects), its
    row holds only tokens of its prompt and output; a prompt that continues its text reuses that prefix and decodes
    what an engine without a prefix cache does."""
    ck = make_checkpoint(block_size=64)
    spec, fresh = make_engine(ck, max_batch_size=1, **SPEC), make_engine(ck, max_batch_size=1, prefix_cache=False)
    plain = make_engine(ck, max_batch_size=1)
    for i, p in enumerate(prompts(ck.tokenizer, 12, seed=5)):
        text = plain.generate(p, SamplingParams(max_new_tokens=24)).text
        stop = text[8 + i % 8]
        first = spec.generate(p, SamplingParams(max_new_tokens=24, stop=(stop,)))
        seen = p + first.token_ids
        held = spec.scheduler.batch.contents.tokens[0]
        assert len(held) >= len(seen) - 1 and held == seen[: len(held)], (held, seen)
        again = spec.generate(seen, SamplingParams(max_new_tokens=15))
        assert again.token_ids == fresh.generate(seen, SamplingParams(max_new_tokens=15)).token_ids
    assert spec.stats.cached_prompt_tokens_total > 0
    drafts, accepted = drafted(spec)
    assert 0 < accepted < drafts


def test_requests_that_cannot_or_will_not_speculate_decode_plainly(make_checkpoint, make_engine) -> None:
    ck = make_checkpoint(block_size=64)
    spec = make_engine(ck, **SPEC)
    prompt = ck.tokenizer.encode("abcabcabcab")
    spec.generate(prompt, SamplingParams(max_new_tokens=20, speculate=False))
    assert drafted(spec) == (0, 0)
    watched = spec.generate(prompt, SamplingParams(max_new_tokens=20, attention=AttentionSpec(layers=(0,))))
    assert drafted(spec) == (0, 0) and all(t.attention is not None for t in watched.tokens)  # one token a step
    constraint = ConstraintCompiler().compile(ConstraintSpec.regex("(ab)+c"), ck.tokenizer)
    constrained = spec.generate(prompt, SamplingParams(max_new_tokens=20, constraint=constraint))
    assert drafted(spec) == (0, 0) and re.fullmatch("(ab)*a?b?c?", constrained.text), constrained.text
    spec.generate(prompt, SamplingParams(max_new_tokens=20))
    assert drafted(spec)[0] > 0


def test_the_options_are_checked(make_checkpoint, make_engine) -> None:
    ck = make_checkpoint()
    with pytest.raises(ValueError, match=r"speculative_model must be '\[ngram\]' \(prompt lookup\), a draft model's "
                       r"checkpoint directory or unset, got ' '"):
        make_engine(ck, speculative_model=" ")
    with pytest.raises(ValueError, match="checkpoint directory not found: x"):  # a draft model's directory
        make_engine(ck, speculative_model="x")
    with pytest.raises(ValueError, match=r"num_speculative_tokens must be in \[1, 16\], got 0"):
        make_engine(ck, speculative_model="[ngram]", num_speculative_tokens=0)
    with pytest.raises(ValueError, match="ngram_prompt_lookup_min <= ngram_prompt_lookup_max"):
        make_engine(ck, speculative_model="[ngram]", ngram_prompt_lookup_min=3, ngram_prompt_lookup_max=2)


def test_sampled_text_is_distributed_as_plain_samplings(make_checkpoint, make_engine) -> None:
    """The same prompt sampled with many seeds, with and without speculation: each generated position's tokens
    follow one distribution (a two-sample chi-square test), while drafts were verified, taken and rejected."""
    ck = make_checkpoint(block_size=64)
    plain = make_engine(ck, max_batch_size=2, max_waiting=600)
    spec = make_engine(ck, max_batch_size=2, max_waiting=600, **SPEC)
    prompt = ck.tokenizer.encode("ababababab")  # a prompt whose drafts the random model takes about half the time
    params = SamplingParams(max_new_tokens=4, temperature=0.2, top_k=20)
    jobs = [(prompt, params.with_seed(seed)) for seed in range(600)]
    samples = {name: [r.token_ids for r in together(engine, jobs)] for name, engine in (("plain", plain),
                                                                                          ("spec", spec))}
    drafts, accepted = drafted(spec)
    assert accepted > 150 and drafts - accepted > 50  # drafted tokens were taken and rejected, many times each
    for position in range(4):
        counts = {name: [0] * ck.tokenizer.n_vocab for name in samples}
        for name, outs in samples.items():
            for out in outs:
                counts[name][out[position]] += 1
        ok, detail = same_distribution_ok(counts["plain"], counts["spec"])
        assert ok, f"position {position}: {detail}"


def test_a_seed_gives_plain_samplings_text_alone_or_batched(make_checkpoint, make_engine) -> None:
    """Speculation changes no draw of a seeded request's generator: the same text as without, token for token,
    alone or in a batch (where k differs)."""
    ck = make_checkpoint(block_size=64)
    plain, spec = make_engine(ck, max_batch_size=4), make_engine(ck, max_batch_size=4, **SPEC)
    tok = ck.tokenizer
    for seed in range(6):
        prompt = tok.encode(["ababababab", "abcabcabcab", "the cat sat. the cat"][seed % 3])
        params = SamplingParams(max_new_tokens=30, temperature=0.3 + 0.1 * seed, top_k=30, seed=seed)
        want = plain.generate(prompt, params).token_ids
        assert spec.generate(prompt, params).token_ids == want
        others = [(tok.encode("hello hello"), SamplingParams(max_new_tokens=n, temperature=0.9)) for n in (5, 40)]
        assert together(spec, [others[0], (prompt, params), others[1]])[1].token_ids == want
    assert drafted(spec)[1] > 0
