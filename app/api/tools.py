"""Tool calls, whichever API offers the tools: chat completions' `tools` ({type: function, function: {name,
parameters}}), Anthropic Messages' ({name, input_schema}) and Responses' ({type: function, name, parameters}). Each
API reads its own shapes into `Function`s and its tool choice into a mode; from there one plan decides the output:

- none (or no tools): text, as without tools;
- auto: text; the model hears of the tools only through its chat template, so where the template never reads them
  the request is refused (`check_auto`): that model could never call one;
- required (Anthropic's `any`): one call of any of the functions, generated as the object `{name, arguments}` under
  the schema that allows exactly those (`anyOf` of each function's name and parameters);
- a named function: one call of it, its arguments generated under its parameters' schema.

A call is whole when its constraint is done; one cut short by the token budget is answered as what there is of it,
with the budget's reason (as OpenAI and Anthropic answer one). Every API writes the call in its own shape
(`tool_calls`, a `tool_use` block, a `function_call` item) from `ToolPlan.call`. Templates see the tools as chat
completions sends them (`Function.for_template`), the shape Hugging Face's chat templates read."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import pydantic_core

from app.api.structured import Requested, one_of
from model.engine import Finished
from model.sampling_params import ValidationError, preview
from model.stopping import CONSTRAINT_DONE
from model.structured import ConstraintSpec

if TYPE_CHECKING:
    from app.serving.service import GenerationService

NONE, AUTO, REQUIRED, NAMED = "none", "auto", "required", "named"
ANY_OBJECT = {"type": "object"}  # a function declared without parameters


@dataclass(frozen=True)
class Function:
    """A function a request offers, and the request field of its parameters' schema (its errors' name)."""

    name: str
    parameters: dict[str, Any]
    field: str
    description: str | None = None
    strict: bool = False

    def for_template(self) -> dict[str, Any]:
        function: dict[str, Any] = {"name": self.name, "parameters": self.parameters}
        if self.description is not None:
            function["description"] = self.description
        return {"type": "function", "function": function}

    def requested(self) -> Requested:
        return Requested(ConstraintSpec.json_schema(self.parameters, strict=self.strict), self.field)


def read_function(where: str, name: object, parameters: object, parameters_field: str, description: object,
                  strict: object, taken: set[str]) -> Function:
    """One offered function checked: a name used once, parameters a JSON schema object (absent: any object), a
    string description; errors name `where`'s fields."""
    if not isinstance(name, str) or not name or name in taken:
        raise ValidationError(f"{where}.name", f"must be a function name used once, got {preview(name)}")
    if parameters is None:
        parameters = ANY_OBJECT
    if not isinstance(parameters, dict):
        raise ValidationError(parameters_field, f"must be a JSON schema (an object), got {preview(parameters)}")
    if description is not None and not isinstance(description, str):
        raise ValidationError(f"{where}.description", f"must be a string, got {preview(description)}")
    if not isinstance(strict, bool):
        raise ValidationError(f"{where}.strict", f"must be true or false, got {preview(strict)}")
    taken.add(name)
    return Function(name, parameters, parameters_field, description, strict)


def read_flat_tools(tools: list[dict[str, Any]] | None, types: tuple[str | None, ...], schema_key: str,
                    strict: bool, schema_required: bool) -> list[Function]:
    """Tools given flat, `{type, name, description, <schema_key>, strict}` (Messages', Responses'): each of one of
    `types` (None: unset), else it is a hosted tool, which Folio does not run; `strict` unset means `strict`."""
    allowed = " or ".join("unset" if t is None else repr(t) for t in types)
    taken: set[str] = set()
    out = []
    for i, tool in enumerate(tools or ()):
        where = f"tools[{i}]"
        if tool.get("type") not in types:
            raise ValidationError(f"{where}.type", f"must be {allowed}: Folio runs functions only, no hosted tools "
                                  f"(web search, code execution ...), got {preview(tool.get('type'))}")
        if schema_required and schema_key not in tool:
            raise ValidationError(f"{where}.{schema_key}", "is required: the JSON schema of the tool's input")
        out.append(read_function(where, tool.get("name"), tool.get(schema_key), f"{where}.{schema_key}",
                                 tool.get("description"), tool.get("strict", strict), taken))
    return out


@dataclass(frozen=True)
class Call:
    """A tool call in an output: the function's name and its arguments (JSON text), `whole` or cut short (by the
    token budget or a stop string: its arguments end where the output ended)."""

    name: str
    arguments: str
    whole: bool

    def input(self) -> dict[str, Any]:
        """The arguments as an object: a cut call's as much of them as is whole (strings cut short kept as far as
        they go, as the anthropic SDK reads a streamed tool input), {} before the first of them."""
        if self.whole:
            return json.loads(self.arguments)
        try:
            value = pydantic_core.from_json(self.arguments, allow_partial="trailing-strings")
        except ValueError:
            return {}
        return value if isinstance(value, dict) else {}


# a call of `tool_choice: required` cut short after its function's name: {"name": "...", "arguments": <cut>
CUT_CALL = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*(.*)', re.DOTALL)


@dataclass(frozen=True)
class ToolPlan:
    """A request's output as one tool call: its constraint, and the function's name when it is fixed (a named
    function; None under `required`, where the output names it)."""

    requested: Requested
    name: str | None

    def call(self, text: str, fin: Finished) -> Call | None:
        """The call in an output under the plan: whole when its constraint is done, else what the output holds of it
        (as OpenAI and Anthropic answer a call that max_tokens cut: its arguments cut short), or None if it ended
        before the function's name (under `required`, where the output names it)."""
        whole = fin.finish_reason == CONSTRAINT_DONE
        if self.name is not None:
            return Call(self.name, text, whole)
        if whole:
            call = json.loads(text)
            return Call(call["name"], json.dumps(call["arguments"]), True)
        cut = CUT_CALL.fullmatch(text)
        return Call(json.loads(cut[1]), cut[2], False) if cut else None


def plan(functions: list[Function], mode: str, name: object = None, name_field: str = "") -> ToolPlan | str | None:
    """What the tools ask of the output (the module's doc): a `ToolPlan`, `AUTO`, or None (text, no tools)."""
    if not functions or mode == NONE:
        return None
    if mode == AUTO:
        return AUTO
    if mode == REQUIRED:
        options = [{"type": "object", "properties": {"name": {"const": f.name}, "arguments": f.parameters},
                    "required": ["name", "arguments"], "additionalProperties": False} for f in functions]
        schema = options[0] if len(options) == 1 else {"anyOf": options}
        return ToolPlan(Requested(ConstraintSpec.json_schema(schema, strict=False), "tools"), None)
    by_name = {f.name: f for f in functions}
    if not isinstance(name, str) or name not in by_name:
        raise ValidationError(name_field, f"must name one of the tools ({preview(list(by_name))}), got "
                                          f"{preview(name)}")
    return ToolPlan(by_name[name].requested(), name)


async def check_auto(service: GenerationService, functions: list[Function], field: str) -> None:
    """tool choice auto: the model is told of the tools only through its chat template; one that never reads them
    cannot call any, refused at `field` saying so. Each function's schema is still checked (compiled, cached): an
    invalid one is refused naming it, as it would be when the call is required."""
    template = service.registry.chat_template(service.checkpoint)
    if not template.reads_tools:
        raise ValidationError(field, f"'auto' needs a chat template that tells the model of its tools; this "
                                     f"model's ({template.source}) has none: require a call or name a function, "
                                     f"which generate the call under its schema")
    for function in functions:
        await service.compile(Requested(ConstraintSpec.json_schema(function.parameters, strict=False),
                                        function.field))


class OffersTools(Protocol):
    """A request that may offer tools: its API's reading of them, and its other output constraint."""

    tools: list[dict[str, Any]] | None

    def offered(self) -> list[Function]: ...

    def tool_plan(self) -> ToolPlan | str | None: ...

    def constraint(self) -> Requested | None: ...


def template_tools(body: OffersTools) -> list[dict[str, Any]] | None:
    """The request's tools as the chat template reads them (chat completions' shape)."""
    return [f.for_template() for f in body.offered()] if body.tools is not None else None


async def output_plan(service: GenerationService, body: OffersTools) -> tuple[ToolPlan | None, Requested | None]:
    """The call the output must be (None: text; auto checked by `check_auto`), and the request's one constraint:
    the call's, or its structured-output field's (both at once is refused)."""
    plan = body.tool_plan()
    if plan == AUTO:
        await check_auto(service, body.offered(), "tool_choice")
    call = plan if isinstance(plan, ToolPlan) else None
    return call, one_of(call.requested if call else None, body.constraint())
