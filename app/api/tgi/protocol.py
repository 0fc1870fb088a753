"""Hugging Face TGI's wire models: `/generate`'s request (`inputs` and `parameters`), its answer and its stream's
events, and how TGI names the model's fields in errors (`TGI`)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field, SerializerFunctionWrapHandler, model_serializer

from app.api.protocol import MAX_N, STOP_DOC, Api, ServerDefaults, StrictModel
from app.api.structured import Requested, tgi_grammar
from model.sampling_params import MAX_SEED, AttentionSpec, SamplingParams, ValidationError, preview
from model.stopping import MAX_STOP_STRINGS

TGI = Api({"prompt": "inputs"}, prefix="parameters.", truncate_hint=" (parameters.truncate)")


class AttentionRequest(StrictModel):
    """Folio: the attention weights each generated token was chosen with, sent with the token."""

    layers: list[int] | None = Field(None, max_length=256, description="layers, 0-based; unset: all")
    heads: list[int] | None = Field(None, max_length=256, description="heads, 0-based; unset: per layer, the mean "
                                    "over its heads")

    def to_spec(self) -> AttentionSpec:
        return AttentionSpec(layers=None if self.layers is None else tuple(self.layers),
                             heads=None if self.heads is None else tuple(self.heads))


class GenerateParameters(StrictModel):
    max_new_tokens: int | None = Field(None, ge=1, description="tokens to generate at most (server default if unset)")
    temperature: float | None = Field(None, ge=0, le=100, description="0 means greedy; unset means 1.0")
    top_k: int | None = Field(None, ge=0, description="keep the k most likely tokens; 0 or unset: off")
    top_p: float | None = Field(None, gt=0, le=1, description="nucleus sampling mass; 1.0 or unset: off")
    do_sample: bool = Field(False, description="sample; without it and without sampling controls: greedy")
    greedy: bool = Field(False, description="Folio: force argmax decoding whatever else is set")
    repetition_penalty: float | None = Field(None, gt=0, le=100, description="CTRL penalty; 1.0 or unset: off")
    seed: int | None = Field(None, ge=0, le=MAX_SEED, description="random seed; drawn and reported if unset")
    stop: list[str] = Field(default_factory=list, max_length=MAX_STOP_STRINGS, description=STOP_DOC)
    return_full_text: bool | None = Field(False, description="prepend the prompt to generated_text")
    details: bool = Field(False, description="return finish reason, seed, tokens and logprobs")
    decoder_input_details: bool = Field(False, description="return the prompt's tokens with their logprobs in "
                                                          "details.prefill (the first has none)")
    top_n_tokens: int | None = Field(None, ge=0, le=20, description="alternatives with logprobs per token")
    truncate: int | None = Field(None, ge=1, description="keep only the last N prompt tokens")
    best_of: int | None = Field(None, ge=1, le=MAX_N, description="sample this many and return the one of highest "
                                "mean logprob, the others in details.best_of_sequences (needs sampling; "
                                "not with streaming)")
    frequency_penalty: float | None = Field(None, ge=-2, le=2, description="subtracted once per time a token was "
                                                                          "generated")
    attention: AttentionRequest | None = Field(None, description="Folio: each token's attention weights, in its "
                                               "stream event (/generate: in details, which it needs)")
    speculate: bool = Field(True, description="Folio: false decodes this request one token a step where the "
                            "server speculates (--speculative-model); the output is distributed the same either way")
    # accepted for TGI client compatibility; only their 'off' values are supported
    typical_p: float | None = Field(None, description="not supported (must be unset)")
    watermark: bool = Field(False, description="not supported (must be false)")
    grammar: dict[str, Any] | None = Field(None, description='{"type": "json", "value": schema} or {"type": '
                                           '"regex", "value": pattern}: the output follows it')
    adapter_id: None = Field(None, description="not supported (must be unset)")


    def constraint(self) -> Requested | None:
        return tgi_grammar(self.grammar)

    def to_sampling_params(self, defaults: ServerDefaults) -> SamplingParams:
        unsupported = {"typical_p": self.typical_p not in (None, 1.0), "watermark": self.watermark}
        for name, bad in unsupported.items():
            if bad:
                raise ValidationError(TGI.field(name), f"is not supported by Folio, got {preview(getattr(self, name))}")
        max_new_tokens = defaults.max_new_tokens_for(self.max_new_tokens, TGI.field("max_new_tokens"))
        with TGI.naming_fields():
            return SamplingParams(
                max_new_tokens=max_new_tokens, temperature=self.temperature, top_k=self.top_k, top_p=self.top_p,
                do_sample=self.do_sample, greedy=self.greedy, repetition_penalty=self.repetition_penalty,
                seed=self.seed, stop=tuple(self.stop), top_n_tokens=self.top_n_tokens or 0,
                frequency_penalty=self.frequency_penalty or 0.0,
                prompt_logprobs=0 if self.details and self.decoder_input_details else None,
                attention=None if self.attention is None else self.attention.to_spec(), speculate=self.speculate,
            )

    def samples(self, params: SamplingParams, stream: bool, defaults: ServerDefaults) -> int:
        """Sequences to generate: `best_of` (TGI's rules: it needs sampling, and a stream carries one; at most the
        server's share for one request, TGI's `max_best_of`)."""
        best_of = self.best_of or 1
        if best_of > 1 and params.is_greedy:
            raise ValidationError(TGI.field("best_of"), f"greater than 1 needs sampling (do_sample, or temperature, "
                                                        f"top_k or top_p), got {best_of}")
        if best_of > 1 and stream:
            raise ValidationError(TGI.field("best_of"), f"must be 1 when streaming, got {best_of}")
        if self.attention is not None and not stream and not self.details:
            raise ValidationError(TGI.field("attention"), "a whole answer carries the attention in its details: set "
                                                          "parameters.details, or stream (/generate_stream)")
        if self.attention is not None and best_of > 1:
            raise ValidationError(TGI.field("attention"), f"is for one sequence: not with best_of, got {best_of}")
        defaults.check_sequences(TGI.field("best_of"), "best_of", best_of, str(best_of))
        return best_of


class GenerateRequest(StrictModel):
    inputs: str = Field(description="the prompt")
    parameters: GenerateParameters = Field(default_factory=GenerateParameters)
    stream: bool = Field(False, description="POST / only: stream server-sent events")


class Token(BaseModel):
    id: int
    text: str
    logprob: float | None = None
    special: bool = False


class PrefillToken(BaseModel):
    id: int
    text: str
    logprob: float | None = None

    @model_serializer(mode="wrap")
    def _logprob_always(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """The first prompt token's logprob (it has no context) is written `null`, as TGI writes it: the routes
        drop every other null (`exclude_none`)."""
        out = handler(self)
        out.setdefault("logprob", self.logprob)
        return out


class TokenAttention(BaseModel):
    """Folio: the attention a generated token was chosen with: that of the token before it, over the tokens before
    it (within the context window)."""

    start: int = Field(description="the index, among the prompt's and the generated tokens, of the token each "
                                   "row's first weight is for")
    layers: list[int]
    heads: list[int] | None = Field(None, description="absent: each row is the mean over its layer's heads")
    weights: list[list[float]] = Field(description="a row per layer and head (layers outer), over the tokens from "
                                                   "`start` to the one before this token; 6 decimals")


class SequenceDetails(BaseModel):
    """What TGI's details say of one generated sequence."""

    finish_reason: Literal["length", "eos_token", "stop_sequence"]
    generated_tokens: int
    seed: int | None = Field(None, description="the seed a sampled sequence used; absent for greedy decoding, which "
                             "samples nothing")
    prefill: list[PrefillToken] = Field(default_factory=list)
    tokens: list[Token] = Field(default_factory=list)
    top_tokens: list[list[Token]] = Field(default_factory=list)


class BestOfSequence(SequenceDetails):
    generated_text: str


class Details(SequenceDetails):
    best_of_sequences: list[BestOfSequence] | None = None
    window_slides: int = Field(0, description="Folio: how often the context window slid")
    truncated_prompt_tokens: int = Field(0, description="Folio: prompt tokens that parameters.truncate left out")
    attention: list[TokenAttention] | None = Field(None, description="Folio: with parameters.attention, each "
                                                   "token's")


class GenerateResponse(BaseModel):
    generated_text: str
    details: Details | None = None


class StreamDetails(BaseModel):
    finish_reason: Literal["length", "eos_token", "stop_sequence"]
    generated_tokens: int
    seed: int | None
    input_length: int
    truncated_prompt_tokens: int = Field(0, description="Folio: prompt tokens that parameters.truncate left out")


class StreamResponse(BaseModel):
    index: int
    token: Token
    top_tokens: list[Token] = Field(default_factory=list)
    generated_text: str | None = None
    details: StreamDetails | None = None
    attention: TokenAttention | None = Field(None, description="Folio: with parameters.attention")
