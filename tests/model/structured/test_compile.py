"""Compiling constraints (model/structured/compiler.py): the cache (the same spec twice compiles once), the
tokenizer built once per tokenizer, and every refusal made before anything is generated, each a `ConstraintError`
naming the spec's kind, with a reason and a short preview: invalid schemas, regexes and grammars, specs over the
limits, pathological schemas, the time bound, and specs the vocabulary cannot produce."""

from __future__ import annotations

import json
import threading

import pytest

from model.sampling_params import ValidationError
from model.structured import (
    MAX_SCHEMA_PROPERTIES,
    MAX_SPEC_CHARS,
    ConstraintCompiler,
    ConstraintError,
    ConstraintSpec,
    ll_tokenizer,
)
from model.structured import compiler as compiler_module

PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"]}


def refusal(compiler: ConstraintCompiler, spec: ConstraintSpec, tokenizer) -> ConstraintError:
    with pytest.raises(ConstraintError) as caught:
        compiler.compile(spec, tokenizer)
    return caught.value


def test_the_same_spec_twice_compiles_once(compiler, gpt2_tok) -> None:
    first = compiler.compile(ConstraintSpec.json_schema(PERSON), gpt2_tok)
    # an equal schema, written in another key order, is the same spec
    again = compiler.compile(ConstraintSpec.json_schema(json.loads(json.dumps(PERSON, sort_keys=True))), gpt2_tok)
    assert again is first and compiler.compiles == 1
    assert compiler.compile(ConstraintSpec.json_schema(PERSON, strict=False), gpt2_tok) is not first
    assert compiler.compile(ConstraintSpec.regex("[0-9]+"), gpt2_tok) is not first
    assert compiler.compiles == 3


def test_concurrent_compiles_of_one_spec_share_one(compiler, gpt2_tok) -> None:
    results = []
    threads = [threading.Thread(target=lambda: results.append(compiler.compile(ConstraintSpec.choice(["a", "b"]),
                                                                                 gpt2_tok))) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 8 and len({id(r) for r in results}) == 1
    assert compiler.compiles == 1


def test_the_cache_is_a_bounded_lru(gpt2_tok) -> None:
    compiler = ConstraintCompiler(entries=2)
    specs = [ConstraintSpec.regex(p) for p in ("a+", "b+", "c+")]
    for spec in specs:
        compiler.compile(spec, gpt2_tok)
    compiler.compile(specs[2], gpt2_tok)  # kept
    assert compiler.compiles == 3
    compiler.compile(specs[0], gpt2_tok)  # evicted: compiled again
    assert compiler.compiles == 4


def test_refusals_are_cached_too(compiler, gpt2_tok) -> None:
    for _ in range(2):
        assert refusal(compiler, ConstraintSpec.regex("("), gpt2_tok).reason == "invalid"
    assert compiler.compiles == 1


def test_the_llguidance_tokenizer_is_built_once_per_tokenizer(gpt2_tok, bundled_char_tokenizer) -> None:
    assert ll_tokenizer(gpt2_tok) is ll_tokenizer(gpt2_tok)
    assert ll_tokenizer(gpt2_tok).vocab_size == gpt2_tok.n_vocab == 50257
    assert ll_tokenizer(gpt2_tok).eos_token == gpt2_tok.eos_id
    char = ll_tokenizer(bundled_char_tokenizer)
    assert char is ll_tokenizer(bundled_char_tokenizer)
    # one token per character, and an end-of-text token past them (the sampler never chooses it)
    assert char.vocab_size == bundled_char_tokenizer.n_vocab + 1 == 66
    assert char.decode_str(bundled_char_tokenizer.encode("Romeo, hark!")) == "Romeo, hark!"


def test_a_json_schema_for_a_vocabulary_without_braces_is_refused(compiler, bundled_char_tokenizer) -> None:
    assert "{" not in bundled_char_tokenizer.chars
    for spec in (ConstraintSpec.json_schema(PERSON), ConstraintSpec.json_object()):
        err = refusal(compiler, spec, bundled_char_tokenizer)
        assert isinstance(err, ValidationError) and isinstance(err, ValueError)
        assert (err.field, err.reason) == (spec.kind, "unproducible")
        assert "vocabulary cannot produce" in str(err) and "'{" in str(err)
    # what it can spell compiles
    assert compiler.compile(ConstraintSpec.regex("[A-Z][a-z]{2,8}!"), bundled_char_tokenizer)
    assert compiler.compile(ConstraintSpec.choice(["ay", "nay"]), bundled_char_tokenizer)


def test_a_forced_character_the_vocabulary_lacks_is_refused(compiler, bundled_char_tokenizer) -> None:
    err = refusal(compiler, ConstraintSpec.regex(r"ab\{c"), bundled_char_tokenizer)
    assert err.reason == "unproducible" and "'ab{c'" in str(err)
    err = refusal(compiler, ConstraintSpec.choice(["[yes]", "[no]"]), bundled_char_tokenizer)
    assert err.reason == "unproducible"


@pytest.mark.parametrize(("spec", "field", "says"), [
    (ConstraintSpec.json_schema({"type": "wobbly"}), "json_schema", "wobbly"),
    (ConstraintSpec.json_schema({"type": "string", "format": "no-such-format"}), "json_schema", "no-such-format"),
    (ConstraintSpec.regex("("), "regex", "unclosed group"),
    (ConstraintSpec.regex("a{2,1}"), "regex", "invalid repetition count"),
    (ConstraintSpec.grammar("start: missing_rule"), "grammar", "missing_rule"),
    (ConstraintSpec.grammar("start: (("), "grammar", ""),
    (ConstraintSpec.choice([]), "choice", "at least one"),
    (ConstraintSpec.choice(["a", 1]), "choice", "strings"),
])
def test_invalid_specs_are_refused_naming_the_field(compiler, gpt2_tok, spec, field, says) -> None:
    err = refusal(compiler, spec, gpt2_tok)
    assert (err.field, err.reason) == (field, "invalid")
    assert says in err.message and "\n" not in err.message


def test_strict_false_ignores_keywords_llguidance_does_not_implement(compiler, gpt2_tok) -> None:
    schema = {"type": "string", "format": "no-such-format"}
    assert compiler.compile(ConstraintSpec.json_schema(schema, strict=False), gpt2_tok)


@pytest.mark.parametrize(("kind", "value"), [("json_schema", "not a dict"), ("regex", 3), ("choice", "abc"),
                                             ("grammar", None), ("json_object", {}), ("xml", "x")])
def test_a_spec_of_the_wrong_shape_is_refused_when_made(kind, value) -> None:
    with pytest.raises(ConstraintError) as caught:
        ConstraintSpec(kind, value)
    assert caught.value.field == ("kind" if kind == "xml" else kind) and caught.value.preview


def test_pathological_schemas_are_refused(compiler, gpt2_tok) -> None:
    many = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(10_000)}}
    err = refusal(compiler, ConstraintSpec.json_schema(many), gpt2_tok)
    assert err.reason == "too_large" and str(MAX_SCHEMA_PROPERTIES) in err.message
    # a $ref that only refers to itself (directly or round a cycle) describes no output at all
    for defs in ({"a": {"$ref": "#/$defs/a"}}, {"a": {"$ref": "#/$defs/b"}, "b": {"anyOf": [{"$ref": "#/$defs/a"}]}}):
        err = refusal(compiler, ConstraintSpec.json_schema({"$ref": "#/$defs/a", "$defs": defs}), gpt2_tok)
        assert err.reason == "unproducible", err
    deep: dict = {"type": "string"}
    for _ in range(200):
        deep = {"type": "object", "properties": {"x": deep}}
    assert refusal(compiler, ConstraintSpec.json_schema(deep), gpt2_tok).reason == "too_large"
    assert refusal(compiler, ConstraintSpec.regex("a" * (MAX_SPEC_CHARS + 1)), gpt2_tok).reason == "too_large"
    # a recursive schema that does describe outputs (a tree) is fine
    tree = {"$ref": "#/$defs/node", "$defs": {"node": {"type": "object", "properties": {
        "children": {"type": "array", "items": {"$ref": "#/$defs/node"}}}}}}
    assert compiler.compile(ConstraintSpec.json_schema(tree), gpt2_tok)


def test_a_compile_past_its_time_bound_is_refused_and_its_outcome_kept(compiler, gpt2_tok, monkeypatch) -> None:
    release = threading.Event()
    real_build = compiler_module.build

    def slow_build(spec, tokenizer):
        release.wait(30)
        return real_build(spec, tokenizer)

    monkeypatch.setattr(compiler_module, "build", slow_build)
    spec = ConstraintSpec.regex("[a-z]+")
    err = refusal(ConstraintCompiler(timeout_s=0.05), spec, gpt2_tok)  # another compiler: this one stays untouched
    assert (err.field, err.reason) == ("regex", "timeout") and "0.05 s" in err.message
    with pytest.raises(ConstraintError, match="longer than"):
        compiler.compile(spec, gpt2_tok, timeout_s=0.01)
    release.set()
    assert compiler.compile(spec, gpt2_tok, timeout_s=30)  # the compile went on, and is kept
    assert compiler.compiles == 1
