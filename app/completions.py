"""OpenAI completions' answer shapes: a choice's `logprobs` block (prompt tokens first when echoed: the first has
no context, so its logprob and alternatives are null, as OpenAI and vLLM write them), `best_of` ranking, usage,
and the seeds of a prompt's samples. No tensors and no I/O: the route (app/openai_api.py) does the submitting."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from model.engine import Result, TokenEvent
from model.sampling_params import MAX_SEED, SamplingParams
from model.scoring import PromptToken

FINISH = {"length": "length", "eos_token": "stop", "stop_sequence": "stop"}


@dataclass
class Scored:
    """A token as the logprobs block shows it: generated (a `TokenEvent`) or echoed (a `PromptToken`)."""

    id: int
    logprob: float | None
    top: dict[str, float] | None

    @classmethod
    def of(cls, t: TokenEvent | PromptToken) -> Scored:
        top = t.top_tokens
        if isinstance(t, PromptToken) and t.logprob is None:
            return cls(t.id, None, None)
        return cls(t.id, t.logprob, {a.text: a.logprob for a in top})


def logprobs_block(tokens: Sequence[Scored], text_of: Callable[[int], str], offset: int) -> dict[str, Any]:
    """`{tokens, token_logprobs, top_logprobs, text_offset}` with offsets counted from `offset` characters."""
    texts = [text_of(t.id) for t in tokens]
    offsets = []
    for t in texts:
        offsets.append(offset)
        offset += len(t)
    return {"tokens": texts, "token_logprobs": [t.logprob for t in tokens],
            "top_logprobs": [t.top for t in tokens], "text_offset": offsets}


def choice_logprobs(result: Result, echoed: bool, text_of: Callable[[int], str]) -> dict[str, Any]:
    """A whole choice's logprobs: the prompt's tokens (if echoed), then the generated ones."""
    prompt = [Scored.of(t) for t in result.prompt_logprobs or ()] if echoed else []
    return logprobs_block(prompt + [Scored.of(t) for t in result.tokens], text_of, 0)


def sample_params(params: SamplingParams, samples: int) -> list[SamplingParams]:
    """One `SamplingParams` per sample of a prompt: sample i seeded with the request's seed + i (so that choice
    i equals a request for it alone with that seed); unseeded samples each draw their own."""
    if params.seed is None:
        return [params] * samples
    return [replace(params, seed=(params.seed + i) % (MAX_SEED + 1)) for i in range(samples)]


def ranked(results: list[Result]) -> list[Result]:
    """Results by mean log-probability per generated token, highest first (`best_of`'s order)."""
    return sorted(results, key=lambda r: sum(t.logprob for t in r.tokens) / max(1, len(r.tokens)), reverse=True)


def best(results: list[Result], n: int) -> list[Result]:
    """OpenAI's choices: the n best (`ranked`), or all of them in their order when there are only n."""
    return results if len(results) == n else ranked(results)[:n]


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}
