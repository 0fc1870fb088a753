"""Speculative decoding: tokens drafted cheaply, verified together in one forward of the model.

- `ngram.NgramIndex`: prompt lookup, drafts from the n-grams of a request's prompt and output;
- `speculator.Speculator`: per request and step, the draft and how many of its tokens to verify (k, adapted to
  the request's acceptance rate).

Verifying is the engine's (model/engine/scheduler.py: the drafted tokens are rows of the decode step's forward,
each in its request's cache row at its own position) and the sampler's (model/sampler.py, `Sampler.verify`: which
drafted tokens are accepted, so that the output is distributed exactly as without speculation).
"""

from model.speculative.ngram import NgramIndex
from model.speculative.speculator import Speculation, Speculator, best_k, speculates

__all__ = ["NgramIndex", "Speculation", "Speculator", "best_k", "speculates"]
