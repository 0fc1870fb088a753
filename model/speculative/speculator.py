"""Which tokens each request drafts in a decode step, and how many: `Speculator` (one per engine), `Speculation` (one
per request that speculates) and `Proposer`, where drafts come from.

Two proposers draft: prompt lookup (`ngram.NgramProposer`, an `NgramIndex` over each request's prompt and output)
and a draft model (`draft.DraftModelProposer`, a smaller model with the same tokenizer, run greedily). How many
tokens a request verifies, k, is chosen per request and per step from an estimate of its acceptance rate a (the
chance that the model takes a drafted token): verifying k tokens yields 1 + a + ... + a^k tokens on average (every
accepted token, and the model's own after the first rejection or the last draft) for a step that costs about
1 + VERIFY_COST + (ROW_COST + c) * k plain steps at batch 1, where c is what the proposer spends on a drafted token
(`Proposer.token_cost`: 0 for prompt lookup; a draft model's own step, measured against the served model's), so k is
the one that maximises their ratio, 0 (plain decoding) where no draft pays. In a batch of n requests a plain step
yields n tokens for about what one costs, and a request's drafting and verification slow all of them: its costs
count n times, so requests speculate only with drafts taken ever more often as the batch grows (vLLM turns
speculation off above a batch size instead). The estimate is an exponential moving average over every drafted
position verified, and over probes of the steps that do not speculate: a one-token proposal compared with the token
the model chose (for a sampled request that match has the acceptance's own probability, p(draft)), every so many
steps that the batch's probing costs about PROBE_BUDGET of a plain step on average (`probe_every`); so a request
whose drafts stopped being taken (k fell to 0) speculates again once they would be. What a probe costs is measured
as the engine runs (`Speculator.probe_cost`: the proposals' seconds a request against the plain steps' seconds,
moving averages), since it is more than a drafted token's cost: a draft model first catches up on every token since
the request's last probe; until both are measured, a proposal's own bookkeeping (PROPOSAL_COST) and a drafted token.

k may depend on the batch: what a request generates does not depend on k (`Sampler.verify` chooses every token as
plain decoding does, with the same draws of a seeded request's generator), nor on the proposer.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from model.sampling_params import SamplingParams

# a verifying step's cost beyond a plain one, in plain steps: VERIFY_COST once (the verification's bookkeeping), and
# ROW_COST per drafted token (a row of the forward, its logits and its choice). Measured at batch 1 on the bundled
# model, where a step is ~1 ms and mostly fixed costs, the steps of k = 1, 2, 4, 8 cost 1.10, 1.16, 1.24, 1.47 plain
# ones (greedy; sampled ~0.02 more); a larger model reads its weights once for all rows, so its rows cost less
VERIFY_COST = 0.08
ROW_COST = 0.06
PRIOR_ACCEPTANCE = 0.3  # the estimate before a request's first observation
ACCEPTANCE_WEIGHT = 0.15  # each observation's weight in the moving average
PROBE_BUDGET = 0.02  # what probing the requests that draft nothing may cost, in plain steps per step
# a proposal's own bookkeeping (its request's drafting state, the proposer's call: Python), in plain steps at batch 1:
# measured on the bundled model, whose step is ~1 ms, at ~19 us a request (155 us of a 2.5 ms step of 8 requests
# probed every step, prompt lookup: 8% slower than plain decoding before probes were spaced by the batch)
PROPOSAL_COST = 0.015
TIMING_WEIGHT = 0.1  # each timed step's or probe's weight in the moving averages of their seconds


def probe_every(probe_cost: float, batch: int = 1) -> int:
    """How many steps apart a request that drafts nothing is probed (a one-token proposal), in a batch of `batch`
    requests where probing one costs `probe_cost` plain steps: probing all of them costs at most PROBE_BUDGET of a
    plain step per step on average (every step for prompt lookup at batch 1)."""
    return max(1, math.ceil(batch * probe_cost / PROBE_BUDGET))


def _average(average: float | None, value: float) -> float:
    return value if average is None else average + TIMING_WEIGHT * (value - average)


def no_k_pays(acceptance: float, batch: int = 1, token_cost: float = 0.0) -> bool:
    """Whether `best_k` is 0 for want of any drafted token worth its row: a^j <= a, so where a <= batch * (ROW_COST
    + token_cost) no k beats a plain step (a sufficient test, not a necessary one)."""
    return acceptance <= batch * (ROW_COST + token_cost)


def best_k(acceptance: float, k_max: int, batch: int = 1, token_cost: float = 0.0) -> int:
    """The k in [0, k_max] with the most tokens per unit of cost, (1 + a + ... + a^k) / (1 + batch * (VERIFY_COST +
    (ROW_COST + token_cost) * k)) for k >= 1, 1 for k = 0 (a plain step), in a batch of `batch` requests, where a
    drafted token costs `token_cost` plain steps to propose."""
    if no_k_pays(acceptance, batch, token_cost):
        return 0
    best, best_rate, expected, term = 0, 1.0, 1.0, 1.0
    for k in range(1, k_max + 1):
        term *= acceptance
        expected += term
        rate = expected / (1 + batch * (VERIFY_COST + (ROW_COST + token_cost) * k))
        if rate > best_rate:
            best, best_rate = k, rate
    return best


def speculates(params: SamplingParams) -> bool:
    """Whether a request with `params` may speculate: not where it opted out (`speculate=False`), nor where its
    tokens cannot be verified several at a time as the plain path chooses them: under a structured-output constraint
    (its grammar's matcher would have to advance over drafted tokens and back) or with streamed attention (computed
    for one token a step). Those decode plainly, in the same steps as the others."""
    return params.speculate and params.constraint is None and params.attention is None


class Proposer(Protocol):
    """Where drafts come from: per request a state (`begin`), and for the requests drafting in a step, their drafts
    (`propose`, all of them at once: a draft model runs them as one batch)."""

    token_cost: float  # a drafted token's cost, in plain steps of the served model at batch 1

    def begin(self, row: int) -> Any:
        """The drafting state of a request that decodes in cache row `row`."""

    def propose(self, states: Sequence[Any], prompts: Sequence[list[int]], outputs: Sequence[list[int]],
                ks: Sequence[int]) -> list[list[int]]:
        """For each request, `ks[i]` tokens (at most; none where it has no guess) to follow `prompts[i]` and
        `outputs[i]` (the tokens it has taken so far)."""


@dataclass
class Speculation:
    """One request's drafting state: the proposer's, its acceptance estimate and this step's draft."""

    state: Any  # the proposer's (`Proposer.begin`)
    acceptance: float = PRIOR_ACCEPTANCE
    shadow: int | None = None  # the first proposed token of a step that did not speculate, to compare afterwards
    drafted: list[int] = field(default_factory=list)  # this step's draft
    idle: int = 0  # steps since it last drafted or was probed

    def observe(self, accepted: bool) -> None:
        self.acceptance += ACCEPTANCE_WEIGHT * (float(accepted) - self.acceptance)

    def probe_due(self, every: int) -> bool:
        """Whether this step is its probe's, probes coming `every` steps apart (`Speculator.probe_spacing`)."""
        return self.idle + 1 >= every


@dataclass
class Drafting:
    """A speculating request as a step's drafting sees it: its state, its prompt and output so far, and its room
    (what it may still generate and its window hold, less the one token every step yields)."""

    spec: Speculation
    prompt: list[int]
    output: list[int]
    room: int


class Speculator:
    """Drafts from `proposer` (`--speculative-model`) with up to `k_max` tokens a request and step."""

    def __init__(self, proposer: Proposer, k_max: int) -> None:
        self.proposer, self.k_max = proposer, k_max
        self.step_seconds: float | None = None  # a plain step's (one that verified nothing), a moving average
        self.probe_seconds: float | None = None  # a probe's proposal, a request's share of its call

    @property
    def probe_cost(self) -> float:
        """What probing a request costs, in plain steps: measured where both are, else its bookkeeping and a drafted
        token."""
        if self.step_seconds and self.probe_seconds is not None:
            return self.probe_seconds / self.step_seconds
        return self.proposer.token_cost + PROPOSAL_COST

    def probe_spacing(self, batch: int = 1) -> int:
        """How many steps apart requests that draft nothing are probed in a step of `batch` requests."""
        return probe_every(self.probe_cost, batch)

    def stepped(self, seconds: float) -> None:
        """A decode step that verified no draft took `seconds` (its forward and choices: not its proposals)."""
        self.step_seconds = _average(self.step_seconds, seconds)

    def begin(self, row: int) -> Speculation:
        return Speculation(self.proposer.begin(row))

    def may_draft(self, spec: Speculation, batch: int, every: int) -> bool:
        """Whether `spec` may draft or be probed in a step of `batch` requests, probes `every` steps apart (the
        step's `probe_spacing`); where not (`no_k_pays` and its probe is not due), the step counts as idle for it and
        the caller leaves it out of `drafts`, sparing it the per-request bookkeeping."""
        if not no_k_pays(spec.acceptance, batch, self.proposer.token_cost) or spec.probe_due(every):
            return True
        spec.idle += 1
        spec.drafted, spec.shadow = [], None
        return False

    def drafts(self, requests: Sequence[Drafting], batch: int = 1) -> list[list[int]]:
        """The tokens each of `requests` verifies this step (at most its room), in a step of `batch` requests: k
        by `best_k`, or a one-token probe where k is 0 and a probe is due (every `probe_every` steps; kept in
        `spec.shadow`, drafting nothing)."""
        wants, probes = [], []
        every = self.probe_spacing(batch)
        for r in requests:
            spec = r.spec
            k = best_k(spec.acceptance, min(self.k_max, r.room), batch, self.proposer.token_cost)
            probe = not k and r.room > 0 and spec.probe_due(every)
            spec.idle = 0 if k or probe else spec.idle + 1
            wants.append(k or int(probe))
            probes.append(probe)
        asked = [i for i, want in enumerate(wants) if want]
        proposals: list[list[int]] = [[] for _ in requests]
        if asked:
            start = time.perf_counter()
            got = self.proposer.propose([requests[i].spec.state for i in asked], [requests[i].prompt for i in asked],
                                        [requests[i].output for i in asked], [wants[i] for i in asked])
            if all(probes[i] for i in asked):
                self.probe_seconds = _average(self.probe_seconds, (time.perf_counter() - start) / len(asked))
            for i, proposal in zip(asked, got):
                proposals[i] = proposal
        for r, proposal, probe in zip(requests, proposals, probes):
            r.spec.drafted = [] if probe else proposal[: r.room]
            r.spec.shadow = proposal[0] if probe and proposal else None
        return [r.spec.drafted for r in requests]

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
