"""Sampling: pure functions over logits plus an explicit generator, and the batched `Sampler` the engine and the
reference loop both use (the parameters they apply, validated, are `SamplingParams` in model/sampling_params.py;
the offline command `python -m model.generate` is model/generate.py).

Order of operations for one next-token choice (the same for every caller: all go through `Sampler`):

1. ids the tokenizer cannot decode (a padded vocabulary, e.g. 50257..50303) get -inf;
2. logit bias: each (id, bias) of `logit_bias` is added (OpenAI: -100 bans an id, 100 all but forces it);
3. min_tokens: while fewer than `min_tokens` tokens were generated, EOS gets -inf;
4. repetition penalty (CTRL / Hugging Face): for every id already in the context (prompt and output), a
   positive logit is divided by the penalty and a negative one multiplied by it;
5. presence and frequency penalties (OpenAI): for every id generated so far, `presence_penalty` once and
   `frequency_penalty` times its count are subtracted (the prompt does not count);
6. structured output: the ids the row's constraint does not allow next (`SampleRow.allowed`, from its grammar's
   matcher: model/structured/) get -inf, last, so that no bias or penalty can bring one back;
7. greedy decoding (see `SamplingParams.is_greedy`) takes the argmax here, and stops;
8. temperature divides the logits;
9. top-k keeps the k largest logits (ties at the k-th value are kept);
10. top-p keeps the smallest set of most likely tokens whose probability reaches p (at least one);
11. min-p keeps the tokens at least `min_p` times as likely as the most likely one;
12. softmax over what is left, one draw from the request's own `torch.Generator`.

Reported log-probabilities are the model's own: log-softmax of the logits after step 1 only, so they do
not depend on the repetition penalty, the constraint, temperature, top-k or top-p; a row's top-n alternatives
are the n largest of them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from model.devices import to_device
from model.kernels.ops import row_argmax_logsumexp
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
    """Step 4, on a 1-D logits vector; `context` holds the ids seen so far (prompt and output). The result stays
    finite: a tiny penalty (which favours repetition) divides a positive logit towards the largest float."""
    if penalty == 1.0 or context.numel() == 0:
        return logits
    logits = logits.clone()
    ids = context.unique()
    picked = logits[ids]
    biggest = torch.finfo(logits.dtype).max
    logits[ids] = torch.where(picked > 0, picked / penalty, picked * penalty).clamp(-biggest, biggest)
    return logits


def apply_presence_frequency(logits: torch.Tensor, output: Sequence[int], presence: float,
                             frequency: float) -> torch.Tensor:
    """Step 5, on a 1-D logits vector: OpenAI's penalties over the ids generated so far (`output`)."""
    if not output or not (presence or frequency):
        return logits
    counts = torch.bincount(to_device(list(output), logits.device), minlength=logits.size(-1))
    counts = counts[: logits.size(-1)].to(logits.dtype)
    return logits - presence * (counts > 0).to(logits.dtype) - frequency * counts


def top_k_filter(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Step 9: keep logits >= the k-th largest; the rest become -inf."""
    if not k or k >= logits.size(-1):
        return logits
    kth = torch.topk(logits, k).values[..., -1:]
    return logits.masked_fill(logits < kth, float("-inf"))


def top_p_filter(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Step 10: keep the smallest most-likely set whose probability mass reaches p (always >= 1 token)."""
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


def min_p_filter(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Step 11: keep the tokens whose probability is at least `p` times the largest (always >= 1 token)."""
    if not p:
        return logits
    probs = torch.softmax(logits, dim=-1)
    return logits.masked_fill(probs < p * probs.amax(dim=-1, keepdim=True), float("-inf"))


def sampling_distribution(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Steps 8-12 up to the softmax: the exact distribution a sampled token is drawn from."""
    temperature = params.temperature if params.temperature is not None else 1.0
    # shifted by the maximum first (softmax does that anyway), so that dividing by a tiny temperature takes
    # logits towards -inf, never to +inf (inf - inf would make the softmax NaN); a temperature below the dtype's
    # smallest normal number would round to 0 in the division and is taken as that number
    temperature = max(temperature, torch.finfo(logits.dtype).tiny)
    logits = (logits - logits.amax(dim=-1, keepdim=True)) / temperature
    logits = top_k_filter(logits, params.top_k or 0)
    logits = top_p_filter(logits, params.top_p if params.top_p is not None else 1.0)
    logits = min_p_filter(logits, params.min_p or 0.0)
    return torch.softmax(logits, dim=-1)


@dataclass(frozen=True)
class SampleRow:
    """What the sampler needs of one row besides its logits."""

    params: SamplingParams
    generator: torch.Generator | None = None  # the request's own, for sampled rows
    history: Sequence[int] = ()  # every id seen so far (prompt and output), for the repetition penalty
    output: Sequence[int] = ()  # the ids generated so far, for min_tokens and the presence/frequency penalties
    allowed: torch.Tensor | None = None  # structured output: which ids may come next (bool, the logits' width)


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

    def __init__(self, n_vocab: int, eos_id: int | None = None) -> None:
        self.n_vocab = n_vocab
        self.eos_id = eos_id

    def __call__(self, logits: torch.Tensor, rows: Sequence[SampleRow]) -> SamplerOutput:
        masked = mask_unusable(logits.float(), self.n_vocab)  # step 1, once for the batch
        # each row's argmax and log-sum-exp in one pass (a log-probability is a logit minus the latter)
        argmax, lse = row_argmax_logsumexp(masked)
        chosen, errors = self._choose(masked, rows, argmax)
        return self._output(masked, lse, rows, chosen, errors)

    def verify(self, logits: torch.Tensor, rows: Sequence[SampleRow], draft: Sequence[int]) -> SamplerOutput:
        """Speculative decoding: which of one request's `draft` tokens it takes, and its next token after them.
        `logits[i]` (len(draft) + 1 positions) are the model's after the request's tokens and draft[:i], `rows[i]`
        its `SampleRow` there (history and output holding draft[:i]). The tokens out are the accepted draft tokens
        then one token of the model's own (or fewer where a row's choice failed: its error is then in `errors`).

        Each position's token is chosen exactly as `__call__` would choose it there (steps 1-12, the same draw from
        the request's generator), and a drafted token is accepted where it is that token; the first position whose
        token differs from the draft ends the step with that token. Greedy, that is plain greedy decoding. Sampled,
        it is rejection sampling with a point-mass draft t (Leviathan et al. 2023): t is accepted with probability
        p(t), and when it is not, the token is distributed as p with t removed, renormalised; drawn this way, the
        draws are moreover the ones plain sampling makes, one per token kept, so a seeded request gives the same
        text with or without speculation, whatever was drafted."""
        masked = mask_unusable(logits.float(), self.n_vocab)
        argmax, lse = row_argmax_logsumexp(masked)
        picks = argmax.tolist()  # each position's choice decides whether the next is looked at: one wait each step
        tokens: list[int] = []
        errors: dict[int, Exception] = {}
        for i, row in enumerate(rows):
            drafted = draft[i] if i < len(draft) else None
            try:
                token = self._verify_one(masked[i], row, picks[i])
            except Exception as e:  # this position's own failure: the request fails, the batch does not
                errors[len(tokens)] = e
                tokens.append(-1)
                break
            tokens.append(token)
            if token != drafted:
                break
        used = len(tokens)
        chosen = to_device([max(t, 0) for t in tokens], masked.device)
        return self._output(masked[:used], lse[:used], rows[:used], chosen, errors)

    def _verify_one(self, logits: torch.Tensor, row: SampleRow, argmax: int) -> int:
        """One position of `verify`: the token `__call__` would choose there."""
        adjusted = adjust(logits, row, self.eos_id)
        if row.params.is_greedy:
            return argmax if adjusted is logits else int(adjusted.argmax())
        return int(sample_row(adjusted, row))

    @staticmethod
    def _output(masked: torch.Tensor, lse: torch.Tensor, rows: Sequence[SampleRow], chosen: torch.Tensor,
                errors: dict[int, Exception]) -> SamplerOutput:
        """The chosen tokens (`chosen`, on the device) with their log-probabilities and each row's top-n
        alternatives, brought to the host together: the pass's one wait for the device. A sampled row whose chosen
        token's log-probability is NaN or infinite drew from logits holding NaN or infinity, which are no
        distribution: it fails, the others do not (as `torch.multinomial` refused them). A greedy row still takes
        its argmax, reported with that log-probability (null over HTTP)."""
        n = len(rows)
        parts = [chosen.double(), (masked.gather(1, chosen[:, None])[:, 0] - lse).double()]
        tops = []  # (which rows, n) per distinct n (usually one)
        for k in sorted({r.params.top_n_tokens for r in rows} - {0}):
            which = [i for i, r in enumerate(rows) if r.params.top_n_tokens == k]
            index = slice(None) if len(which) == n else to_device(which, masked.device)
            values, ids = torch.topk(masked[index], k)
            parts += [(values - lse[index, None]).double().reshape(-1), ids.double().reshape(-1)]
            tops.append((which, k))
        host = torch.cat(parts).tolist()
        tokens = [-1 if i in errors else int(t) for i, t in enumerate(host[:n])]
        out = SamplerOutput(tokens, host[n: 2 * n], [[] for _ in rows], errors)
        for i, logprob in enumerate(out.logprobs):
            if i not in errors and not rows[i].params.is_greedy and not -math.inf <= logprob < math.inf:
                errors[i] = FloatingPointError("cannot sample: the model's logits for this row hold NaN or infinity")
                tokens[i] = -1
        at = 2 * n
        for which, k in tops:
            values, ids = host[at: at + len(which) * k], host[at + len(which) * k: at + 2 * len(which) * k]
            at += 2 * len(which) * k
            for j, i in enumerate(which):
                out.top[i] = [(int(t), v) for t, v in zip(ids[j * k: (j + 1) * k], values[j * k: (j + 1) * k])]
        return out

    def _choose(self, masked: torch.Tensor, rows: Sequence[SampleRow],
                argmax: torch.Tensor) -> tuple[torch.Tensor, dict[int, Exception]]:
        """Every row's token, on the device (nothing here waits for it): the argmax for greedy rows, after adjusting
        the rows that need it; a draw for sampled rows. A row whose choice raised keeps the argmax, its error in the
        dict."""
        picks: dict[int, torch.Tensor] = {}  # the rows whose token is not the plain argmax: their token
        errors: dict[int, Exception] = {}
        adjusted = [i for i, r in enumerate(rows) if r.params.is_greedy and _adjusts(r, self.eos_id)]
        if adjusted:
            picked = torch.stack([adjust(masked[i], rows[i], self.eos_id) for i in adjusted])
            picks.update(zip(adjusted, picked.argmax(dim=-1).unbind()))
        for i, row in enumerate(rows):
            if not row.params.is_greedy:
                try:
                    picks[i] = sample_row(adjust(masked[i], row, self.eos_id), row)
                except Exception as e:  # this row's own failure: it alone fails
                    errors[i] = e
        if not picks:
            return argmax, errors
        chosen = argmax.clone()
        chosen[to_device(list(picks), masked.device)] = torch.stack(list(picks.values()))
        return chosen, errors


def _adjusts(row: SampleRow, eos_id: int | None) -> bool:
    p = row.params
    return bool(row.allowed is not None or p.logit_bias or (p.repetition_penalty not in (None, 1.0) and row.history)
                or ((p.presence_penalty or p.frequency_penalty) and row.output)
                or (eos_id is not None and len(row.output) < p.min_tokens))


def adjust(logits: torch.Tensor, row: SampleRow, eos_id: int | None) -> torch.Tensor:
    """Steps 2-6 for one row's masked logits (the same tensor when none applies)."""
    if not _adjusts(row, eos_id):
        return logits
    p = row.params
    logits = logits.clone()
    for token, bias in p.logit_bias:
        if token < logits.size(-1):
            logits[token] += bias
    if eos_id is not None and len(row.output) < p.min_tokens:
        logits[eos_id] = float("-inf")
    if p.repetition_penalty not in (None, 1.0) and row.history:
        context = to_device(list(row.history), logits.device)
        logits = apply_repetition_penalty(logits, context, p.repetition_penalty)
    logits = apply_presence_frequency(logits, row.output, p.presence_penalty, p.frequency_penalty)
    if row.allowed is not None:
        logits = logits.masked_fill(~row.allowed, float("-inf"))
    return logits


def sample_row(logits: torch.Tensor, row: SampleRow) -> torch.Tensor:
    """Steps 8-12 for one sampled row, from its logits after steps 1-6: the token, a 0-d tensor on their device."""
    return draw(sampling_distribution(logits, row.params), row.generator)


def draw(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One id drawn from the distribution `probs` (1-D), a 0-d tensor on its device: `torch.multinomial(probs, 1)`'s
    own method (an exponential race: the argmax of probs / q, q exponentially distributed), so the same id from the
    same generator state, without multinomial's check of `probs`, which waits for the device (the sampler checks the
    drawn ids' log-probabilities instead, with the step's one wait)."""
    q = torch.empty_like(probs).exponential_(1, generator=generator)
    return (probs / q).argmax()


def choose_token(
    logits: torch.Tensor,
    params: SamplingParams,
    *,
    n_vocab: int,
    context: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    output: Sequence[int] = (),
    eos_id: int | None = None,
) -> int:
    """The next token id from a 1-D logits vector (steps 1-12): `Sampler` for one row. `context` holds every id
    seen so far (prompt and output), `output` the generated ones."""
    history = () if context is None else context.tolist()
    out = Sampler(n_vocab, eos_id)(logits[None], [SampleRow(params, generator, history, output)])
    if out.errors:
        raise out.errors[0]
    return out.tokens[0]
