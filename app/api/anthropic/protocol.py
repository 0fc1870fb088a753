"""Anthropic's Messages API on the wire (`POST /v1/messages`, `POST /v1/messages/count_tokens`): the request, its
conversion to a conversation the chat template renders and to `SamplingParams`, and how it names the model's
fields in errors (`MESSAGES`)."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, Field

from app.api import structured, tools
from app.api.openai.chat.protocol import MAX_MESSAGES, MAX_TOOLS
from app.api.protocol import STOP_DOC, Api, ServerDefaults, StrictModel, string_at
from app.api.structured import Requested
from app.api.tools import Function, ToolPlan, read_flat_tools
from model.sampling_params import SamplingParams, ValidationError, preview
from model.stopping import MAX_STOP_STRINGS

MESSAGES = Api({"prompt": "messages", "max_new_tokens": "max_tokens", "stop": "stop_sequences"})
ROLES = ("user", "assistant")  # the system prompt is its own field
STOP_REASONS = {"length": "max_tokens", "eos_token": "end_turn", "stop_sequence": "stop_sequence", "stop": "end_turn"}
TOOL_CHOICES = {"auto": tools.AUTO, "any": tools.REQUIRED, "tool": tools.NAMED, "none": tools.NONE}
BLOCKS = {"user": ("text", "tool_result"), "assistant": ("text", "tool_use")}  # the content blocks each role sends


class CountTokensRequest(StrictModel):
    model: str | None = Field(None, description="the model to answer (GET /v1/models); unset: the default")
    messages: list[dict[str, Any]] = Field(max_length=MAX_MESSAGES, description="the conversation: role (user, "
                                           "assistant) and content, a string or a list of blocks: text, tool_use "
                                           "(assistant), tool_result (user)")
    system: str | list[dict[str, Any]] | None = Field(None, description="the system prompt: a string or text blocks")
    tools: list[dict[str, Any]] | None = Field(None, max_length=MAX_TOOLS, description="custom tools the model may "
                                               "call: {name, description, input_schema}")
    tool_choice: dict[str, Any] | None = Field(None, description="{type: auto (the default with tools), any, tool "
                                               "(with name), none}")
    thinking: dict[str, Any] | None = Field(None, description="accepted; Folio's models do not think aloud")
    output_config: dict[str, Any] | None = Field(None, description="{format: {type: json_schema, schema}}: the "
                                                 "answer's text follows the schema")
    cache_control: dict[str, Any] | None = Field(None, description="accepted and ignored (prefixes are cached "
                                                 "anyway)")

    def conversation(self) -> list[dict[str, Any]]:
        """The conversation as the chat template takes it, in chat completions' shape: the system prompt a system
        turn, text blocks joined by newlines, an assistant's `tool_use` blocks its `tool_calls`, a user's
        `tool_result` blocks `tool` turns before the user's text. Every block is checked here, named as the client
        sent it (`messages[2].content[1].tool_use_id`)."""
        out = [] if self.system is None else [{"role": "system", "content": _text(self.system, "system")}]
        for i, message in enumerate(self.messages):
            role = message.get("role")
            if role not in ROLES:
                raise ValidationError(f"messages[{i}].role", f"must be one of 'user', 'assistant' (the system "
                                      f"prompt is the system field), got {preview(role)}")
            out.extend(_turns(role, message.get("content"), f"messages[{i}].content"))
        return out

    def offered(self) -> list[Function]:
        """The tools offered: custom tools {name, description, input_schema, strict}."""
        return read_flat_tools(self.tools, (None, "custom"), "input_schema", strict=False, schema_required=True)

    def tool_plan(self) -> ToolPlan | str | None:
        """What the tools ask of the output (app/api/tools.py): tool_choice {type: auto | any | tool | none}."""
        choice = self.tool_choice or {"type": "auto"}
        kind = choice.get("type")
        mode = TOOL_CHOICES.get(kind) if isinstance(kind, str) else None
        if mode is None:
            raise ValidationError("tool_choice.type", f"must be one of {', '.join(TOOL_CHOICES)}, got "
                                  f"{preview(kind)}")
        return tools.plan(self.offered(), mode, choice.get("name"), "tool_choice.name")


def _text(content: object, where: str) -> str:
    """A string, or text blocks joined by newlines."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValidationError(where, f"must be a string or a list of text blocks, got {preview(content)}")
    texts = []
    for j, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind != "text":
            raise ValidationError(f"{where}[{j}].type", f"must be 'text', got {preview(kind)}")
        texts.append(string_at(block.get("text"), f"{where}[{j}].text"))
    return "\n".join(texts)


def _turns(role: str, content: object, where: str) -> list[dict[str, Any]]:
    """One message's turns in chat completions' shape (`conversation`)."""
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise ValidationError(where, f"must be a string or a list of content blocks, got {preview(content)}")
    allowed = BLOCKS[role]
    texts, calls, results = [], [], []
    for j, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        at = f"{where}[{j}]"
        if kind not in allowed:
            raise ValidationError(f"{at}.type", f"must be one of {', '.join(allowed)} in a {role} message (only "
                                  f"these are supported), got {preview(kind)}")
        if kind == "text":
            texts.append(string_at(block.get("text"), f"{at}.text"))
        elif kind == "tool_use":
            if not isinstance(block.get("input"), dict):
                raise ValidationError(f"{at}.input", f"must be an object, got {preview(block.get('input'))}")
            calls.append({"id": string_at(block.get("id"), f"{at}.id"), "type": "function",
                          "function": {"name": string_at(block.get("name"), f"{at}.name"),
                                       "arguments": json.dumps(block["input"])}})
        else:  # a tool_result: a string, text blocks, or nothing
            result = block.get("content")
            results.append({"role": "tool", "tool_call_id": string_at(block.get("tool_use_id"), f"{at}.tool_use_id"),
                            "content": "" if result is None else _text(result, f"{at}.content")})
    turns = results
    if texts or calls or not results:
        turn: dict[str, Any] = {"role": role, "content": "\n".join(texts)}
        if calls:
            turn["tool_calls"] = calls
        turns.append(turn)
    return turns


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1, description="tokens to generate at most")
    temperature: float | None = Field(None, ge=0, le=1, description="0: greedy; unset: 1.0")
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0, description="keep the k most likely tokens; 0 or unset: off")
    stop_sequences: list[str] | None = Field(None, max_length=MAX_STOP_STRINGS, description=STOP_DOC)
    stream: bool = False
    metadata: dict[str, Any] | None = Field(None, description="accepted and ignored (user_id)")
    # accepted and ignored: what the anthropic SDK may send that has no meaning for a local model
    service_tier: str | None = None
    diagnostics: dict[str, Any] | None = None
    container: str | dict[str, Any] | None = None
    inference_geo: str | None = None
    speed: str | None = None

    def constraint(self) -> Requested | None:
        """output_config.format: {type: json_schema, schema} (Anthropic's structured outputs)."""
        fmt = (self.output_config or {}).get("format")
        return structured.response_format(fmt, "output_config.format", nested=False)

    def to_sampling_params(self, defaults: ServerDefaults) -> SamplingParams:
        max_new_tokens = defaults.max_new_tokens_for(self.max_tokens, MESSAGES.field("max_new_tokens"))
        greedy = self.temperature == 0
        with MESSAGES.naming_fields():
            return SamplingParams(max_new_tokens=max_new_tokens, temperature=self.temperature, top_k=self.top_k,
                                  top_p=self.top_p, do_sample=not greedy, greedy=greedy,
                                  stop=tuple(self.stop_sequences or ()))


class AnthropicErrorDetail(BaseModel):
    type: str
    message: str


class AnthropicError(BaseModel):
    """Anthropic's error body (app/http/errors.py writes it for the /v1/messages routes)."""

    type: Literal["error"]
    error: AnthropicErrorDetail
    request_id: str | None = Field(None, description="the request's ID, as in the X-Request-Id response header")
