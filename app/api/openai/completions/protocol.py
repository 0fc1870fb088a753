"""OpenAI's completions request (`POST /v1/completions`) and how it names the model's fields in errors (`OPENAI`).
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, ValidatorFunctionWrapHandler, field_validator
from pydantic import ValidationError as PydanticValidationError
from pydantic_core import PydanticCustomError

from app.api.openai.protocol import StreamOptions
from app.api.protocol import (
    MAX_LOGPROBS,
    MAX_N,
    MAX_PROMPTS,
    STOP_DOC,
    Api,
    Prompt,
    ServerDefaults,
    StrictModel,
    Texts,
    TokenIdLists,
    TokenIds,
)
from model.sampling_params import MAX_LOGIT_BIAS, MAX_SEED, SamplingParams, ValidationError, preview
from model.stopping import MAX_STOP_STRINGS

OPENAI = Api({"prompt": "prompt", "max_new_tokens": "max_tokens", "top_n_tokens": "logprobs"})


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
