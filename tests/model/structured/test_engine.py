"""Constrained generation in the engine: outputs sampled at temperature 1 from random weights satisfy their
constraint (JSON schemas validated with `jsonschema`, regexes matched whole, choices, Lark grammars), constrained
and unconstrained rows share a batch without changing the unconstrained one's tokens, max_new_tokens still bounds a
constrained output, and a pathological schema is refused off the engine thread while its requests go on."""

from __future__ import annotations

import asyncio
import json
import re
import threading

import jsonschema
import pytest

from model.engine import Engine
from model.engine.events import Result
from model.sampling_params import SamplingParams, ValidationError
from model.stopping import CONSTRAINT_DONE
from model.structured import ConstraintCompiler, ConstraintError, ConstraintSpec
from model.testing import ENGINE_CHARS, tiny_checkpoint

SEEDS = range(6)
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
        "member": {"type": "boolean"},
        "score": {"type": "number", "minimum": -10, "maximum": 10},
    },
    "required": ["name", "age", "tags", "member"],
    "additionalProperties": False,
}


@pytest.fixture
def engine(bpe_checkpoint) -> Engine:
    engine = Engine(bpe_checkpoint, device="cpu", threads=1, max_batch_size=8).start()
    yield engine
    engine.stop(timeout=10)


def sampled(constraint, seed: int, max_new_tokens: int = 120, **kw) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new_tokens, temperature=1.0, do_sample=True, seed=seed,
                          constraint=constraint, **kw)


def together(engine: Engine, jobs: list[tuple[list[int], SamplingParams]]) -> list[Result]:
    async def main() -> list[Result]:
        streams = [engine.submit(prompt, params) for prompt, params in jobs]
        return await asyncio.gather(*(s.collect() for s in streams))
    return asyncio.run(asyncio.wait_for(main(), 120))


def test_json_schema_outputs_parse_and_validate(engine, compiler) -> None:
    tok = engine.tokenizer
    constraint = compiler.compile(ConstraintSpec.json_schema(PERSON), tok)
    texts = set()
    for seed in SEEDS:
        result = engine.generate(tok.encode("Tell me about someone:"), sampled(constraint, seed))
        text = result.finished.generated_text
        assert result.finished.finish_reason == CONSTRAINT_DONE, text
        jsonschema.validate(json.loads(text), PERSON)
        texts.add(text)
    assert len(texts) == len(SEEDS)  # really sampled: a different object per seed


def test_without_the_constraint_the_same_requests_are_not_json(engine, compiler) -> None:
    """The check above means something: these seeds' unconstrained outputs are not JSON objects."""
    tok = engine.tokenizer
    for seed in SEEDS:
        text = engine.generate(tok.encode("Tell me about someone:"), sampled(None, seed, 30)).finished.generated_text
        with pytest.raises(ValueError):
            assert isinstance(json.loads(text), dict)
            raise ValueError


def test_json_object_outputs_are_objects(engine, compiler) -> None:
    """Any JSON object: a random model writes endless strings, so a bias towards the tokens that close them ('"',
    '}') lets some outputs end within max_new_tokens; those parse as objects, the others are cut by the length."""
    tok = engine.tokenizer
    constraint = compiler.compile(ConstraintSpec.json_object(), tok)
    bias = {tok.enc.encode_single_token(t): 15.0 for t in ('"', "}")}
    ended = []
    for seed in SEEDS:
        result = engine.generate(tok.encode("{}"), sampled(constraint, seed, 60, logit_bias=bias))
        text = result.finished.generated_text
        assert text.startswith("{")
        if result.finished.finish_reason == CONSTRAINT_DONE:
            assert isinstance(json.loads(text), dict)
            ended.append(text)
        else:
            assert result.finished.finish_reason == "length"
    assert len(set(ended)) >= 2


def test_regex_outputs_match_whole(engine, compiler) -> None:
    tok = engine.tokenizer
    pattern = r"[A-Z][a-z]{1,6} [0-9]{3}-[0-9]{4}( ext\. [0-9]{1,3})?"
    constraint = compiler.compile(ConstraintSpec.regex(pattern), tok)
    texts = set()
    for seed in SEEDS:
        result = engine.generate(tok.encode("Phone:"), sampled(constraint, seed))
        text = result.finished.generated_text
        assert re.fullmatch(pattern, text), text
        # a match that may go on (the extension) ends when the model chooses EOS; a complete one by the grammar
        assert result.finished.finish_reason in (CONSTRAINT_DONE, "eos_token")
        texts.add(text)
    assert len(texts) > 1


def test_choice_outputs_are_one_of_the_choices(engine, compiler) -> None:
    tok = engine.tokenizer
    choices = ["north", "south", "east", "west", "nowhere at all"]
    constraint = compiler.compile(ConstraintSpec.choice(choices), tok)
    seen = set()
    for seed in range(12):
        result = engine.generate(tok.encode("Which way?"), sampled(constraint, seed))
        assert result.finished.generated_text in choices
        seen.add(result.finished.generated_text)
    assert len(seen) > 1
    greedy = engine.generate(tok.encode("Which way?"), SamplingParams(max_new_tokens=20, constraint=constraint))
    assert greedy.finished.generated_text in choices and greedy.finished.finish_reason == CONSTRAINT_DONE


def test_lark_grammar_outputs_follow_the_grammar(engine, compiler) -> None:
    tok = engine.tokenizer
    grammar = '\n'.join([
        'start: greeting ", " name "! " sum',
        'greeting: "hello" | "good day" | "hi"',
        'name: /[A-Z][a-z]{1,8}/',
        'sum: NUMBER (" + " NUMBER){0,3} " = ?"',
        'NUMBER: /[0-9]{1,3}/',
    ])
    shape = r"(hello|good day|hi), [A-Z][a-z]{1,8}! [0-9]{1,3}( \+ [0-9]{1,3}){0,3} = \?"
    constraint = compiler.compile(ConstraintSpec.grammar(grammar), tok)
    for seed in SEEDS:
        result = engine.generate(tok.encode("Say:"), sampled(constraint, seed))
        assert re.fullmatch(shape, result.finished.generated_text), result.finished.generated_text
        assert result.finished.finish_reason == CONSTRAINT_DONE


def test_max_new_tokens_still_bounds_a_constrained_output(engine, compiler) -> None:
    tok = engine.tokenizer
    constraint = compiler.compile(ConstraintSpec.json_schema(PERSON), tok)
    result = engine.generate(tok.encode("x"), sampled(constraint, 0, 4))
    assert result.finished.finish_reason == "length" and len(result.tokens) == 4
    assert result.finished.generated_text.startswith('{"name":"')


def test_constrained_and_unconstrained_rows_share_a_batch(engine, compiler) -> None:
    """Each row of a batch mixing constrained and unconstrained requests gets the tokens it gets alone, and the
    constrained ones complete valid objects (a schema without PERSON's unbounded number, whose digits a random
    model may draw on past any max_new_tokens)."""
    tok = engine.tokenizer
    bounded = {**PERSON, "properties": {k: v for k, v in PERSON["properties"].items() if k != "score"}}
    constraint = compiler.compile(ConstraintSpec.json_schema(bounded), tok)
    plain = [(tok.encode("Once upon a time"), sampled(None, 7, 40)),
             (tok.encode("The weather"), SamplingParams(max_new_tokens=40)),  # greedy
             (tok.encode("A list:"), sampled(None, 8, 40, top_k=50, repetition_penalty=1.3))]
    structured = [(tok.encode("Someone:"), sampled(constraint, seed)) for seed in (1, 2)]
    structured.append((tok.encode("Someone:"), SamplingParams(max_new_tokens=120, constraint=constraint)))
    alone = [engine.generate(prompt, params) for prompt, params in structured + plain]
    mixed = [job for pair in zip(structured, plain) for job in pair]  # constrained, plain, constrained, ...
    results = together(engine, mixed)
    for result in results[0::2]:
        assert result.finished.finish_reason == CONSTRAINT_DONE, result.finished.generated_text
        jsonschema.validate(json.loads(result.finished.generated_text), bounded)
    for want, got in zip(alone, results[0::2] + results[1::2]):
        assert got.token_ids == want.token_ids
        assert [t.logprob for t in got.tokens] == pytest.approx([t.logprob for t in want.tokens], abs=1e-5)


def test_logprobs_are_the_models_own(engine, compiler) -> None:
    """The reported log-probability of a constrained token is the model's, not renormalised over the mask: the same
    as an unconstrained greedy request's for the same first token."""
    tok = engine.tokenizer
    prompt = tok.encode("Pick:")
    free = engine.generate(prompt, SamplingParams(max_new_tokens=1, top_n_tokens=2))
    first, second = free.tokens[0].top_tokens
    only_second = compiler.compile(ConstraintSpec.choice([second.text]), tok)
    forced = engine.generate(prompt, SamplingParams(max_new_tokens=1, top_n_tokens=2, constraint=only_second))
    assert forced.token_ids == [second.id]
    assert forced.tokens[0].logprob == pytest.approx(second.logprob, abs=1e-5)
    assert forced.tokens[0].top_tokens[0].id == first.id  # alternatives too


def test_a_constraint_compiled_for_another_tokenizer_is_refused(engine, compiler) -> None:
    other = tiny_checkpoint()
    constraint = compiler.compile(ConstraintSpec.regex("[a-z]+"), other.tokenizer)
    with pytest.raises(ValidationError) as caught:
        engine.generate(engine.tokenizer.encode("x"), SamplingParams(constraint=constraint))
    assert caught.value.field == "constraint" and "another model's tokenizer" in caught.value.message


def test_a_character_model_generates_under_a_regex(compiler) -> None:
    """A character vocabulary (padded past its 65 characters, no EOS): outputs match, and end on the grammar."""
    ck = tiny_checkpoint(block_size=64)
    engine = Engine(ck, device="cpu", threads=1, max_batch_size=4).start()
    try:
        pattern = "[a-z]{2,5}( [a-z]{2,5}){1,3}[.!?]"
        constraint = compiler.compile(ConstraintSpec.regex(pattern), ck.tokenizer)
        for seed in SEEDS:
            result = engine.generate(ck.tokenizer.encode("ab"), sampled(constraint, seed, 60))
            assert re.fullmatch(pattern, result.finished.generated_text), result.finished.generated_text
            assert result.finished.finish_reason == CONSTRAINT_DONE
            assert all(t < len(ENGINE_CHARS) for t in result.token_ids)
    finally:
        engine.stop(timeout=10)


@pytest.mark.parametrize("spec", [ConstraintSpec.regex(""), ConstraintSpec.choice([""])], ids=["regex", "choice"])
def test_a_constraint_only_the_empty_output_satisfies_ends_without_a_token(compiler, spec: ConstraintSpec) -> None:
    """On a vocabulary without EOS nothing may be generated: the request ends at once, its constraint done, with no
    token (not an error), beside a request that generates as it would alone."""
    ck = tiny_checkpoint(block_size=64)
    engine = Engine(ck, device="cpu", threads=1, max_batch_size=4).start()
    try:
        prompt, free = ck.tokenizer.encode("ab"), SamplingParams(max_new_tokens=12, stop_at_eos=False)
        empty, other = together(engine, [(prompt, sampled(compiler.compile(spec, ck.tokenizer), 1)), (prompt, free)])
        assert empty.token_ids == [] and empty.finished.generated_text == ""
        assert empty.finished.finish_reason == CONSTRAINT_DONE and empty.finished.generated_tokens == 0
        assert other.token_ids == engine.generate(prompt, free).token_ids
    finally:
        engine.stop(timeout=10)


def test_a_pathological_schema_is_refused_while_other_requests_go_on(engine, gpt2_tok) -> None:
    """Compiles run in the compiler's threads: the engine thread never waits for one, and a running request gets
    all its tokens while pathological schemas are refused."""
    compiler = ConstraintCompiler()
    tok = engine.tokenizer
    built_on: list[str] = []
    refusals: list[ConstraintError] = []
    pathological = [
        {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(10_000)}},
        {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}},
    ]

    def compile_all() -> None:
        for schema in pathological:
            try:
                compiler.compile(ConstraintSpec.json_schema(schema), tok)
            except ConstraintError as e:
                refusals.append(e)
        built_on.append(threading.current_thread().name)

    async def main() -> Result:
        stream = engine.submit(tok.encode("Meanwhile"), SamplingParams(max_new_tokens=60))
        worker = asyncio.create_task(asyncio.to_thread(compile_all))
        result = await stream.collect()
        await worker
        return result

    result = asyncio.run(asyncio.wait_for(main(), 120))
    assert result.finished.finish_reason == "length" and len(result.tokens) == 60
    assert [e.reason for e in refusals] == ["too_large", "unproducible"]
    assert built_on and built_on[0] != "folio-engine"
