"""The tokenizer routes' wire models: `/tokenize` in TGI's shape (`inputs`) or vLLM's (`prompt`), `/detokenize`."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field, model_validator
from pydantic_core import PydanticCustomError

from app.api.openai.chat.protocol import MAX_MESSAGES, MAX_TOOLS
from app.api.protocol import Api, StrictModel, TokenIds
from app.api.tgi.protocol import GenerateParameters


class TokenizeRequest(StrictModel):
    """TGI's `{"inputs"}` (answered with a list of tokens and their offsets) or vLLM's `{"prompt"}` or `{"messages"}`
    (answered with `{count, max_model_len, tokens}`, what lm-evaluation-harness's remote tokenizer reads; a
    conversation is counted as the chat template renders it, as /v1/chat/completions would send it)."""

    inputs: str | None = Field(None, description="TGI: the text")
    prompt: str | None = Field(None, description="vLLM: the text")
    messages: list[dict[str, Any]] | None = Field(None, max_length=MAX_MESSAGES, description="vLLM: a conversation "
                                                  "(as /v1/chat/completions takes it)")
    add_generation_prompt: bool = Field(True, description="vLLM, with messages: end with the assistant's turn")
    tools: list[dict[str, Any]] | None = Field(None, max_length=MAX_TOOLS, description="vLLM, with messages")
    parameters: GenerateParameters | None = None
    add_special_tokens: bool | None = None
    model: str | None = Field(None, description="the model whose tokenizer answers (vLLM's field)")

    @model_validator(mode="after")
    def _one_text(self) -> TokenizeRequest:
        if sum(x is not None for x in (self.inputs, self.prompt, self.messages)) != 1:
            raise PydanticCustomError("one_text", "give exactly one of inputs (TGI), prompt or messages (vLLM)")
        return self

    @property
    def field(self) -> str:
        return "inputs" if self.inputs is not None else "prompt" if self.prompt is not None else "messages"


class TokenizeResponse(BaseModel):
    """vLLM's answer to /tokenize."""

    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(StrictModel):
    tokens: TokenIds = Field(description="token ids (vLLM's /detokenize shape)")
    model: str | None = Field(None, description="the model whose tokenizer decodes them (vLLM's field)")


class DetokenizeResponse(BaseModel):
    prompt: str


class SimpleToken(BaseModel):
    id: int
    text: str
    start: int
    stop: int


TOKENIZE = Api({"prompt": "messages"})  # /tokenize's conversation: what the chat template reports on
