"""What OpenAI's endpoints share on the wire: the sampling fields of completions and chat completions (with
vLLM's extensions) and their one conversion to `SamplingParams`, `stream_options`, the error body, and usage."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field, ValidatorFunctionWrapHandler, field_validator
from pydantic_core import PydanticCustomError

from app.api import structured
from app.api.protocol import MAX_N, STOP_DOC, Api, StrictModel
from app.api.structured import Requested
from model.engine import Finished
from model.sampling_params import MAX_LOGIT_BIAS, MAX_SEED, SamplingParams, ValidationError, preview
from model.stopping import CONSTRAINT_DONE, MAX_STOP_STRINGS


class StreamOptions(StrictModel):
    include_usage: bool = False



class OpenAIErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None = Field(description="OpenAI's code where it has one for the error (context_length_exceeded, "
                             "model_not_found, invalid_api_key, rate_limit_exceeded), else null")


class OpenAIError(BaseModel):
    error: OpenAIErrorDetail
    request_id: str | None = Field(None, description="the request's ID, as in the X-Request-Id response header")


class SamplingRequest(StrictModel):
    """The fields OpenAI's completions and chat completions share, validated and converted in one place."""

    model: str | None = Field(None, description="the model to answer (GET /v1/models); unset: the default")
    temperature: float | None = Field(None, ge=0, le=2, description="0: greedy; unset: 1.0 (sampling)")
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0, description="extension (vLLM): keep the k most likely tokens")
    min_p: float | None = Field(None, ge=0, le=1, description="extension (vLLM): drop tokens less likely than "
                                                               "min_p times the most likely one")
    repetition_penalty: float | None = Field(None, gt=0, le=100, description="extension (vLLM)")
    n: int = Field(1, ge=1, le=MAX_N, description="choices; one prefill shared by all of them")
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = Field(None, description=STOP_DOC)
    seed: int | None = Field(None, ge=0, le=MAX_SEED, description="choice i samples with seed + i")
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    logit_bias: dict[str, float] | None = Field(None, max_length=MAX_LOGIT_BIAS,
                                                description="token id (as a string) -> bias in [-100, 100]")
    min_tokens: int = Field(0, ge=0, description="extension (vLLM): neither EOS nor a stop ends generation sooner")
    ignore_eos: bool = Field(False, description="extension (vLLM): keep generating past EOS")
    speculate: bool = Field(True, description="extension (Folio): false decodes this request one token a step where"
                            " the server speculates (--speculative-model); the output is distributed alike either way")
    user: str | None = None
    response_format: dict[str, Any] | None = Field(None, description="{type: text | json_object | json_schema "
                                                   "(json_schema: {name, schema, strict})}: the output follows it")
    structured_outputs: dict[str, Any] | None = Field(None, description="extension (vLLM): one of {json, regex, "
                                                      "choice, grammar, json_object}: the output follows it")

    @field_validator("stop", mode="wrap")
    @classmethod
    def _few_stops(cls, value: Any, handler: ValidatorFunctionWrapHandler) -> str | list[str] | None:
        # the count of stop strings is checked before its items
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

    def constraint(self) -> Requested | None:
        """The output constraint asked for: by response_format or by structured_outputs, not both."""
        return structured.one_of(structured.response_format(self.response_format),
                                 structured.structured_outputs(self.structured_outputs))

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def sampling_params(self, api: Api, max_new_tokens: int, top_n_tokens: int, **extra: Any) -> SamplingParams:
        """The engine's parameters: these fields, with the endpoint's own (its token budget, alternatives per
        token, and `extra`); errors name `api`'s fields."""
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        greedy = self.temperature == 0
        bias = {}
        for key, value in (self.logit_bias or {}).items():
            if not (key.isascii() and key.isdigit()) or len(key) > 10:  # "²" and "１" are digits int() refuses or reads
                raise ValidationError("logit_bias", f"keys must be token ids as strings, got {preview(key)}")
            bias[int(key)] = value
        with api.naming_fields():
            return SamplingParams(
                max_new_tokens=max_new_tokens, temperature=self.temperature, top_k=self.top_k, top_p=self.top_p,
                min_p=self.min_p, do_sample=not greedy,  # OpenAI samples at temperature 1 unless told otherwise
                greedy=greedy, repetition_penalty=self.repetition_penalty, seed=self.seed, stop=tuple(stop),
                top_n_tokens=top_n_tokens, presence_penalty=self.presence_penalty,
                frequency_penalty=self.frequency_penalty, logit_bias=tuple(bias.items()),
                min_tokens=self.min_tokens, stop_at_eos=not self.ignore_eos, speculate=self.speculate, **extra,
            )


# the engine's finish reasons -> OpenAI's (and vLLM's metrics'): a done constraint ("stop") is a stop too
FINISH_REASONS = {"length": "length", "eos_token": "stop", "stop_sequence": "stop", CONSTRAINT_DONE: "stop"}


def finish_reason(fin: Finished) -> str:
    return FINISH_REASONS.get(fin.finish_reason, "length")  # max_tokens 0: the prompt is scored, nothing generated


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


ERRORS = {code: {"model": OpenAIError} for code in (400, 401, 404, 413, 424, 429, 503)}  # the routes' OpenAPI docs
