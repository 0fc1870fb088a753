"""Which tokens each request drafts in a decode step, and how many: `Speculator` (one per engine) and
`Speculation` (one per request that speculates).

A request's draft comes from prompt lookup (`NgramIndex` over its prompt and output). How many of the proposed
tokens are verified, k, is chosen per request and per step from an estimate of its acceptance rate a (the
chance that the model takes a drafted token): verifying k tokens yields 1 + a + ... + a^k tokens on average
(every accepted token, and the model's own after the first rejection or the last draft) for a step that costs
about 1 + VERIFY_COST + ROW_COST * k plain steps at batch 1, so k is the one that maximises their ratio, 0 (plain
decoding) where no draft pays. In a batch of n requests a plain step yields n tokens for about what one costs, and
a request's verification slows all of them: its costs count n times, so requests speculate only with drafts taken
ever more often as the batch grows (vLLM turns speculation off above a batch size instead). The estimate is an
exponential moving average over every drafted position verified, and over the steps that do not speculate as
well: the proposal's first token compared with the token the model chose (for a sampled request that match has the
acceptance's own probability, p(draft)), so a request whose drafts stopped being taken (k fell to 0) starts
speculating again as soon as they would be, at no cost.

k may depend on the batch: what a request generates does not depend on k (`Sampler.verify` chooses every token as
plain decoding does, with the same draws of a seeded request's generator).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from model.sampling_params import SamplingParams
from model.speculative.ngram import NgramIndex

# a verifying step's cost beyond a plain one, in plain steps: VERIFY_COST once (the verification's bookkeeping), and
# ROW_COST per drafted token (a row of the forward, its logits and its choice). Measured at batch 1 on the bundled
# model, where a step is ~1 ms and mostly fixed costs, the steps of k = 1, 2, 4, 8 cost 1.10, 1.16, 1.24, 1.47 plain
# ones (greedy; sampled ~0.02 more); a larger model reads its weights once for all rows, so its rows cost less
VERIFY_COST = 0.08
ROW_COST = 0.06
PRIOR_ACCEPTANCE = 0.3  # the estimate before a request's first observation
ACCEPTANCE_WEIGHT = 0.15  # each observation's weight in the moving average


def best_k(acceptance: float, k_max: int, batch: int = 1) -> int:
    """The k in [0, k_max] with the most tokens per unit of cost, (1 + a + ... + a^k) / (1 + batch * (VERIFY_COST +
    ROW_COST * k)) for k >= 1, 1 for k = 0 (a plain step), in a batch of `batch` requests."""
    best, best_rate, expected, term = 0, 1.0, 1.0, 1.0
    for k in range(1, k_max + 1):
        term *= acceptance
        expected += term
        rate = expected / (1 + batch * (VERIFY_COST + ROW_COST * k))
        if rate > best_rate:
            best, best_rate = k, rate
    return best


def speculates(params: SamplingParams) -> bool:
    """Whether a request with `params` may speculate: not where it opted out (`speculate=False`), nor where its
    tokens cannot be verified several at a time as the plain path chooses them: under a structured-output constraint
    (its grammar's matcher would have to advance over drafted tokens and back) or with streamed attention (computed
    for one token a step). Those decode plainly, in the same steps as the others."""
    return params.speculate and params.constraint is None and params.attention is None


@dataclass
class Speculation:
    """One request's drafting state: its n-gram index, the tokens indexed so far and its acceptance estimate."""

    index: NgramIndex
    acceptance: float = PRIOR_ACCEPTANCE
    shadow: int | None = None  # the first proposed token of a step that did not speculate, to compare afterwards
    drafted: list[int] = field(default_factory=list)  # this step's draft

    def observe(self, accepted: bool) -> None:
        self.acceptance += ACCEPTANCE_WEIGHT * (float(accepted) - self.acceptance)


class Speculator:
    """Drafts for prompt lookup (`--speculative-model [ngram]`) with up to `k_max` tokens a step."""

    def __init__(self, k_max: int, n_min: int, n_max: int) -> None:
        self.k_max, self.n_min, self.n_max = k_max, n_min, n_max

    def begin(self) -> Speculation:
        return Speculation(NgramIndex(self.n_min, self.n_max))

    def draft(self, spec: Speculation, prompt: list[int], output: list[int], room: int, batch: int = 1) -> list[int]:
        """The tokens to verify this step (at most `room`: what the request may still generate and its window
        hold, less the one token every step yields), after its `prompt` and `output` so far (the index catches up
        with them), in a step of `batch` requests. Sets `spec.shadow` where it proposes but drafts nothing."""
        indexed = len(spec.index.tokens)
        if indexed < len(prompt):
            spec.index.extend(prompt[indexed:])
            indexed = len(prompt)
        spec.index.extend(output[indexed - len(prompt):])
        proposal = spec.index.propose(min(self.k_max, room))
        k = best_k(spec.acceptance, len(proposal), batch)
        spec.drafted = proposal[:k]
        spec.shadow = proposal[0] if proposal and not k else None
        return spec.drafted

    @staticmethod
    def verified(spec: Speculation, accepted: int) -> None:
        """`accepted` of this step's drafted tokens were taken (the first rejection ends the draft's trials)."""
        for i in range(min(accepted + 1, len(spec.drafted))):
            spec.observe(i < accepted)

    @staticmethod
    def chose(spec: Speculation, token: int) -> None:
        """A step that drafted nothing chose `token`: compared with what its proposal would have drafted."""
        if spec.shadow is not None:
            spec.observe(token == spec.shadow)
            spec.shadow = None
