"""HTTP request and response models: Hugging Face TGI's schema and OpenAI's completions.

These are the wire types. Each API's request converts itself into the engine's validated `SamplingParams`
(`to_sampling_params`, vLLM's shape): the request's value, then the server's default (`ServerDefaults`, from its
settings), then the hard default; errors name the API's own fields. Field descriptions become the OpenAPI docs
at /docs.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    FailFast,
    Field,
    ValidatorFunctionWrapHandler,
    field_validator,
    model_validator,
)
from pydantic import ValidationError as PydanticValidationError
from pydantic_core import PydanticCustomError
from typing_extensions import TypeAliasType

from app.fields import OPENAI, TGI
from model.sampling_params import MAX_LOGIT_BIAS, MAX_SEED, AttentionSpec, SamplingParams, ValidationError, preview
from model.stopping import MAX_STOP_CHARS, MAX_STOP_STRINGS

STOP_DOC = (f"stop strings, at most {MAX_STOP_STRINGS} of at most {MAX_STOP_CHARS} characters each; generation "
            "ends where one appears and the text stops before it")
MAX_N = 16  # samples of one prompt (`n`, `best_of`)
MAX_PROMPTS = 32  # prompts in one request
MAX_SEQUENCES = 64  # prompts x max(n, best_of): the most rows one request may take (--max-sequences-per-request)
MAX_LOGPROBS = 20  # alternatives per token (OpenAI's own limit for chat; vLLM's default)
MAX_UNKNOWN_SHOWN = 3  # unknown keys named in the error of an object with too many
Prompt = str | list[int]  # text, or token ids
# a list of a million items with a bad one is one error, not a million (aliases: a Union of Annotated types with
# their unhashable FailFast cannot be formed on Python 3.11)
TokenIds = TypeAliasType("TokenIds", Annotated[list[int], FailFast()])
Texts = TypeAliasType("Texts", Annotated[list[str], FailFast()])
TokenIdLists = TypeAliasType("TokenIdLists", Annotated[list[TokenIds], FailFast()])
_SURROGATE = re.compile("[\ud800-\udfff]")


def _lone_surrogate(value: Any) -> tuple[str, str] | None:
    """(where, character) of the first lone surrogate in a string, or in the strings of a list or dict."""
    if isinstance(value, str):
        if value.isascii():  # O(1) in CPython: the common case costs nothing
            return None
        m = _SURROGATE.search(value)
        return (f"character {m.start()}", m.group()) if m else None
    if isinstance(value, list) and value and isinstance(value[0], int | float | bool):
        return None  # a validated list is of one type (token ids, layers): no string in it
    if isinstance(value, list | dict):
        for key, item in value.items() if isinstance(value, dict) else enumerate(value):
            found = _lone_surrogate(key) or _lone_surrogate(item)
            if found:
                return f"{found[0]} of item {preview(key)}", found[1]
    return None


@dataclass(frozen=True)
class ServerDefaults:
    """What the server fills in where a request leaves a value unset (`--max-new-tokens-default`), and its limits
    (`--max-new-tokens-limit`; `--max-sequences-per-request`: the engine's batch rows one request may take)."""

    max_new_tokens: int
    max_new_tokens_limit: int
    max_sequences: int = MAX_SEQUENCES

    def check_sequences(self, field: str, what: str, total: int, shown: str) -> None:
        """A request's `total` sequences (`what` and `shown` say how they add up) within the server's share of its
        batch for one request: else 422 on `field`, naming the limit and the value."""
        if total > self.max_sequences:
            raise ValidationError(field, f"{what} must be at most {self.max_sequences} (the server's "
                                         f"--max-sequences-per-request: the batch rows one request may take), got "
                                         f"{shown}")

    def max_new_tokens_for(self, value: int | None, field: str) -> int:
        limit = self.max_new_tokens_limit
        value = value if value is not None else min(self.max_new_tokens, limit)
        if value > limit:
            raise ValidationError(field, f"must be an integer in [1, {limit}], got {preview(value)}")
        return value


class StrictModel(BaseModel):
    """Request models: unknown fields, NaN and infinities are refused, and so are values of another JSON type
    ("4" or 4.0 for an integer, 1 or "yes" for a boolean), as TGI's and OpenAI's own servers refuse them. Every
    string must be valid Unicode: JSON's `\\ud800` escape gives Python a lone surrogate, which no UTF-8 text (a
    tokenizer's input, a response echoing the prompt) can hold.

    The work a bad body costs is bounded by its shape, not its size: an object with more keys than the model has
    fields is one error (150,000 unknown keys were 150,000 errors, ~2 s of work), a list is checked for its length
    before its items and stops at its first bad item (`FailFast`)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)

    @model_validator(mode="before")
    @classmethod
    def _few_fields(cls, data: Any) -> Any:
        if isinstance(data, dict) and len(data) > len(cls.model_fields):
            unknown = list(itertools.islice((k for k in data if k not in cls.model_fields), MAX_UNKNOWN_SHOWN))
            raise PydanticCustomError(
                "too_many_fields", "has {count} fields, more than the {known} it may hold ({names}); unknown fields "
                "include {unknown}", {"count": len(data), "known": len(cls.model_fields),
                                      "names": ", ".join(cls.model_fields), "unknown": preview(unknown)})
        return data

    @field_validator("*", mode="after")
    @classmethod
    def _valid_unicode(cls, value: Any) -> Any:
        found = _lone_surrogate(value)
        if found:
            where, char = found
            raise PydanticCustomError(
                "invalid_unicode",
                "must be valid Unicode text, but holds the lone surrogate {char} at {where} (a \\uD800-\\uDFFF "
                "escape in JSON must be one half of a pair)",
                {"char": preview(char), "where": where},
            )
        return value


class AttentionRequest(StrictModel):
    """Folio: the attention weights each generated token was chosen with, sent with the token."""

    layers: list[int] | None = Field(None, max_length=256, description="layers, 0-based; unset: all")
    heads: list[int] | None = Field(None, max_length=256, description="heads, 0-based; unset: per layer, the mean "
                                    "over its heads")

    def to_spec(self) -> AttentionSpec:
        return AttentionSpec(layers=None if self.layers is None else tuple(self.layers),
                             heads=None if self.heads is None else tuple(self.heads))


class GenerateParameters(StrictModel):
    max_new_tokens: int | None = Field(None, ge=1, description="tokens to generate at most (server default if unset)")
    temperature: float | None = Field(None, ge=0, le=100, description="0 means greedy; unset means 1.0")
    top_k: int | None = Field(None, ge=0, description="keep the k most likely tokens; 0 or unset: off")
    top_p: float | None = Field(None, gt=0, le=1, description="nucleus sampling mass; 1.0 or unset: off")
    do_sample: bool = Field(False, description="sample; without it and without sampling controls: greedy")
    greedy: bool = Field(False, description="Folio: force argmax decoding whatever else is set")
    repetition_penalty: float | None = Field(None, gt=0, le=100, description="CTRL penalty; 1.0 or unset: off")
    seed: int | None = Field(None, ge=0, le=MAX_SEED, description="random seed; drawn and reported if unset")
    stop: list[str] = Field(default_factory=list, max_length=MAX_STOP_STRINGS, description=STOP_DOC)
    return_full_text: bool | None = Field(False, description="prepend the prompt to generated_text")
    details: bool = Field(False, description="return finish reason, seed, tokens and logprobs")
    decoder_input_details: bool = Field(False, description="return the prompt's tokens with their logprobs in "
                                                          "details.prefill (the first has none)")
    top_n_tokens: int | None = Field(None, ge=0, le=20, description="alternatives with logprobs per token")
    truncate: int | None = Field(None, ge=1, description="keep only the last N prompt tokens")
    best_of: int | None = Field(None, ge=1, le=MAX_N, description="sample this many and return the one of highest "
                                "mean logprob, the others in details.best_of_sequences (needs sampling; "
                                "not with streaming)")
    frequency_penalty: float | None = Field(None, ge=-2, le=2, description="subtracted once per time a token was "
                                                                          "generated")
    attention: AttentionRequest | None = Field(None, description="Folio: each token's attention weights, in its "
                                               "stream event (/generate: in details, which it needs)")
    # accepted for TGI client compatibility; only their 'off' values are supported
    typical_p: float | None = Field(None, description="not supported (must be unset)")
    watermark: bool = Field(False, description="not supported (must be false)")
    grammar: None = Field(None, description="not supported (must be unset)")
    adapter_id: None = Field(None, description="not supported (must be unset)")


    def to_sampling_params(self, defaults: ServerDefaults) -> SamplingParams:
        unsupported = {"typical_p": self.typical_p not in (None, 1.0), "watermark": self.watermark}
        for name, bad in unsupported.items():
            if bad:
                raise ValidationError(TGI.field(name), f"is not supported by Folio, got {preview(getattr(self, name))}")
        max_new_tokens = defaults.max_new_tokens_for(self.max_new_tokens, TGI.field("max_new_tokens"))
        with TGI.naming_fields():
            return SamplingParams(
                max_new_tokens=max_new_tokens, temperature=self.temperature, top_k=self.top_k, top_p=self.top_p,
                do_sample=self.do_sample, greedy=self.greedy, repetition_penalty=self.repetition_penalty,
                seed=self.seed, stop=tuple(self.stop), top_n_tokens=self.top_n_tokens or 0,
                frequency_penalty=self.frequency_penalty or 0.0,
                prompt_logprobs=0 if self.details and self.decoder_input_details else None,
                attention=None if self.attention is None else self.attention.to_spec(),
            )

    def samples(self, params: SamplingParams, stream: bool, defaults: ServerDefaults) -> int:
        """Sequences to generate: `best_of` (TGI's rules: it needs sampling, and a stream carries one; at most the
        server's share for one request, TGI's `max_best_of`)."""
        best_of = self.best_of or 1
        if best_of > 1 and params.is_greedy:
            raise ValidationError(TGI.field("best_of"), f"greater than 1 needs sampling (do_sample, or temperature, "
                                                        f"top_k or top_p), got {best_of}")
        if best_of > 1 and stream:
            raise ValidationError(TGI.field("best_of"), f"must be 1 when streaming, got {best_of}")
        if self.attention is not None and not stream and not self.details:
            raise ValidationError(TGI.field("attention"), "a whole answer carries the attention in its details: set "
                                                          "parameters.details, or stream (/generate_stream)")
        if self.attention is not None and best_of > 1:
            raise ValidationError(TGI.field("attention"), f"is for one sequence: not with best_of, got {best_of}")
        defaults.check_sequences(TGI.field("best_of"), "best_of", best_of, str(best_of))
        return best_of


class GenerateRequest(StrictModel):
    inputs: str = Field(description="the prompt")
    parameters: GenerateParameters = Field(default_factory=GenerateParameters)
    stream: bool = Field(False, description="POST / only: stream server-sent events")


class Token(BaseModel):
    id: int
    text: str
    logprob: float | None = None
    special: bool = False


class PrefillToken(BaseModel):
    id: int
    text: str
    logprob: float | None = None


class TokenAttention(BaseModel):
    """Folio: the attention a generated token was chosen with: that of the token before it, over the tokens before
    it (within the context window)."""

    start: int = Field(description="the index, among the prompt's and the generated tokens, of the token each "
                                   "row's first weight is for")
    layers: list[int]
    heads: list[int] | None = Field(None, description="absent: each row is the mean over its layer's heads")
    weights: list[list[float]] = Field(description="a row per layer and head (layers outer), over the tokens from "
                                                   "`start` to the one before this token; 6 decimals")


class SequenceDetails(BaseModel):
    """What TGI's details say of one generated sequence."""

    finish_reason: Literal["length", "eos_token", "stop_sequence"]
    generated_tokens: int
    seed: int | None = Field(None, description="the seed a sampled sequence used; absent for greedy decoding, which "
                             "samples nothing")
    prefill: list[PrefillToken] = Field(default_factory=list)
    tokens: list[Token] = Field(default_factory=list)
    top_tokens: list[list[Token]] = Field(default_factory=list)


class BestOfSequence(SequenceDetails):
    generated_text: str


class Details(SequenceDetails):
    best_of_sequences: list[BestOfSequence] | None = None
    window_slides: int = Field(0, description="Folio: how often the context window slid")
    truncated_prompt_tokens: int = Field(0, description="Folio: prompt tokens that parameters.truncate left out")
    attention: list[TokenAttention] | None = Field(None, description="Folio: with parameters.attention, each "
                                                   "token's")


class GenerateResponse(BaseModel):
    generated_text: str
    details: Details | None = None


class StreamDetails(BaseModel):
    finish_reason: Literal["length", "eos_token", "stop_sequence"]
    generated_tokens: int
    seed: int | None
    input_length: int
    truncated_prompt_tokens: int = Field(0, description="Folio: prompt tokens that parameters.truncate left out")


class StreamResponse(BaseModel):
    index: int
    token: Token
    top_tokens: list[Token] = Field(default_factory=list)
    generated_text: str | None = None
    details: StreamDetails | None = None
    attention: TokenAttention | None = Field(None, description="Folio: with parameters.attention")


class ErrorBody(BaseModel):
    error: str
    error_type: str
    request_id: str | None = Field(None, description="the request's ID, as in the X-Request-Id response header")


def error_docs(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """A route's `responses=` for its OpenAPI docs: each of `statuses` answered with an `ErrorBody`."""
    return {status: {"model": ErrorBody} for status in statuses}


# -- OpenAI ---------------------------------------------------------------------------------------------


class StreamOptions(StrictModel):
    include_usage: bool = False


class CompletionRequest(StrictModel):
    model: str | None = Field(None, description="ignored beyond a check that it names this model, if given")
    # left to right, token ids before a list of strings: a list of a million ids is not first tried as strings
    prompt: str | TokenIds | Texts | TokenIdLists = Field(
        union_mode="left_to_right",
        description=f"the prompt: a string, a list of token ids, or a list of up to {MAX_PROMPTS} of either "
                    "(a batch: each prompt's choices follow the previous prompt's)")
    max_tokens: int | None = Field(16, ge=0, description="tokens to generate at most; 0 (with echo) scores the "
                                                         "prompt only")
    temperature: float | None = Field(None, ge=0, le=2, description="0: greedy; unset: 1.0 (sampling)")
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0, description="extension (vLLM): keep the k most likely tokens")
    min_p: float | None = Field(None, ge=0, le=1, description="extension (vLLM): drop tokens less likely than "
                                                               "min_p times the most likely one")
    repetition_penalty: float | None = Field(None, gt=0, le=100, description="extension (vLLM)")
    n: int = Field(1, ge=1, le=MAX_N, description="choices per prompt; one prefill shared by all of them")
    best_of: int | None = Field(None, ge=1, le=MAX_N, description="sample this many per prompt and return the n "
                                                                   "with the highest mean logprob (>= n)")
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, description="this many top alternatives per token")
    echo: bool = False
    stop: str | list[str] | None = Field(None, description=STOP_DOC)
    seed: int | None = Field(None, ge=0, le=MAX_SEED, description="choice i of a prompt samples with seed + i")
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    logit_bias: dict[str, float] | None = Field(None, max_length=MAX_LOGIT_BIAS,
                                                description="token id (as a string) -> bias in [-100, 100]")
    min_tokens: int = Field(0, ge=0, description="extension (vLLM): neither EOS nor a stop ends generation sooner")
    ignore_eos: bool = Field(False, description="extension (vLLM): keep generating past EOS")
    user: str | None = None
    suffix: None = None

    @field_validator("prompt", mode="wrap")
    @classmethod
    def _few_prompts(cls, value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        # before the items are validated: a list of a million prompts is one error, not a million
        if isinstance(value, list) and value and isinstance(value[0], str | list) and len(value) > MAX_PROMPTS:
            raise PydanticCustomError("too_many_prompts", "must be a batch of at most {max}", {"max": MAX_PROMPTS})
        if value == []:
            raise PydanticCustomError("empty_prompt", "must not be an empty list", {})
        try:
            return handler(value)
        except PydanticValidationError as e:  # one error, not one per member of the union
            unicode = next((err for err in e.errors() if err["type"] == "invalid_unicode"), None)
            if unicode is not None:
                raise PydanticCustomError("invalid_unicode", "{msg}", {"msg": unicode["msg"]}) from None
            raise PydanticCustomError("prompt_type", "must be a string, a list of token ids, or a list of up to "
                                      "{max} of either", {"max": MAX_PROMPTS}) from None

    def prompts(self) -> list[Prompt]:
        """The request's prompts, each a string or a list of token ids."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]  # type: ignore[list-item]
        return list(p)  # type: ignore[arg-type]

    @field_validator("stop", mode="wrap")
    @classmethod
    def _few_stops(cls, value: Any, handler: ValidatorFunctionWrapHandler) -> str | list[str] | None:
        # the same for stop: its count is checked before its items
        if isinstance(value, list) and len(value) > MAX_STOP_STRINGS:
            raise PydanticCustomError("too_many_stops", "must hold at most {max} stop strings",
                                      {"max": MAX_STOP_STRINGS})
        return handler(value)

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _few_biases(cls, value: Any) -> Any:
        # and logit_bias': a dict's max_length is checked after each of its items
        if isinstance(value, dict) and len(value) > MAX_LOGIT_BIAS:
            raise PydanticCustomError("too_long", "must hold at most {max} entries", {"max": MAX_LOGIT_BIAS})
        return value

    def samples(self, defaults: ServerDefaults) -> int:
        """Sequences generated per prompt: best_of (which must not be below n) or n; with the prompts, at most the
        server's share for one request."""
        best_of = self.best_of if self.best_of is not None else self.n
        if best_of < self.n:
            raise ValidationError("best_of", f"must be at least n ({self.n}), got {best_of}")
        if best_of > 1 and self.stream and best_of != self.n:
            raise ValidationError("best_of", f"must equal n ({self.n}) when streaming, got {best_of}")
        prompts = len(self.prompts())
        field = "best_of" if self.best_of is not None and self.best_of > self.n else "n"
        defaults.check_sequences(field, "prompts x max(n, best_of)", prompts * best_of,
                                 f"{prompts} x {best_of} = {prompts * best_of}")
        return best_of

    def to_sampling_params(self, defaults: ServerDefaults) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        greedy = self.temperature == 0
        if self.max_tokens == 0 and not self.echo:
            raise ValidationError("max_tokens", "may be 0 only with echo (to score the prompt), got 0")
        max_new_tokens = defaults.max_new_tokens_for(self.max_tokens, OPENAI.field("max_new_tokens"))
        bias = {}
        for key, value in (self.logit_bias or {}).items():
            if not key.isdigit() or len(key) > 10:
                raise ValidationError("logit_bias", f"keys must be token ids as strings, got {preview(key)}")
            bias[int(key)] = value
        # echo with logprobs scores the prompt too; max_tokens 0 needs the prompt's scores whatever logprobs is
        prompt_logprobs = (self.logprobs or 0) if self.echo and (self.logprobs is not None or not max_new_tokens) \
            else None
        with OPENAI.naming_fields():
            return SamplingParams(
                max_new_tokens=max_new_tokens, temperature=self.temperature, top_k=self.top_k, top_p=self.top_p,
                min_p=self.min_p, do_sample=not greedy,  # OpenAI samples at temperature 1 unless told otherwise
                greedy=greedy, repetition_penalty=self.repetition_penalty, seed=self.seed, stop=tuple(stop),
                top_n_tokens=self.logprobs or 0, presence_penalty=self.presence_penalty,
                frequency_penalty=self.frequency_penalty, logit_bias=tuple(bias.items()),
                min_tokens=self.min_tokens, stop_at_eos=not self.ignore_eos,
                prompt_logprobs=prompt_logprobs,
            )


class OpenAIErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: int | str | None


class OpenAIError(BaseModel):
    error: OpenAIErrorDetail
    request_id: str | None = Field(None, description="the request's ID, as in the X-Request-Id response header")
