"""Sampling: validated parameters, pure functions over logits plus an explicit generator, and the batched
`Sampler` the engine and the reference loop both use.

Order of operations for one next-token choice (the same for every caller: all go through `Sampler`):

1. ids the tokenizer cannot decode (a padded vocabulary, e.g. 50257..50303) get -inf;
2. repetition penalty (CTRL / Hugging Face): for every id already in the context, a positive logit is
   divided by the penalty and a negative one multiplied by it;
3. greedy decoding (see `SamplingParams.is_greedy`) takes the argmax here, and stops;
4. temperature divides the logits;
5. top-k keeps the k largest logits (ties at the k-th value are kept);
6. top-p keeps the smallest set of most likely tokens whose probability reaches p (at least one);
7. softmax over what is left, one draw from the request's own `torch.Generator`.

Reported log-probabilities are the model's own: log-softmax of the logits after step 1 only, so they do
not depend on the repetition penalty, temperature, top-k or top-p; a row's top-n alternatives are the n
largest of them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from model.sampling_params import SamplingParams


def new_generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


def mask_unusable(logits: torch.Tensor, n_vocab: int) -> torch.Tensor:
    """Step 1: ids >= n_vocab (a padded vocabulary) can never be chosen."""
    if logits.size(-1) > n_vocab:
        logits = logits.clone()
        logits[..., n_vocab:] = float("-inf")
    return logits


def apply_repetition_penalty(logits: torch.Tensor, context: torch.Tensor, penalty: float) -> torch.Tensor:
    """Step 2, on a 1-D logits vector; `context` holds the ids seen so far (prompt and output). The result stays
    finite: a tiny penalty (which favours repetition) divides a positive logit towards the largest float."""
    if penalty == 1.0 or context.numel() == 0:
        return logits
    logits = logits.clone()
    ids = context.unique()
    picked = logits[ids]
    biggest = torch.finfo(logits.dtype).max
    logits[ids] = torch.where(picked > 0, picked / penalty, picked * penalty).clamp(-biggest, biggest)
    return logits


def top_k_filter(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Step 5: keep logits >= the k-th largest; the rest become -inf."""
    if not k or k >= logits.size(-1):
        return logits
    kth = torch.topk(logits, k).values[..., -1:]
    return logits.masked_fill(logits < kth, float("-inf"))


def top_p_filter(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Step 6: keep the smallest most-likely set whose probability mass reaches p (always >= 1 token)."""
    if p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, descending=True)
    probs = torch.softmax(sorted_logits, dim=-1)
    # a token is dropped when the mass strictly before it already reaches p; the most likely one never is (a p
    # below float32's smallest positive number compares as 0, and the mass before the first token is 0)
    drop_sorted = (probs.cumsum(-1) - probs) >= p
    drop_sorted[..., 0] = False
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def sampling_distribution(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Steps 4-7 up to the softmax: the exact distribution a sampled token is drawn from."""
    temperature = params.temperature if params.temperature is not None else 1.0
    # shifted by the maximum first (softmax does that anyway), so that dividing by a tiny temperature takes
    # logits towards -inf, never to +inf (inf - inf would make the softmax NaN); a temperature below the dtype's
    # smallest normal number would round to 0 in the division and is taken as that number
    temperature = max(temperature, torch.finfo(logits.dtype).tiny)
    logits = (logits - logits.amax(dim=-1, keepdim=True)) / temperature
    logits = top_k_filter(logits, params.top_k or 0)
    logits = top_p_filter(logits, params.top_p if params.top_p is not None else 1.0)
    return torch.softmax(logits, dim=-1)


@dataclass(frozen=True)
class SampleRow:
    """What the sampler needs of one row besides its logits."""

    params: SamplingParams
    generator: torch.Generator | None = None  # the request's own, for sampled rows
    history: Sequence[int] = ()  # every id seen so far (prompt and output), for the repetition penalty


@dataclass
class SamplerOutput:
    """Per row: the chosen id, its log-probability, the top-n alternatives [(id, logprob)], or the error that
    row's choice raised (its token is then -1; the other rows are unaffected)."""

    tokens: list[int]
    logprobs: list[float]
    top: list[list[tuple[int, float]]]
    errors: dict[int, Exception] = field(default_factory=dict)


class Sampler:
    """One batched pass over the logits of every row: ids, their log-probabilities and top-n alternatives out.

    Greedy rows choose together (one argmax over all of them, the repetition penalty applied first to the rows
    that have one); sampled rows draw one at a time from their own generator, so a seeded request draws the same
    tokens alone or in any batch.
    """

    def __init__(self, n_vocab: int) -> None:
        self.n_vocab = n_vocab

    def __call__(self, logits: torch.Tensor, rows: Sequence[SampleRow]) -> SamplerOutput:
        masked = mask_unusable(logits.float(), self.n_vocab)  # step 1, once for the batch
        logprobs = torch.log_softmax(masked, dim=-1)
        tokens, errors = self._choose(masked, rows)
        chosen = torch.tensor([max(t, 0) for t in tokens], device=logprobs.device)
        out = SamplerOutput(tokens, logprobs.gather(1, chosen[:, None])[:, 0].tolist(), [[] for _ in rows], errors)
        for n in {r.params.top_n_tokens for r in rows} - {0}:  # one topk per distinct n (usually one)
            which = [i for i, r in enumerate(rows) if r.params.top_n_tokens == n]
            values, ids = torch.topk(logprobs[which], n)
            for i, v, t in zip(which, values.tolist(), ids.tolist()):
                out.top[i] = list(zip(t, v))
        return out

    def _choose(self, masked: torch.Tensor, rows: Sequence[SampleRow]) -> tuple[list[int], dict[int, Exception]]:
        tokens = [-1] * len(rows)
        errors: dict[int, Exception] = {}
        greedy = [i for i, r in enumerate(rows) if r.params.is_greedy]
        if greedy:
            picked = masked[greedy] if len(greedy) < len(rows) else masked
            penalised = [(k, i) for k, i in enumerate(greedy) if _penalty(rows[i]) is not None]
            if penalised:
                picked = picked.clone()
                for k, i in penalised:
                    picked[k] = _penalise(picked[k], rows[i])
            for i, t in zip(greedy, picked.argmax(dim=-1).tolist()):
                tokens[i] = t
        for i, row in enumerate(rows):
            if not row.params.is_greedy:
                try:
                    tokens[i] = sample_row(masked[i], row)
                except Exception as e:  # this row's own failure: it alone fails
                    errors[i] = e
        return tokens, errors


def _penalty(row: SampleRow) -> float | None:
    p = row.params.repetition_penalty
    return None if p in (None, 1.0) or not row.history else p


def _penalise(logits: torch.Tensor, row: SampleRow) -> torch.Tensor:
    """Step 2 for one row."""
    penalty = _penalty(row)
    if penalty is None:
        return logits
    return apply_repetition_penalty(logits, torch.tensor(list(row.history), device=logits.device), penalty)


def sample_row(masked: torch.Tensor, row: SampleRow) -> int:
    """Steps 2 and 4-7 for one sampled row, from its logits already masked (step 1)."""
    probs = sampling_distribution(_penalise(masked, row), row.params)
    return int(torch.multinomial(probs, 1, generator=row.generator))


def choose_token(
    logits: torch.Tensor,
    params: SamplingParams,
    *,
    n_vocab: int,
    context: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
) -> int:
    """The next token id from a 1-D logits vector (steps 1-7): `Sampler` for one row."""
    history = () if context is None else context.tolist()
    out = Sampler(n_vocab)(logits[None], [SampleRow(params, generator, history)])
    if out.errors:
        raise out.errors[0]
    return out.tokens[0]
