"""What every API's wire models share: strict request models (`StrictModel`), the server's defaults they fall back
on (`ServerDefaults`), the limits on a request's shape, how an API names the model's fields in its errors (`Api`),
and the TGI-shaped error body of the OpenAPI docs.

Each API family keeps its own wire models beside its routes (`app/api/<family>/protocol.py`); each request converts
itself into the engine's validated `SamplingParams` (`to_sampling_params`, vLLM's shape): the request's value, then
the server's default (`ServerDefaults`, from its settings), then the hard default; errors name the API's own fields
(`Api`: `model/` raises its errors with neutral names, `prompt`, `max_new_tokens`, `text`; a route re-raises them
with its API's, so a client reads the name it sent). Field descriptions become the OpenAPI docs at /docs.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, FailFast, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError
from typing_extensions import TypeAliasType

from model.inspection import InspectError
from model.sampling_params import ValidationError, preview
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



@dataclass(frozen=True)
class Api:
    """How one API names the model's fields (`prompt`, `max_new_tokens`, `text`, ...) in its error messages: the
    one place where the neutral names of `model/` become an API's."""

    renamed: dict[str, str]
    prefix: str = ""  # for the fields not renamed
    truncate_hint: str = ""  # how to fit a prompt longer than the context, if the API has a way

    def field(self, name: str) -> str:
        return self.renamed.get(name, self.prefix + name)

    @contextmanager
    def naming_fields(self) -> Iterator[None]:
        """Re-raise `model/`'s `ValidationError`s and `InspectError`s (of the same type) with this API's field
        names, and the truncation hint on a prompt longer than the model's context."""
        try:
            yield
        except (ValidationError, InspectError) as e:
            field = self.field(e.field)
            hint = self.truncate_hint if field == self.field("prompt") and "context" in e.message else ""
            raise type(e)(field, e.message + hint) from None



class ErrorBody(BaseModel):
    error: str
    error_type: str
    request_id: str | None = Field(None, description="the request's ID, as in the X-Request-Id response header")


def error_docs(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """A route's `responses=` for its OpenAPI docs: each of `statuses` answered with an `ErrorBody`."""
    return {status: {"model": ErrorBody} for status in statuses}


def string_at(value: object, where: str) -> str:
    """`value` if it is a string, else a ValidationError naming `where` (a field inside an untyped part of a body)."""
    if not isinstance(value, str):
        raise ValidationError(where, f"must be a string, got {preview(value)}")
    return value


def refuse_set(request: BaseModel, names: Iterable[str], why: str) -> None:
    """A ValidationError naming the first of `request`'s fields `names` that is set (not None): `why` it may not be,
    and its value."""
    for name in names:
        value = getattr(request, name)
        if value is not None:
            raise ValidationError(name, f"{why}, got {preview(value)}")
