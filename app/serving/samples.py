"""Several samples of one prompt, for every API: their seeds (sample i with the request's seed + i) and their
ranking by mean log-probability (TGI's and OpenAI's `best_of`)."""

from __future__ import annotations

from dataclasses import replace

from model.engine import Result
from model.sampling_params import MAX_SEED, SamplingParams


def sample_params(params: SamplingParams, samples: int) -> list[SamplingParams]:
    """One `SamplingParams` per sample of a prompt: sample i seeded with the request's seed + i (so that choice
    i equals a request for it alone with that seed); unseeded samples each draw their own."""
    if params.seed is None:
        return [params] * samples
    return [replace(params, seed=(params.seed + i) % (MAX_SEED + 1)) for i in range(samples)]


def ranked(results: list[Result]) -> list[Result]:
    """Results by mean log-probability per generated token, highest first (`best_of`'s order)."""
    return sorted(results, key=lambda r: sum(t.logprob for t in r.tokens) / max(1, len(r.tokens)), reverse=True)
