"""Compiling a `ConstraintSpec` for one tokenizer into a `Constraint` the engine can apply, on llguidance.

- `ll_tokenizer(tokenizer)`: llguidance's view of a Folio tokenizer (GPT-2 BPE through tiktoken's ranks, or a
  character vocabulary), built once per tokenizer (about 0.3 s for GPT-2's) and kept while the tokenizer lives. A
  character vocabulary has no end-of-text token: llguidance gets one past the vocabulary, which the sampler can
  never choose (it masks ids past the tokenizer's), so such a model ends a constrained output when the grammar
  allows nothing more.
- `ConstraintCompiler`: checks a spec against the limits (model/structured/spec.py), turns it into an llguidance
  grammar, builds its matcher under llguidance's own parser limits, and probes that this vocabulary can produce
  some output it accepts. Compiles run in the compiler's own worker threads, never on the caller's: `compile`
  waits at most `timeout_s` (from a worker thread: the HTTP service calls it with `asyncio.to_thread`, or awaits
  `compile_async`) and raises `ConstraintError` with reason `timeout` past it. Results, refusals included, are kept
  in a bounded LRU keyed by tokenizer and spec, so the same spec twice compiles once (two at the same time share
  one compile).
- `compile_constraint` / `compile_constraint_async`: the process's default compiler.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
import weakref
from collections import OrderedDict
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any

import llguidance
from llguidance import LLMatcher, LLParserLimits, LLTokenizer, TokenizerWrapper
from llguidance.tiktoken import lltokenizer_from_encoding

from model.structured.spec import (
    MAX_CHOICES,
    MAX_SCHEMA_DEPTH,
    MAX_SCHEMA_PROPERTIES,
    MAX_SPEC_CHARS,
    ConstraintError,
    ConstraintSpec,
)
from model.tokenizer import BPETokenizer, CharTokenizer, Tokenizer

COMPILE_TIMEOUT_S = 10.0
CACHE_ENTRIES = 256  # compiled specs kept (per compiler, over all tokenizers)
COMPILE_WORKERS = 2
PROBE_STEPS = 64  # forced stretches followed by the producibility probe
# JSON as OpenAI's and llguidance's compact form: "," and ":" without whitespace around them. A small model that
# may put whitespace anywhere can spend its whole budget on it
JSON_OPTIONS: dict[str, Any] = {"whitespace_flexible": False}


def parser_limits() -> LLParserLimits:
    """llguidance's limits on one grammar (its defaults: the lexer's and parser's work per token mask, the grammar's
    size), with errors that do not repeat the grammar and the parser state back."""
    return LLParserLimits(verbose_errors=False)


# -- the tokenizer ------------------------------------------------------------------------------------------------
class _CharVocabulary:
    """What llguidance's TokenizerWrapper reads of a tokenizer, for a character vocabulary: one token per character,
    and an end-of-text token past the vocabulary unless the tokenizer has one."""

    def __init__(self, tok: CharTokenizer) -> None:
        self.tokens = [c.encode("utf-8") for c in tok.chars]
        self.eos_token_id = tok.eos_id
        if self.eos_token_id is None:
            self.eos_token_id = len(self.tokens)
            self.tokens.append(b"<|end|>")
        self.bos_token_id = None
        self.special_token_ids = [self.eos_token_id]
        self.stoi = tok.stoi

    def __call__(self, text: bytes | str) -> list[int]:
        """The ids of the text's characters, up to the first the vocabulary lacks (llguidance tokenises what it
        needs a character at a time from there)."""
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        ids = []
        for c in text:
            if c not in self.stoi:
                break
            ids.append(self.stoi[c])
        return ids


_TOKENIZERS: weakref.WeakKeyDictionary[Any, LLTokenizer] = weakref.WeakKeyDictionary()
_TOKENIZERS_LOCK = threading.Lock()


def ll_tokenizer(tokenizer: Tokenizer) -> LLTokenizer:
    """llguidance's tokenizer for `tokenizer`, built at its first use and kept while `tokenizer` lives."""
    with _TOKENIZERS_LOCK:
        found = _TOKENIZERS.get(tokenizer)
        if found is None:
            if isinstance(tokenizer, BPETokenizer):
                found = lltokenizer_from_encoding(tokenizer.enc, n_vocab=tokenizer.n_vocab, eos_token=tokenizer.eos_id)
            elif isinstance(tokenizer, CharTokenizer):
                found = LLTokenizer(TokenizerWrapper(_CharVocabulary(tokenizer)))
            else:
                raise TypeError(f"no llguidance tokenizer for {type(tokenizer).__name__}")
            _TOKENIZERS[tokenizer] = found
        return found


# -- the compiled constraint --------------------------------------------------------------------------------------
@dataclass(frozen=True, eq=False)
class Constraint:
    """A spec compiled for one tokenizer: what `SamplingParams.constraint` carries. `matcher()` gives a request its
    own matcher, in the start state (a copy of the compiled one: cheap, whatever the grammar's size)."""

    spec: ConstraintSpec
    tokenizer: Tokenizer  # the Folio tokenizer it was compiled for
    ll_tokenizer: LLTokenizer
    grammar: str  # llguidance's grammar text
    _start: LLMatcher = field(repr=False)

    def matcher(self) -> LLMatcher:
        return self._start.deep_copy()


def _fail(spec: ConstraintSpec, reason: str, message: str, *value: object) -> ConstraintError:
    """The refusal of `spec`, showing `value` (if given) cut short."""
    return ConstraintError(spec.kind, reason, message, *value)


def _check_schema(spec: ConstraintSpec, schema: Mapping[str, Any]) -> None:
    """The schema's size: its properties in all, its nesting, enum lists (iterative: a deep schema cannot overflow
    the stack)."""
    properties = 0
    stack: list[tuple[Any, int]] = [(schema, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_SCHEMA_DEPTH:
            raise _fail(spec, "too_large", f"the schema nests deeper than {MAX_SCHEMA_DEPTH} levels")
        if isinstance(node, Mapping):
            props = node.get("properties")
            if isinstance(props, Mapping):
                properties += len(props)
                if properties > MAX_SCHEMA_PROPERTIES:
                    raise _fail(spec, "too_large", f"the schema may have at most {MAX_SCHEMA_PROPERTIES} properties "
                                                   f"in all, got more")
            enum = node.get("enum")
            if isinstance(enum, list) and len(enum) > MAX_CHOICES:
                raise _fail(spec, "too_large", f"an enum may have at most {MAX_CHOICES} values, got {len(enum)}")
            stack.extend((v, depth + 1) for v in node.values())
        elif isinstance(node, list):
            stack.extend((v, depth + 1) for v in node)


def spec_key(spec: ConstraintSpec) -> str:
    """The spec as canonical text (the cache's key), after checking its size; `ConstraintError` for a spec over the
    limits or a value that is not JSON."""
    if spec.kind == "json_schema":
        _check_schema(spec, spec.value)
        try:
            text = json.dumps(spec.value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
        except (TypeError, ValueError) as e:
            raise _fail(spec, "invalid", f"the schema is not JSON ({e})") from None
        text += f"|strict={spec.strict}"
    elif spec.kind == "choice":
        if not spec.value:
            raise _fail(spec, "invalid", "must hold at least one string", list(spec.value))
        if len(spec.value) > MAX_CHOICES:
            raise _fail(spec, "too_large", f"at most {MAX_CHOICES} choices are allowed, got {len(spec.value)}")
        bad = next((c for c in spec.value if not isinstance(c, str)), None)
        if bad is not None:
            raise _fail(spec, "invalid", "choices must be strings", bad)
        text = json.dumps(list(spec.value), ensure_ascii=False)
    else:
        text = spec.value or ""
    if len(text) > MAX_SPEC_CHARS:
        raise _fail(spec, "too_large", f"at most {MAX_SPEC_CHARS:,} characters are allowed, got {len(text):,}")
    return f"{spec.kind}:{text}"


def grammar_of(spec: ConstraintSpec) -> str:
    """llguidance's grammar for `spec` (not checked yet: building the matcher does that)."""
    if spec.kind == "json_schema":
        options = dict(JSON_OPTIONS, lenient=not spec.strict)
        return LLMatcher.grammar_from_json_schema(dict(spec.value), overrides=options)  # type: ignore[arg-type]
    if spec.kind == "json_object":
        return LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=JSON_OPTIONS)  # type: ignore[arg-type]
    if spec.kind == "regex":
        return LLMatcher.grammar_from_regex(spec.value)
    if spec.kind == "choice":
        return llguidance.grammar_from("choice", list(spec.value))  # type: ignore[arg-type]
    return LLMatcher.grammar_from_lark(spec.value)


def _short(error: str) -> str:
    """llguidance's error in one line: its first line and, for a regex, the line saying what is wrong (the others
    draw the pattern and the grammar)."""
    lines = error.strip().splitlines() or ["unknown error"]
    line = re.sub(r"^at \d+\(\d+\): ", "", lines[0])
    line += "".join(" " + x.strip() for x in lines[1:] if x.strip().startswith("error:"))
    return line[:300]


def build(spec: ConstraintSpec, tokenizer: Tokenizer) -> Constraint:
    """Compile `spec` for `tokenizer` here, now (no cache, no time bound: `ConstraintCompiler.compile` adds them).
    `ConstraintError` for a spec over the limits, one llguidance refuses, or one this vocabulary cannot produce."""
    spec_key(spec)
    lltok = ll_tokenizer(tokenizer)
    try:
        grammar = grammar_of(spec)
    except ValueError as e:
        raise _fail(spec, "invalid", _short(str(e))) from None
    matcher = LLMatcher(lltok, grammar, log_level=0, limits=parser_limits())
    if matcher.is_error():
        error = matcher.get_error()
        reason = "too_complex" if "limit" in error.lower() or "too " in error.lower() else "invalid"
        raise _fail(spec, reason, _short(error))
    probe(spec, matcher, lltok)
    return Constraint(spec, tokenizer, lltok, grammar, matcher)


def probe(spec: ConstraintSpec, matcher: LLMatcher, lltok: LLTokenizer) -> None:
    """Refuse (`unproducible`) a constraint this vocabulary cannot produce: from the start, follow what the grammar
    forces (its fast-forward bytes), which the vocabulary must spell; where it forces nothing, some token besides
    end-of-text must be allowed, unless the output so far is complete. This catches a constraint whose every output
    begins with characters the vocabulary lacks (a JSON schema for a vocabulary without braces, a regex `ab\\{`
    without `{`), and one nothing satisfies (a `$ref` that only refers to itself). A vocabulary gap after a real
    choice is found while generating: the request then ends with an error."""
    m = matcher.deep_copy()
    eos = lltok.eos_token
    for _ in range(PROBE_STEPS):
        if m.is_error() or m.is_accepting():
            break
        forced = m.compute_ff_bytes()
        if forced:
            ids = lltok.tokenize_bytes(forced)
            if lltok.decode_bytes(ids) != forced:
                text = forced.decode("utf-8", errors="replace")
                raise _fail(spec, "unproducible", "this model's vocabulary cannot produce any output that satisfies "
                                                  f"it: every output goes on with {text!r}")
            if not m.consume_tokens(ids):
                break
            continue
        mask = bytearray(m.compute_bitmask())
        if 0 <= eos < 8 * len(mask):
            mask[eos // 8] &= ~(1 << (eos % 8)) & 0xFF  # end-of-text alone is no output
        if any(mask):
            return
        break
    if not m.is_error() and m.is_accepting():
        return
    raise _fail(spec, "unproducible", "this model's vocabulary cannot produce any output that satisfies it")


# -- compiling with a cache and a time bound -----------------------------------------------------------------------
class ConstraintCompiler:
    """Compiles specs in its own worker threads, with a bounded LRU of the results (refusals too) and a time bound.
    `compiles` counts the compiles actually run."""

    def __init__(self, *, entries: int = CACHE_ENTRIES, timeout_s: float = COMPILE_TIMEOUT_S,
                 workers: int = COMPILE_WORKERS) -> None:
        self.entries, self.timeout_s = entries, timeout_s
        self.compiles = 0
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="folio-grammar")
        self._lock = threading.Lock()
        # (tokenizer, spec key) -> the compile's future, done or not (a refusal is a future holding its error)
        self._cache: OrderedDict[tuple[int, str], Future[Constraint]] = OrderedDict()
        self._owners: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()

    def submit(self, spec: ConstraintSpec, tokenizer: Tokenizer) -> Future[Constraint]:
        """The compile of `spec` for `tokenizer`: the cached one, the one under way, or a new one. `spec_key` runs
        in the caller's thread (its cost is the spec's size)."""
        key = (id(tokenizer), spec_key(spec))
        with self._lock:
            if self._owners.get(key[0]) is not tokenizer:  # an id reused by another tokenizer: forget the old one's
                for k in [k for k in self._cache if k[0] == key[0]]:
                    del self._cache[k]
                self._owners[key[0]] = tokenizer
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                return future
            self.compiles += 1
            future = self._pool.submit(build, spec, tokenizer)
            self._cache[key] = future
            while len(self._cache) > self.entries:
                self._cache.popitem(last=False)
            return future

    def compile(self, spec: ConstraintSpec, tokenizer: Tokenizer, *, timeout_s: float | None = None) -> Constraint:
        """`spec` compiled for `tokenizer`, waiting at most `timeout_s` (default: the compiler's). Blocking: call it
        from a worker thread, never from an event loop or the engine thread. `ConstraintError` when refused or past
        the time bound (the compile goes on in the background, and its outcome is cached: the same spec again is
        refused or served at once)."""
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        future = self.submit(spec, tokenizer)
        try:
            return future.result(timeout=timeout_s)
        except FutureTimeout:
            raise _fail(spec, "timeout", f"compiling it took longer than {timeout_s:g} s; simplify it") from None

    async def compile_async(self, spec: ConstraintSpec, tokenizer: Tokenizer, *,
                            timeout_s: float | None = None) -> Constraint:
        """`compile` for an event loop: the size checks and the wait run in a worker thread."""
        return await asyncio.to_thread(self.compile, spec, tokenizer, timeout_s=timeout_s)

    def clear(self) -> None:
        with self._lock:
            self._cache.clear()


_DEFAULT: ConstraintCompiler | None = None
_DEFAULT_LOCK = threading.Lock()


def default_compiler() -> ConstraintCompiler:
    global _DEFAULT
    with _DEFAULT_LOCK:
        if _DEFAULT is None:
            _DEFAULT = ConstraintCompiler()
        return _DEFAULT


def compile_constraint(spec: ConstraintSpec, tokenizer: Tokenizer, *, timeout_s: float | None = None) -> Constraint:
    """`ConstraintCompiler.compile` on the process's default compiler (blocking: from a worker thread)."""
    return default_compiler().compile(spec, tokenizer, timeout_s=timeout_s)


async def compile_constraint_async(spec: ConstraintSpec, tokenizer: Tokenizer, *,
                                   timeout_s: float | None = None) -> Constraint:
    """`ConstraintCompiler.compile_async` on the process's default compiler."""
    return await default_compiler().compile_async(spec, tokenizer, timeout_s=timeout_s)
