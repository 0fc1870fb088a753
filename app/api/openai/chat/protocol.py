"""OpenAI's chat completions request (`POST /v1/chat/completions`) and how it names the model's fields in errors
(`CHAT`). The conversation's shape (roles, text parts) is checked where it is rendered, by the chat template
(model/chat_template.py), which names `messages[i].role` and the like; here only its size is bounded."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from app.api.openai.protocol import SamplingRequest
from app.api.protocol import MAX_LOGPROBS, Api, ServerDefaults
from model.sampling_params import SamplingParams, ValidationError

MAX_MESSAGES = 1024  # turns in one conversation
MAX_TOOLS = 128  # functions offered in one request
CHAT = Api({"prompt": "messages", "max_new_tokens": "max_completion_tokens", "top_n_tokens": "top_logprobs"})


class ChatCompletionRequest(SamplingRequest):
    messages: list[dict[str, Any]] = Field(max_length=MAX_MESSAGES, description="the conversation: role (system, "
                                           "user, assistant, tool) and content, a string or a list of text parts")
    max_tokens: int | None = Field(None, ge=1, description="deprecated by OpenAI for max_completion_tokens; the same")
    max_completion_tokens: int | None = Field(None, ge=1, description="tokens to generate at most (server default "
                                                                      "if unset)")
    logprobs: bool = Field(False, description="each generated token's log-probability")
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, description="this many alternatives per token "
                                                                              "(needs logprobs)")
    tools: list[dict[str, Any]] | None = Field(None, max_length=MAX_TOOLS, description="functions the model may "
                                               "call: {type: function, function: {name, description, parameters}}")
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = Field(
        None, description="none, auto, required, or {type: function, function: {name}}")
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = Field(None, description="{type: text | json_object | json_schema}")
    structured_outputs: dict[str, Any] | None = Field(None, description="extension (vLLM): {json | regex | "
                                                      "choice | grammar: ...}")
    add_generation_prompt: bool = Field(True, description="extension (vLLM): end the prompt with the assistant's "
                                                          "turn")

    def samples(self, defaults: ServerDefaults) -> int:
        defaults.check_sequences("n", "n", self.n, str(self.n))
        return self.n

    def check(self) -> None:
        """What no single field says: logprobs for top_logprobs, two token budgets that agree."""
        if self.top_logprobs is not None and not self.logprobs:
            raise ValidationError("top_logprobs", f"needs logprobs: true, got top_logprobs {self.top_logprobs}")
        if self.max_tokens is not None and self.max_completion_tokens is not None \
                and self.max_tokens != self.max_completion_tokens:
            raise ValidationError("max_completion_tokens", f"and max_tokens must agree when both are given, got "
                                  f"{self.max_completion_tokens} and {self.max_tokens}")

    def to_sampling_params(self, defaults: ServerDefaults, **extra: Any) -> SamplingParams:
        self.check()
        requested = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        max_new_tokens = defaults.max_new_tokens_for(requested, CHAT.field("max_new_tokens"))
        top_n = (self.top_logprobs or 0) if self.logprobs else 0
        return self.sampling_params(CHAT, max_new_tokens, top_n, **extra)
