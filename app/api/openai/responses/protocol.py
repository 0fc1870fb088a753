"""OpenAI's Responses API request (`POST /v1/responses`), stateless: `input` (a string, or items: messages, function
calls and their outputs), `instructions`, `max_output_tokens`, sampling, `text.format` for structured output,
function `tools` with `tool_choice`, `stream`. Nothing is stored, so `store` must not ask for it and
`previous_response_id` cannot be followed: both are refused, naming the field."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from app.api import structured, tools
from app.api.openai.chat.protocol import MAX_TOOLS
from app.api.protocol import Api, ServerDefaults, StrictModel, refuse_set, string_at
from app.api.structured import Requested
from app.api.tools import Function, ToolPlan, read_flat_tools
from model.sampling_params import MAX_SEED, SamplingParams, ValidationError, preview

RESPONSES = Api({"prompt": "input", "max_new_tokens": "max_output_tokens"})
INPUT_ROLES = ("system", "developer", "user", "assistant")
TEXT_PARTS = ("input_text", "output_text", "text")
ITEMS = ("message", "function_call", "function_call_output")  # the input items a conversation may hold


class ResponsesRequest(StrictModel):
    model: str | None = Field(None, description="the model to answer (GET /v1/models); unset: the default")
    input: str | list[dict[str, Any]] = Field(description="a string (one user message) or a list of items: messages "
                                              "{role, content: a string or input_text parts}, function_call, "
                                              "function_call_output")
    instructions: str | None = Field(None, description="a system message before the input")
    max_output_tokens: int | None = Field(None, ge=1, description="tokens to generate at most (server default if "
                                                                  "unset)")
    temperature: float | None = Field(None, ge=0, le=2, description="0: greedy; unset: 1.0")
    top_p: float | None = Field(None, gt=0, le=1)
    seed: int | None = Field(None, ge=0, le=MAX_SEED, description="extension: the sampler's seed")
    text: dict[str, Any] | None = Field(None, description="{format: {type: text | json_object | json_schema, name, "
                                        "schema, strict}}")
    stream: bool = False
    store: bool | None = Field(None, description="must be false or unset: Folio stores no responses")
    previous_response_id: str | None = Field(None, description="not supported: nothing is stored")
    metadata: dict[str, str] | None = None
    user: str | None = None
    tools: list[dict[str, Any]] | None = Field(None, max_length=MAX_TOOLS, description="functions the model may "
                                               "call: {type: function, name, description, parameters, strict}")
    tool_choice: str | dict[str, Any] | None = Field(None, description="none, auto (the default), required, or "
                                                     "{type: function, name}")
    parallel_tool_calls: bool | None = None
    truncation: str | None = Field(None, description="'disabled' (the default) only")
    reasoning: dict[str, Any] | None = Field(None, description="accepted and ignored")
    # what the openai SDK's create takes that means nothing for a local model: accepted and ignored
    include: list[str] | None = Field(None, max_length=16, description="accepted and ignored: there is nothing "
                                      "more to include")
    service_tier: str | None = Field(None, description="accepted and ignored")
    max_tool_calls: int | None = Field(None, ge=1, description="accepted: Folio makes at most one call")
    prompt_cache_key: str | None = Field(None, description="accepted and ignored (prefixes are cached anyway)")
    safety_identifier: str | None = Field(None, description="accepted and ignored")
    stream_options: dict[str, Any] | None = Field(None, description="accepted and ignored")
    # and what it takes that Folio cannot do: refused unless unset (or false)
    background: bool | None = Field(None, description="must be false or unset: nothing runs in the background")
    conversation: str | dict[str, Any] | None = Field(None, description="not supported: nothing is stored")
    prompt: dict[str, Any] | None = Field(None, description="not supported: no prompt templates are stored")
    top_logprobs: int | None = Field(None, ge=0, description="0 or unset: chat completions return logprobs")

    def messages(self) -> list[dict[str, Any]]:
        """The conversation as the chat template takes it, in chat completions' shape: instructions as the system
        turn, then the input's items: messages (`input_text` / `output_text` parts text parts), `function_call`s an
        assistant turn's `tool_calls`, each `function_call_output` a `tool` turn."""
        if self.store:
            raise ValidationError("store", "must be false or unset: Folio keeps no responses (the API is stateless "
                                  "here), got true")
        if self.previous_response_id is not None:
            raise ValidationError("previous_response_id", "cannot be followed: Folio keeps no responses; send the "
                                  "conversation in input")
        refuse_set(self, ("conversation", "prompt"),
                   "is not supported: Folio keeps nothing (send the conversation in input)")
        if self.background:
            raise ValidationError("background", "must be false or unset: Folio answers in the request, got true")
        if self.top_logprobs:
            raise ValidationError("top_logprobs", f"must be 0 or unset: Folio's Responses carry no logprobs (chat "
                                  f"completions do), got {self.top_logprobs}")
        if self.truncation not in (None, "disabled"):
            raise ValidationError("truncation", f"must be 'disabled', got {preview(self.truncation)}")
        out = [{"role": "system", "content": self.instructions}] if self.instructions is not None else []
        if isinstance(self.input, str):
            return [*out, {"role": "user", "content": self.input}]
        if not self.input:
            raise ValidationError("input", "must be a non-empty string or list of messages")
        for i, item in enumerate(self.input):
            kind = item.get("type", "message")
            if kind == "message":
                out.append(_message(item, f"input[{i}]"))
            elif kind == "function_call":
                call = {"id": string_at(item.get("call_id"), f"input[{i}].call_id"), "type": "function",
                        "function": {"name": string_at(item.get("name"), f"input[{i}].name"),
                                     "arguments": string_at(item.get("arguments"), f"input[{i}].arguments")}}
                if out and out[-1]["role"] == "assistant":  # the calls of one answer: one assistant turn
                    out[-1].setdefault("tool_calls", []).append(call)
                else:
                    out.append({"role": "assistant", "content": "", "tool_calls": [call]})
            elif kind == "function_call_output":
                output = item.get("output")
                out.append({"role": "tool", "tool_call_id": string_at(item.get("call_id"), f"input[{i}].call_id"),
                            "content": output if isinstance(output, str) else _parts(output, f"input[{i}].output")})
            else:
                raise ValidationError(f"input[{i}].type", f"must be one of {', '.join(ITEMS)} (only these are "
                                      f"supported), got {preview(kind)}")
        return out

    def offered(self) -> list[Function]:
        """The functions offered, each {type: function, name, description, parameters, strict (default true)}."""
        return read_flat_tools(self.tools, ("function",), "parameters", strict=True, schema_required=False)

    def tool_plan(self) -> ToolPlan | str | None:
        """What the tools ask of the output (app/api/tools.py)."""
        choice = self.tool_choice
        if isinstance(choice, dict):
            if choice.get("type") != "function":
                raise ValidationError("tool_choice.type", f"must be 'function' (or tool_choice one of none, auto, "
                                      f"required), got {preview(choice.get('type'))}")
            return tools.plan(self.offered(), tools.NAMED, choice.get("name"), "tool_choice.name")
        if choice not in (None, tools.NONE, tools.AUTO, tools.REQUIRED):
            raise ValidationError("tool_choice", f"must be one of none, auto, required or {{type: function, name}}, "
                                  f"got {preview(choice)}")
        return tools.plan(self.offered(), choice or tools.AUTO)

    def constraint(self) -> Requested | None:
        return structured.response_format((self.text or {}).get("format"), "text.format", nested=False)

    def to_sampling_params(self, defaults: ServerDefaults) -> SamplingParams:
        max_new_tokens = defaults.max_new_tokens_for(self.max_output_tokens, RESPONSES.field("max_new_tokens"))
        greedy = self.temperature == 0
        with RESPONSES.naming_fields():
            return SamplingParams(max_new_tokens=max_new_tokens, temperature=self.temperature, top_p=self.top_p,
                                  do_sample=not greedy, greedy=greedy, seed=self.seed)


def _message(item: dict[str, Any], where: str) -> dict[str, Any]:
    """A message item as a chat turn: its role (developer a system turn: model/chat_template.py), its text parts."""
    role = item.get("role")
    if role not in INPUT_ROLES:
        raise ValidationError(f"{where}.role", f"must be one of {', '.join(INPUT_ROLES)}, got {preview(role)}")
    content = item.get("content")
    return {"role": role, "content": _parts(content, f"{where}.content") if isinstance(content, list) else content}


def _parts(parts: object, where: str) -> list[dict[str, Any]]:
    """Text parts (input_text, output_text) as the chat template's text parts."""
    if not isinstance(parts, list):
        raise ValidationError(where, f"must be a string or a list of text parts, got {preview(parts)}")
    for j, part in enumerate(parts):
        if not isinstance(part, dict) or part.get("type") not in TEXT_PARTS:
            raise ValidationError(f"{where}[{j}].type", f"must be one of {', '.join(TEXT_PARTS)} (only text is "
                                  f"supported), got {preview(part.get('type') if isinstance(part, dict) else part)}")
    return [{"type": "text", "text": part.get("text")} for part in parts]
