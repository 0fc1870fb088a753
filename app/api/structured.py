"""The output constraints each API can ask for, read into one neutral `ConstraintSpec` (model/structured/): OpenAI's
`response_format` (`json_object`, `json_schema` with `strict`), vLLM's `structured_outputs` (`json`, `regex`,
`choice`, `grammar`, `json_object`), TGI's `parameters.grammar` (`{"type": "json" | "regex", "value"}`), the
Responses API's `text.format` and Anthropic's `output_config.format`. Only the shape is checked here, on the
event loop (it is cheap); compiling (and refusing what the model's vocabulary cannot produce) is the service's,
off it. Errors name the field as the client sent it."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from model.sampling_params import ValidationError, preview
from model.structured import ConstraintSpec

VLLM_KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(frozen=True)
class Requested:
    """A constraint a request asked for, and the field it came from (its errors' name)."""

    spec: ConstraintSpec
    field: str


def _schema(value: Any, field: str) -> Mapping[str, Any]:
    """A JSON schema given as an object, or as a string holding one (vLLM's `json` accepts both)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise ValidationError(field, f"must be a JSON schema, an object or a string of JSON: {e}") from None
    if not isinstance(value, Mapping):
        raise ValidationError(field, f"must be a JSON schema (an object), got {preview(value)}")
    return value


def json_schema_format(value: Mapping[str, Any], field: str, nested: bool = True) -> Requested:
    """OpenAI's `{type: json_schema, json_schema: {name, schema, strict}}` (chat), or with `nested` False the
    Responses API's and Anthropic's flat `{type: json_schema, name, schema, strict}`."""
    inner = value.get("json_schema") if nested else value
    where = f"{field}.json_schema" if nested else field
    if not isinstance(inner, Mapping):
        raise ValidationError(where, f"must be an object with the schema, got {preview(inner)}")
    schema = _schema(inner.get("schema", {}), f"{where}.schema")
    return Requested(ConstraintSpec.json_schema(schema, strict=bool(inner.get("strict"))), f"{where}.schema")


# the keys of each format, by its type and whether a json_schema nests its schema (chat's response_format) or not
# (the Responses API's text.format, Anthropic's output_config.format); json_object's `value` is TGI's schema
FORMAT_KEYS = {
    **{("text", nested): {"type"} for nested in (True, False)},
    **{("json_object", nested): {"type", "value"} for nested in (True, False)},
    ("json_schema", True): {"type", "json_schema"},
    ("json_schema", False): {"type", "name", "schema", "strict", "description"},
}


def response_format(value: Mapping[str, Any] | None, field: str = "response_format",
                    nested: bool = True) -> Requested | None:
    """OpenAI's response_format (or text.format, output_config.format; TGI's json_object with a `value` schema,
    as huggingface_hub sends it): None for plain text."""
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise ValidationError(field, f"must be an object with a type ('text', 'json_object' or 'json_schema'), got "
                              f"{preview(value)}")
    kind = value.get("type")
    keys = FORMAT_KEYS.get((kind, nested)) if isinstance(kind, str) else None
    if keys is None:
        raise ValidationError(f"{field}.type", f"must be one of 'text', 'json_object', 'json_schema', got "
                              f"{preview(kind)}")
    unknown = sorted(str(k) for k in value if k not in keys)
    if unknown:  # a key this format does not have is not silently dropped (TGI's schema in `value` was)
        raise ValidationError(f"{field}.{unknown[0]}", f"is not a field of a {kind!r} format (it takes "
                              f"{', '.join(sorted(keys))})")
    if kind == "text":
        return None
    if kind == "json_schema":
        return json_schema_format(value, field, nested)
    if "value" in value:  # TGI's {type: json_object, value: schema}, which huggingface_hub's chat_completion sends
        where = f"{field}.value"
        return Requested(ConstraintSpec.json_schema(_schema(value["value"], where), strict=False), where)
    return Requested(ConstraintSpec.json_object(), field)


def structured_outputs(value: Mapping[str, Any] | None) -> Requested | None:
    """vLLM's structured_outputs: exactly one of json, regex, choice, grammar, json_object."""
    if value is None:
        return None
    # json_object: false asks for nothing; any other kind given is checked (json: false is no schema)
    given = [k for k in VLLM_KINDS if value.get(k) is not None and not (k == "json_object" and value[k] is False)]
    unknown = [k for k in value if k not in VLLM_KINDS]
    if unknown or len(given) != 1:
        raise ValidationError("structured_outputs", f"must hold exactly one of {', '.join(VLLM_KINDS)}, got "
                              f"{preview(sorted(value))}")
    kind, field = given[0], f"structured_outputs.{given[0]}"
    item = value[kind]
    if kind == "json":
        return Requested(ConstraintSpec.json_schema(_schema(item, field), strict=False), field)
    if kind == "json_object":
        return Requested(ConstraintSpec.json_object(), field)
    if kind == "choice":
        if not isinstance(item, list) or not item or not all(isinstance(c, str) for c in item):
            raise ValidationError(field, f"must be a non-empty list of strings, got {preview(item)}")
        return Requested(ConstraintSpec.choice(item), field)
    if not isinstance(item, str):
        raise ValidationError(field, f"must be a string, got {preview(item)}")
    return Requested(ConstraintSpec.regex(item) if kind == "regex" else ConstraintSpec.grammar(item), field)


def one_of(*requested: Requested | None) -> Requested | None:
    """The one constraint of a request; two ways of asking at once is a 422 naming both."""
    given = [r for r in requested if r is not None]
    if len(given) > 1:
        first, second = (r.field.split(".")[0] for r in given[:2])
        raise ValidationError(second, f"and {first} both constrain the output: give one")
    return given[0] if given else None


def tgi_grammar(value: Mapping[str, Any] | None) -> Requested | None:
    """TGI's parameters.grammar: {"type": "json", "value": schema} or {"type": "regex", "value": pattern}."""
    if value is None:
        return None
    kind, item = value.get("type"), value.get("value")
    field = "parameters.grammar.value"
    if kind == "json":
        return Requested(ConstraintSpec.json_schema(_schema(item, field), strict=False), field)
    if kind == "regex":
        if not isinstance(item, str):
            raise ValidationError(field, f"must be a regular expression (a string), got {preview(item)}")
        return Requested(ConstraintSpec.regex(item), field)
    raise ValidationError("parameters.grammar.type", f"must be 'json' or 'regex', got {preview(kind)}")
