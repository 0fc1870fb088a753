"""OpenAI's completions request (`POST /v1/completions`) and how it names the model's fields in errors (`OPENAI`).
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, ValidatorFunctionWrapHandler, field_validator
from pydantic import ValidationError as PydanticValidationError
from pydantic_core import PydanticCustomError

from app.api.openai.protocol import SamplingRequest
from app.api.protocol import (
    MAX_LOGPROBS,
    MAX_N,
    MAX_PROMPTS,
    Api,
    Prompt,
    ServerDefaults,
    Texts,
    TokenIdLists,
    TokenIds,
)
from model.sampling_params import SamplingParams, ValidationError

DEFAULT_MAX_TOKENS = 16  # OpenAI's completions default, whether max_tokens is absent or null
OPENAI = Api({"prompt": "prompt", "max_new_tokens": "max_tokens", "top_n_tokens": "logprobs"})


class CompletionRequest(SamplingRequest):
    # left to right, token ids before a list of strings: a list of a million ids is not first tried as strings
    prompt: str | TokenIds | Texts | TokenIdLists = Field(
        union_mode="left_to_right",
        description=f"the prompt: a string, a list of token ids, or a list of up to {MAX_PROMPTS} of either "
                    "(a batch: each prompt's choices follow the previous prompt's)")
    max_tokens: int | None = Field(None, ge=0, description=f"tokens to generate at most (absent or null: "
                                   f"{DEFAULT_MAX_TOKENS}, OpenAI's default, within the server's limit); 0 (with echo) "
                                   "scores the prompt only")
    n: int = Field(1, ge=1, le=MAX_N, description="choices per prompt; one prefill shared by all of them")
    best_of: int | None = Field(None, ge=1, le=MAX_N, description="sample this many per prompt and return the n "
                                                                   "with the highest mean logprob (>= n)")
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, description="this many top alternatives per token")
    echo: bool = False
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
        if self.max_tokens == 0 and not self.echo:
            raise ValidationError("max_tokens", "may be 0 only with echo (to score the prompt), got 0")
        max_tokens = min(DEFAULT_MAX_TOKENS, defaults.max_new_tokens_limit) if self.max_tokens is None \
            else self.max_tokens
        max_new_tokens = defaults.max_new_tokens_for(max_tokens, OPENAI.field("max_new_tokens"))
        # echo with logprobs scores the prompt too; max_tokens 0 needs the prompt's scores whatever logprobs is
        prompt_logprobs = (self.logprobs or 0) if self.echo and (self.logprobs is not None or not max_new_tokens) \
            else None
        return self.sampling_params(OPENAI, max_new_tokens, self.logprobs or 0, prompt_logprobs=prompt_logprobs)
