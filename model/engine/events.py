"""What the engine hands back: one `TokenEvent` per generated token, or an `EngineError`; and its counters
(`EngineStats`, read by /metrics).

A generation ends once, with one event: the last `TokenEvent`, whose `finished` is set (TGI's `End`, vLLM's
`finished` on the last output), or, when it generated no token (a prompt only scored: `max_new_tokens` 0), a
`Finished` alone. Nothing follows it; `end_of` reads it from either. A prompt's log-probabilities come once too,
on the first event.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from model.scoring import PromptToken, TopToken


class EngineError(Exception):
    """Base of the engine's domain errors (each API maps them to its own status codes)."""


class Overloaded(EngineError):
    """The running batch and the waiting queue are both full."""


class GenerationError(EngineError):
    """Generation failed for this request (the engine keeps serving the others)."""


class EngineStopped(EngineError):
    """The engine is shutting down or stopped."""


@dataclass
class EngineStats:
    running: int = 0
    waiting: int = 0
    cancelled_total: int = 0
    rejected_total: int = 0
    failed_total: int = 0
    generated_tokens_total: int = 0
    prompt_tokens_total: int = 0  # prompt tokens of the requests that began prefilling
    cached_prompt_tokens_total: int = 0  # of those, the ones found in the cache (prefix reuse), not computed
    # speculative decoding (vLLM's counters): drafts verified, the tokens they held, and of those the ones accepted
    spec_decode_num_drafts_total: int = 0
    spec_decode_num_draft_tokens_total: int = 0
    spec_decode_num_accepted_tokens_total: int = 0


@dataclass(frozen=True)
class Finished:
    finish_reason: str  # "length", "eos_token", "stop_sequence"
    generated_text: str
    generated_tokens: int
    seed: int | None  # None for greedy decoding, which samples nothing
    prompt_tokens: int
    prefill: tuple[int, ...]  # the prompt's token ids as the model saw them (after truncation)
    stop_sequence: str | None = None
    window_slides: int = 0
    truncated_prompt_tokens: int = 0
    prompt_logprobs: tuple[PromptToken, ...] | None = None  # here only when no token came (else on the first one)


@dataclass(frozen=True)
class TokenAttention:
    """The attention with which a token was chosen (`model.engine.attention`): one row per layer asked for and
    head (or per layer, the mean over its heads when `heads` is None), over the tokens before this one."""

    start: int  # the index of the first weight's token among the prompt and generated tokens so far
    layers: tuple[int, ...]
    heads: tuple[int, ...] | None  # None: each row is the mean over the layer's heads
    weights: list[list[float]]  # rows in order (layer, head), each over tokens start..this one's index - 1


@dataclass(frozen=True)
class TokenEvent:
    id: int
    text: str  # the text this token releases: UTF-8 safe, stop strings held back
    logprob: float
    special: bool
    index: int  # 1-based count of generated tokens
    top_tokens: tuple[TopToken, ...] = ()
    finished: Finished | None = None  # set on the last token: the end of the generation
    prompt_logprobs: tuple[PromptToken, ...] | None = None  # on the first token, with `prompt_logprobs`
    attention: TokenAttention | None = None  # with `SamplingParams.attention`
    created: float = field(default_factory=time.perf_counter)  # when the engine produced it (latency metrics)


@dataclass
class Result:
    """A whole generation, gathered from a stream (what the non-streaming routes return)."""

    tokens: list[TokenEvent]
    finished: Finished

    @property
    def text(self) -> str:
        return self.finished.generated_text

    @property
    def token_ids(self) -> list[int]:
        return [t.id for t in self.tokens]

    @property
    def prompt_logprobs(self) -> tuple[PromptToken, ...] | None:
        """The prompt's log-probabilities (with `SamplingParams.prompt_logprobs`), from the first event."""
        return (self.tokens[0] if self.tokens else self.finished).prompt_logprobs


Event = TokenEvent | Finished | EngineError


def end_of(ev: object) -> Finished | None:
    """The end of the generation if `ev` is its last event (the last token's `finished`, or a `Finished` alone)."""
    if isinstance(ev, TokenEvent):
        return ev.finished
    return ev if isinstance(ev, Finished) else None
