"""OpenAI's chat completions request (`POST /v1/chat/completions`) and how it names the model's fields in errors
(`CHAT`). The conversation's shape (roles, text parts) is checked where it is rendered, by the chat template
(model/chat_template.py), which names `messages[i].role` and the like; here only its size is bounded."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from app.api import tools
from app.api.openai.protocol import SamplingRequest
from app.api.protocol import MAX_LOGPROBS, Api, ServerDefaults, refuse_set
from app.api.tools import Function, ToolPlan, read_function
from model.sampling_params import SamplingParams, ValidationError, preview

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
    add_generation_prompt: bool = Field(True, description="extension (vLLM): end the prompt with the assistant's "
                                                          "turn")
    # what the openai SDK's create takes that means nothing for a local model: accepted and ignored
    metadata: dict[str, str] | None = Field(None, description="accepted and ignored (it labels stored completions)")
    service_tier: str | None = Field(None, description="accepted and ignored")
    reasoning_effort: str | None = Field(None, description="accepted and ignored: Folio's models do not reason")
    verbosity: str | None = Field(None, description="accepted and ignored")
    prompt_cache_key: str | None = Field(None, description="accepted and ignored (prefixes are cached anyway)")
    safety_identifier: str | None = Field(None, description="accepted and ignored")
    prediction: dict[str, Any] | None = Field(None, description="accepted and ignored (a hint for speed)")
    # and what it takes that Folio cannot do: refused unless unset (or its one value Folio does)
    store: bool | None = Field(None, description="must be false or unset: Folio stores no completions")
    modalities: list[str] | None = Field(None, description="['text'] or unset: Folio's models answer in text")
    audio: dict[str, Any] | None = Field(None, description="not supported (must be unset)")
    web_search_options: dict[str, Any] | None = Field(None, description="not supported (must be unset)")
    functions: list[Any] | None = Field(None, description="OpenAI's deprecated form of tools: not supported (use "
                                        "tools)")
    function_call: str | dict[str, Any] | None = Field(None, description="OpenAI's deprecated form of tool_choice: "
                                                       "not supported (use tool_choice)")

    def offered(self) -> list[Function]:
        """The functions offered, each `{type: function, function: {name, description, parameters, strict}}`."""
        taken: set[str] = set()
        out = []
        for i, tool in enumerate(self.tools or ()):
            function = tool.get("function")
            if tool.get("type") != "function" or not isinstance(function, dict):
                raise ValidationError(f"tools[{i}]", f"must be {{type: function, function: {{name, parameters}}}}, "
                                      f"got {preview(tool)}")
            where = f"tools[{i}].function"
            out.append(read_function(where, function.get("name"), function.get("parameters"), f"{where}.parameters",
                                     function.get("description"), bool(function.get("strict")), taken))
        return out

    def tool_plan(self) -> ToolPlan | str | None:
        """What the tools ask of the output (app/api/tools.py): tool_choice none, auto (the default), required, or
        {type: function, function: {name}}."""
        functions = self.offered()
        if isinstance(self.tool_choice, dict):
            function = self.tool_choice.get("function")
            name = function.get("name") if isinstance(function, dict) else None
            return tools.plan(functions, tools.NAMED, name, "tool_choice.function.name")
        return tools.plan(functions, self.tool_choice or tools.AUTO)

    def samples(self, defaults: ServerDefaults) -> int:
        defaults.check_sequences("n", "n", self.n, str(self.n))
        return self.n

    def check(self) -> None:
        """What no single field says: logprobs for top_logprobs, two token budgets that agree; and the SDK's
        fields Folio cannot do, refused unless unset."""
        refuse_set(self, ("audio", "web_search_options", "functions", "function_call"),
                   "is not supported by Folio (must be unset)")
        if self.store:
            raise ValidationError("store", "must be false or unset: Folio stores no completions, got true")
        if self.modalities not in (None, ["text"]):
            raise ValidationError("modalities", f"must be ['text'] or unset: Folio's models answer in text, got "
                                  f"{preview(self.modalities)}")
        if self.top_logprobs is not None and not self.logprobs:
            raise ValidationError("top_logprobs", f"needs logprobs: true, got top_logprobs {self.top_logprobs}")
        if self.max_tokens is not None and self.max_completion_tokens is not None \
                and self.max_tokens != self.max_completion_tokens:
            raise ValidationError("max_completion_tokens", f"and max_tokens must agree when both are given, got "
                                  f"{self.max_completion_tokens} and {self.max_tokens}")

    def to_sampling_params(self, defaults: ServerDefaults, **extra: Any) -> SamplingParams:
        self.check()
        given = "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"
        max_new_tokens = defaults.max_new_tokens_for(getattr(self, given), given)  # named as the client named it
        top_n = (self.top_logprobs or 0) if self.logprobs else 0
        return self.sampling_params(CHAT, max_new_tokens, top_n, **extra)
