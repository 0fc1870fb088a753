"""Anthropic's Messages API on the wire (`POST /v1/messages`, `POST /v1/messages/count_tokens`): the request, its
conversion to a conversation the chat template renders and to `SamplingParams`, and how it names the model's
fields in errors (`MESSAGES`)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

from app.api import structured
from app.api.openai.chat.protocol import MAX_MESSAGES, MAX_TOOLS
from app.api.protocol import STOP_DOC, Api, ServerDefaults, StrictModel
from app.api.structured import Requested
from model.sampling_params import SamplingParams, ValidationError, preview
from model.stopping import MAX_STOP_STRINGS

MESSAGES = Api({"prompt": "messages", "max_new_tokens": "max_tokens", "stop": "stop_sequences"})
ROLES = ("user", "assistant")  # the system prompt is its own field
STOP_REASONS = {"length": "max_tokens", "eos_token": "end_turn", "stop_sequence": "stop_sequence", "stop": "end_turn"}


class CountTokensRequest(StrictModel):
    model: str | None = Field(None, description="the model to answer (GET /v1/models); unset: the default")
    messages: list[dict[str, Any]] = Field(max_length=MAX_MESSAGES, description="the conversation: role (user, "
                                           "assistant) and content, a string or a list of text blocks")
    system: str | list[dict[str, Any]] | None = Field(None, description="the system prompt: a string or text blocks")
    tools: list[dict[str, Any]] | None = Field(None, max_length=MAX_TOOLS, description="not supported: use "
                                               "/v1/chat/completions for tool calls")
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = Field(None, description="accepted; Folio's models do not think aloud")
    output_config: dict[str, Any] | None = Field(None, description="{format: {type: json_schema, schema}}: the "
                                                 "answer's text follows the schema")

    def conversation(self) -> list[dict[str, Any]]:
        """The messages as the chat template takes them (OpenAI's shape: a system turn first if there is a system
        prompt; text blocks are its text parts). Roles other than user and assistant are refused here, naming the
        message; the template's checks name the rest (a block that is not text, an empty list)."""
        if self.tools:
            raise ValidationError("tools", "are not supported by Folio's Messages API (its chat completions, "
                                  "/v1/chat/completions, call tools)")
        for i, message in enumerate(self.messages):
            role = message.get("role")
            if role not in ROLES:
                raise ValidationError(f"messages[{i}].role", f"must be one of 'user', 'assistant' (the system "
                                      f"prompt is the system field), got {preview(role)}")
        if self.system is None:
            return self.messages
        return [{"role": "system", "content": self.system}, *self.messages]


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
    cache_control: dict[str, Any] | None = None
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
