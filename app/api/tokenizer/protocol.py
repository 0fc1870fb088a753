"""The tokenizer routes' wire models: `/tokenize` in TGI's shape (`inputs`) or vLLM's (`prompt`), `/detokenize`."""

from __future__ import annotations

from pydantic import BaseModel, Field, model_validator
from pydantic_core import PydanticCustomError

from app.api.protocol import StrictModel, TokenIds
from app.api.tgi.protocol import GenerateParameters


class TokenizeRequest(StrictModel):
    """TGI's `{"inputs"}` (answered with a list of tokens and their offsets) or vLLM's `{"prompt"}` (answered with
    `{count, max_model_len, tokens}`, what lm-evaluation-harness's remote tokenizer reads)."""

    inputs: str | None = Field(None, description="TGI: the text")
    prompt: str | None = Field(None, description="vLLM: the text")
    parameters: GenerateParameters | None = None
    add_special_tokens: bool | None = None
    model: str | None = None

    @model_validator(mode="after")
    def _one_text(self) -> TokenizeRequest:
        if (self.inputs is None) == (self.prompt is None):
            raise PydanticCustomError("one_text", "give the text as exactly one of inputs (TGI) or prompt (vLLM)")
        return self

    @property
    def field(self) -> str:
        return "inputs" if self.inputs is not None else "prompt"

    @property
    def text(self) -> str:
        return self.inputs if self.inputs is not None else self.prompt  # type: ignore[return-value]


class TokenizeResponse(BaseModel):
    """vLLM's answer to /tokenize."""

    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(StrictModel):
    tokens: TokenIds = Field(description="token ids (vLLM's /detokenize shape)")


class DetokenizeResponse(BaseModel):
    prompt: str


class SimpleToken(BaseModel):
    id: int
    text: str
    start: int
    stop: int
