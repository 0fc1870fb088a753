"""What a request may constrain its output to, before anything is compiled: `ConstraintSpec` (one of a JSON schema,
any JSON object, a regular expression, a choice of strings, a Lark grammar), the limits a spec must keep, and
`ConstraintError`, the `ValidationError` every refusal of a spec raises.

The spec is neutral: each HTTP API (OpenAI's `response_format`, vLLM's `structured_outputs`, TGI's
`parameters.grammar`) converts its own shape into one. Making a spec checks only what costs nothing (the kind and
the type of the value); everything proportional to its size (the limits below, the compile) is
`model.structured.compiler`'s, off the event loop and off the engine thread.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from model.sampling_params import ValidationError, preview

Kind = Literal["json_schema", "json_object", "regex", "choice", "grammar"]
KINDS: tuple[str, ...] = ("json_schema", "json_object", "regex", "choice", "grammar")

# OpenAI's documented limits on a structured-output schema: 5,000 object properties in all, 1,000 enum values (here:
# choices), 120,000 characters of names and values; the same bound here on the text of a regex or grammar
MAX_SCHEMA_PROPERTIES = 5_000
MAX_CHOICES = 1_000
MAX_SPEC_CHARS = 120_000
MAX_SCHEMA_DEPTH = 64  # nesting of the schema's JSON itself (not of the output: a $ref may recurse)


_NO_VALUE = object()


class ConstraintError(ValidationError):
    """A constraint refused before anything is generated. `field` names the spec's kind (`json_schema`, `regex`,
    ...; the HTTP layer puts its own path in front), `reason` says why in one word, `preview` shows the value cut
    short, and the message says what is wrong and, where it can, how to fix it.

    Reasons: `invalid` (not a schema, a regex that does not compile, a grammar that does not parse), `too_large`
    (over a limit of this module), `too_complex` (over llguidance's limits), `timeout` (the compile took longer
    than its time bound), `unproducible` (no output this model's vocabulary can spell satisfies it)."""

    REASONS = ("invalid", "too_large", "too_complex", "timeout", "unproducible")

    def __init__(self, field: str, reason: str, message: str, value: object = _NO_VALUE) -> None:
        self.reason = reason
        self.preview = "" if value is _NO_VALUE else preview(value)
        super().__init__(field, message + (f"; got {self.preview}" if self.preview else ""))


@dataclass(frozen=True, eq=False)
class ConstraintSpec:
    """One request's output constraint, not compiled. `value`: the schema (a dict) for `json_schema`, nothing for
    `json_object`, the pattern for `regex`, the strings for `choice`, the Lark text (llguidance's dialect) for
    `grammar`. `strict` (json_schema only, OpenAI's flag): a keyword llguidance does not implement is refused;
    without it, ignored."""

    kind: str
    value: Any = None
    strict: bool = True

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ConstraintError("kind", "invalid", f"must be one of {', '.join(KINDS)}", self.kind)
        ok = {
            "json_schema": isinstance(self.value, Mapping),
            "json_object": self.value is None,
            "regex": isinstance(self.value, str),
            "choice": isinstance(self.value, Sequence) and not isinstance(self.value, str | bytes),
            "grammar": isinstance(self.value, str),
        }[self.kind]
        if not ok:
            want = {"json_schema": "a JSON object (the schema)", "json_object": "no value", "regex": "a string",
                    "choice": "a list of strings", "grammar": "a string (a Lark grammar)"}[self.kind]
            raise ConstraintError(self.kind, "invalid", f"must be {want}", self.value)
        if self.kind == "choice":
            object.__setattr__(self, "value", tuple(self.value))
        if not isinstance(self.strict, bool):
            raise ConstraintError("strict", "invalid", "must be true or false", self.strict)

    @classmethod
    def json_schema(cls, schema: Mapping[str, Any], *, strict: bool = True) -> ConstraintSpec:
        return cls("json_schema", schema, strict)

    @classmethod
    def json_object(cls) -> ConstraintSpec:
        return cls("json_object")

    @classmethod
    def regex(cls, pattern: str) -> ConstraintSpec:
        return cls("regex", pattern)

    @classmethod
    def choice(cls, options: Sequence[str]) -> ConstraintSpec:
        return cls("choice", options)

    @classmethod
    def grammar(cls, lark: str) -> ConstraintSpec:
        return cls("grammar", lark)
