"""Speculative decoding: tokens drafted cheaply, verified together in one forward of the model.

- `speculator.Speculator`: per request and step, the draft and how many of its tokens to verify (k, adapted to
  the request's acceptance rate and the draft's cost), from a `Proposer`:
- `ngram.NgramProposer`: prompt lookup (`--speculative-model [ngram]`), drafts from the n-grams of a request's prompt
  and output (`ngram.NgramIndex`);
- `draft.DraftModelProposer`: a draft model (`--speculative-model PATH`, a checkpoint with the served model's
  tokenizer), run greedily in its own KV cache kept in step with each request.

Verifying is the engine's (model/engine/scheduler.py: the drafted tokens are rows of the decode step's forward,
each in its request's cache row at its own position) and the sampler's (model/sampler.py, `Sampler.verify`: which
drafted tokens are accepted, so that the output is distributed exactly as without speculation).
"""

from model.speculative.draft import DraftModelProposer, check_same_tokenizer, measure_token_cost
from model.speculative.ngram import NgramIndex, NgramProposer
from model.speculative.speculator import Drafting, Proposer, Speculation, Speculator, best_k, speculates

__all__ = ["DraftModelProposer", "Drafting", "NgramIndex", "NgramProposer", "Proposer", "Speculation", "Speculator",
           "best_k", "check_same_tokenizer", "measure_token_cost", "speculates"]
