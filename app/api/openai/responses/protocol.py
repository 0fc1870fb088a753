"""OpenAI's Responses API request (`POST /v1/responses`), stateless: `input` (a string, or messages), `instructions`,
`max_output_tokens`, sampling, `text.format` for structured output, `stream`. Nothing is stored, so `store` must
not ask for it and `previous_response_id` cannot be followed: both are refused, naming the field."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from app.api import structured
from app.api.protocol import Api, ServerDefaults, StrictModel
from app.api.structured import Requested
from model.sampling_params import MAX_SEED, SamplingParams, ValidationError, preview

RESPONSES = Api({"prompt": "input", "max_new_tokens": "max_output_tokens"})
INPUT_ROLES = ("system", "developer", "user", "assistant")
TEXT_PARTS = ("input_text", "output_text", "text")


class ResponsesRequest(StrictModel):
    model: str | None = Field(None, description="the model to answer (GET /v1/models); unset: the default")
    input: str | list[dict[str, Any]] = Field(description="a string (one user message) or a list of messages "
                                              "{role, content: a string or input_text parts}")
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
    tools: list[dict[str, Any]] | None = Field(None, max_length=0, description="not supported (use chat "
                                               "completions' tools)")
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    truncation: str | None = Field(None, description="'disabled' (the default) only")
    reasoning: dict[str, Any] | None = Field(None, description="accepted and ignored")

    def messages(self) -> list[dict[str, Any]]:
        """The conversation as the chat template takes it: instructions as the system turn, then the input; the
        Responses API's `developer` role a system turn (as chat's: model/chat_template.py), its `input_text` /
        `output_text` parts text parts."""
        if self.store:
            raise ValidationError("store", "must be false or unset: Folio keeps no responses (the API is stateless "
                                  "here), got true")
        if self.previous_response_id is not None:
            raise ValidationError("previous_response_id", "cannot be followed: Folio keeps no responses; send the "
                                  "conversation in input")
        if self.truncation not in (None, "disabled"):
            raise ValidationError("truncation", f"must be 'disabled', got {preview(self.truncation)}")
        out = [{"role": "system", "content": self.instructions}] if self.instructions is not None else []
        if isinstance(self.input, str):
            return [*out, {"role": "user", "content": self.input}]
        if not self.input:
            raise ValidationError("input", "must be a non-empty string or list of messages")
        for i, item in enumerate(self.input):
            if item.get("type", "message") != "message":
                raise ValidationError(f"input[{i}].type", f"must be 'message' (only messages are supported), got "
                                      f"{preview(item.get('type'))}")
            role = item.get("role")
            if role not in INPUT_ROLES:
                raise ValidationError(f"input[{i}].role", f"must be one of {', '.join(INPUT_ROLES)}, got "
                                      f"{preview(role)}")
            content = item.get("content")
            if isinstance(content, list):
                for j, part in enumerate(content):
                    if not isinstance(part, dict) or part.get("type") not in TEXT_PARTS:
                        raise ValidationError(f"input[{i}].content[{j}].type", f"must be one of "
                                              f"{', '.join(TEXT_PARTS)} (only text is supported), got "
                                              f"{preview(part.get('type') if isinstance(part, dict) else part)}")
                content = [{"type": "text", "text": part.get("text")} for part in content]
            out.append({"role": role, "content": content})
        return out

    def constraint(self) -> Requested | None:
        return structured.response_format((self.text or {}).get("format"), "text.format", nested=False)

    def to_sampling_params(self, defaults: ServerDefaults) -> SamplingParams:
        max_new_tokens = defaults.max_new_tokens_for(self.max_output_tokens, RESPONSES.field("max_new_tokens"))
        greedy = self.temperature == 0
        with RESPONSES.naming_fields():
            return SamplingParams(max_new_tokens=max_new_tokens, temperature=self.temperature, top_p=self.top_p,
                                  do_sample=not greedy, greedy=greedy, seed=self.seed)
