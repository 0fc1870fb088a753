"""Sampling: pure functions over logits plus an explicit generator, and the batched `Sampler` the engine and the
reference loop both use (the parameters they apply, validated, are `SamplingParams` in model/sampling_params.py;
the offline command `python -m model.generate` is model/generate.py).

Order of operations for one next-token choice (the same for every caller: all go through `Sampler`):

1. ids the tokenizer cannot decode (a padded vocabulary, e.g. 50257..50303) are left out (a view of the others);
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
from model.kernels import ops
from model.kernels.ops import row_argmax_logsumexp
from model.sampling_params import SamplingParams


def new_generator(seed: int) -> torch.Generator:
    """A request's own generator. It lives on the host whatever the model's device: a sampled token takes one
    uniform number from it (`uniforms`), drawn there and copied to the device with the step's other numbers, not a
    launch per row; and a seed draws the same numbers on every device."""
    return torch.Generator().manual_seed(seed)


def usable_logits(logits: torch.Tensor, n_vocab: int) -> torch.Tensor:
    """Step 1: the logits of ids < n_vocab, a view (no copy): the ids past them (a padded vocabulary) can never be
    chosen, and probabilities are over the ids the tokenizer can decode. The ids keep their numbers."""
    return logits[..., :n_vocab] if logits.size(-1) > n_vocab else logits


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


def top_k_filter(logits: torch.Tensor, k: int | Sequence[int]) -> torch.Tensor:
    """Step 9: keep logits >= the k-th largest; the rest become -inf. `k`: one for every row of `logits`, or one per
    row of 2-D logits (0, or at least the width: that row is left alone)."""
    rows = _as_rows(logits)
    ks = [k if 0 < k < rows.size(-1) else 0 for k in _per_row(k, rows)]
    if not any(ks):
        return logits
    values = torch.topk(rows, max(ks)).values
    kth = values.gather(-1, to_device([[max(k, 1) - 1] for k in ks], rows.device))
    if not all(ks):
        kth = kth.masked_fill(to_device([[k == 0] for k in ks], rows.device, torch.bool), float("-inf"))
    return logits.masked_fill(logits < kth.view_as(logits[..., :1]), float("-inf"))


def top_p_filter(logits: torch.Tensor, p: float | Sequence[float]) -> torch.Tensor:
    """Step 10: keep the smallest most-likely set whose probability mass reaches p (always >= 1 token). `p`: one for
    every row, or one per row of 2-D logits (1 or more: that row is left alone)."""
    rows = _as_rows(logits)
    ps = [p if p < 1.0 else math.inf for p in _per_row(p, rows)]
    if all(p == math.inf for p in ps):
        return logits
    drop = _top_p_drop(torch.softmax(rows, dim=-1), to_device([[p] for p in ps], rows.device, rows.dtype))
    return logits.masked_fill(drop.view_as(logits), float("-inf"))


def _top_p_drop(probs: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """Which ids top-p drops (True), for rows of probabilities and each row's p, (rows, 1): every row sorted, ties
    ranked by id (a stable sort; the CPU kernel ranks them so). A token is dropped when the mass strictly before it
    already reaches p; the most likely one never is (a p below float32's smallest positive number compares as 0,
    and the mass before the first token is 0). Nothing waits for the device. On the CPU the kernels find the same
    ids without sorting (`model.kernels.ops.sample_rows`): this serves a GPU, and a CPU without them."""
    sorted_probs, order = torch.sort(probs, descending=True, stable=True)
    drop_sorted = (sorted_probs.cumsum(-1) - sorted_probs) >= p
    drop_sorted[..., 0] = False
    return torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)


def min_p_filter(logits: torch.Tensor, p: float | Sequence[float]) -> torch.Tensor:
    """Step 11: keep the tokens whose probability is at least `p` times the largest (always >= 1 token). `p`: one
    for every row, or one per row of 2-D logits (0: that row is left alone)."""
    rows = _as_rows(logits)
    ps = _per_row(p, rows)
    if not any(ps):
        return logits
    probs = torch.softmax(rows, dim=-1)
    floor = to_device([[p] for p in ps], rows.device, probs.dtype) * probs.amax(dim=-1, keepdim=True)
    return logits.masked_fill((probs < floor).view_as(logits), float("-inf"))


def _as_rows(logits: torch.Tensor) -> torch.Tensor:
    """1-D logits as one row, 2-D as they are."""
    return logits.view(-1, logits.size(-1))


def _per_row(value: object, rows: torch.Tensor) -> list:
    """A parameter for each row of `rows`: one given for all (anything but a sequence), or a sequence of one per
    row."""
    if not isinstance(value, Sequence):
        return [value] * rows.size(0)
    if len(value) != rows.size(0):
        raise ValueError(f"one parameter per row: {len(value)} for {rows.size(0)} rows")
    return list(value)


def sampling_distribution(logits: torch.Tensor, params: SamplingParams | Sequence[SamplingParams]) -> torch.Tensor:
    """Steps 8-12 up to the softmax: the exact distribution a sampled token is drawn from. `params`: one for every
    row of `logits`, or one per row of 2-D logits (rows of different parameters filtered together: each filter
    runs once for all of them, on the rows that use it)."""
    rows = _as_rows(logits)
    every = _per_row(params, rows)
    # shifted by the maximum first (softmax does that anyway), so that dividing by a tiny temperature takes
    # logits towards -inf, never to +inf (inf - inf would make the softmax NaN); a temperature below the dtype's
    # smallest normal number would round to 0 in the division and is taken as that number
    tiny = torch.finfo(rows.dtype).tiny
    temperatures = [max(p.temperature if p.temperature is not None else 1.0, tiny) for p in every]
    shifted = rows - rows.amax(dim=-1, keepdim=True)
    if any(t != 1.0 for t in temperatures):
        shifted = shifted / to_device([[t] for t in temperatures], rows.device, rows.dtype)
    shifted = top_k_filter(shifted, [p.top_k or 0 for p in every])
    shifted = top_p_filter(shifted, [p.top_p if p.top_p is not None else 1.0 for p in every])
    shifted = min_p_filter(shifted, [p.min_p or 0.0 for p in every])
    return torch.softmax(shifted, dim=-1).view_as(logits)


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
    that have one); sampled rows are filtered together (each filter once, with a parameter per row) and each draws
    one number from its own generator, so a seeded request draws the same tokens alone or in any batch.
    """

    def __init__(self, n_vocab: int, eos_id: int | None = None) -> None:
        self.n_vocab = n_vocab
        self.eos_id = eos_id

    def __call__(self, logits: torch.Tensor, rows: Sequence[SampleRow]) -> SamplerOutput:
        masked = usable_logits(logits.float(), self.n_vocab)  # step 1, once for the batch
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
        masked = usable_logits(logits.float(), self.n_vocab)
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
        the rows that need it; a draw for sampled rows, all filtered together and each drawn from its own generator.
        A row whose adjustment raised keeps the argmax, its error in the dict."""
        errors: dict[int, Exception] = {}
        greedy: dict[int, torch.Tensor] = {}  # greedy rows whose logits were adjusted: their logits
        sampled: dict[int, torch.Tensor] = {}  # sampled rows: their logits, adjusted where they need it
        for i, row in enumerate(rows):
            if row.params.is_greedy and not _adjusts(row, self.eos_id):
                continue
            try:  # steps 2-5 (6, the constraints, below: all the rows' at once)
                logits = adjust(masked[i], row, self.eos_id, constrain=False)
            except Exception as e:  # this row's own failure: it alone fails
                errors[i] = e
                continue
            (greedy if row.params.is_greedy else sampled)[i] = logits
        picks = []  # (which rows, their tokens)
        if greedy:
            logits = torch.stack(list(greedy.values()))
            _constrain(logits, [rows[i] for i in greedy])
            picks.append((list(greedy), logits.argmax(dim=-1)))
        if sampled:
            which = list(sampled)
            # every row sampled and none adjusted: their logits as they are, not a copy
            plain = len(which) == len(rows) and not any(_adjusts(rows[i], self.eos_id) for i in which)
            logits = masked if plain else torch.stack(list(sampled.values()))
            _constrain(logits, [rows[i] for i in which])
            picks.append((which, sample(logits, [rows[i].params for i in which], [rows[i].generator for i in which])))
        if not picks:
            return argmax, errors
        chosen = argmax.clone()
        for which, tokens in picks:
            chosen[to_device(which, masked.device)] = tokens
        return chosen, errors


def _constrain(logits: torch.Tensor, rows: Sequence[SampleRow]) -> None:
    """Step 6 for rows of logits (a copy of the caller's), in place, every constrained row's mask in one call: a row's
    mask, one at a time, took 0.15 ms of a 50,257-id row with torch's masked_fill on one core of an AMD EPYC."""
    which = [j for j, row in enumerate(rows) if row.allowed is not None]
    if which:
        width = logits.size(-1)  # the usable ids' part of each mask
        ops.fill_disallowed(logits, which, torch.stack([rows[j].allowed[:width] for j in which]))


def _adjusts(row: SampleRow, eos_id: int | None) -> bool:
    """Whether any of steps 2-6 applies to the row."""
    return row.allowed is not None or _penalises(row, eos_id)


def _penalises(row: SampleRow, eos_id: int | None) -> bool:
    """Whether any of steps 2-5 applies to the row."""
    p = row.params
    return bool(p.logit_bias or (p.repetition_penalty not in (None, 1.0) and row.history)
                or ((p.presence_penalty or p.frequency_penalty) and row.output)
                or (eos_id is not None and len(row.output) < p.min_tokens))


def adjust(logits: torch.Tensor, row: SampleRow, eos_id: int | None, *, constrain: bool = True) -> torch.Tensor:
    """Steps 2-6 for one row's usable logits (the same tensor when none applies); without step 6 where `constrain`
    is false (the `Sampler` constrains a step's rows together)."""
    p = row.params
    if not (_penalises(row, eos_id) or (constrain and row.allowed is not None)):
        return logits
    logits = logits.clone()
    for token, bias in p.logit_bias:
        if token < logits.size(-1):
            logits[token] += bias
    if eos_id is not None and len(row.output) < p.min_tokens:
        logits[eos_id] = float("-inf")
    if p.repetition_penalty not in (None, 1.0) and row.history:
        # ids past the usable vocabulary (a prompt may hold a padded id) have no logit to penalise
        context = to_device([t for t in row.history if t < logits.size(-1)], logits.device)
        logits = apply_repetition_penalty(logits, context, p.repetition_penalty)
    logits = apply_presence_frequency(logits, row.output, p.presence_penalty, p.frequency_penalty)
    if constrain and row.allowed is not None:  # the vocabulary's width: its usable ids' part
        logits = logits.masked_fill(~row.allowed[: logits.size(-1)].to(logits.device), float("-inf"))
    return logits


def sample_row(logits: torch.Tensor, row: SampleRow) -> torch.Tensor:
    """Steps 8-12 for one sampled row, from its logits after steps 1-6: the token, a 0-d tensor on their device."""
    return sample(logits[None], [row.params], [row.generator])[0]


def sample(logits: torch.Tensor, params: Sequence[SamplingParams],
           generators: Sequence[torch.Generator | None]) -> torch.Tensor:
    """Steps 8-12 for rows of logits (rows, vocab) after steps 1-6, row i with `params[i]` and a uniform number from
    `generators[i]`: an id per row, on their device. On the CPU the kernels draw each row in one pass without
    sorting it (`model.kernels.ops.sample_rows`); elsewhere `draw` from `sampling_distribution`. Both are the
    inverse cumulative distribution at the same number: the same id, up to float rounding at a boundary."""
    u = uniforms(generators)
    tiny = torch.finfo(torch.float32).tiny
    ids = ops.sample_rows(logits, [max(p.temperature if p.temperature is not None else 1.0, tiny) for p in params],
                          [p.top_k or 0 for p in params], [p.top_p if p.top_p is not None else 1.0 for p in params],
                          [p.min_p or 0.0 for p in params], u)
    return ids if ids is not None else draw(sampling_distribution(logits, params), u)


def uniforms(generators: Sequence[torch.Generator | None]) -> list[float]:
    """One uniform number in [0, 1) from each generator (None: torch's default one), in float64, on the host."""
    return [float(torch.rand((), dtype=torch.float64, generator=gen)) for gen in generators]


def draw(probs: torch.Tensor, u: float | Sequence[float]) -> torch.Tensor:
    """One id drawn from each row of the distributions `probs` (1-D: one number, a 0-d tensor out; 2-D: one per
    row, one id per row out), on their device, by inverting the row's cumulative distribution at the row's uniform
    number u in [0, 1) (`uniforms`): the first id whose cumulative probability reaches (1 - u) times the row's total
    (in float64, so the sum's rounding is far below any probability that can be drawn; 1 - u is never 0, so an id
    of probability 0 is never the first to reach it). One number per row, where `torch.multinomial`'s exponential
    race draws one per id: 0.73 ms of a 50,304-id row on one core of an AMD EPYC, where the cumulative sum takes
    0.04 (`bench/sampling.py`). Nothing waits for the device (multinomial checks `probs` first; the sampler checks
    the drawn ids' log-probabilities instead, with the step's one wait)."""
    rows = _as_rows(probs)
    cumulative = rows.double().cumsum(-1)
    reach = (1 - to_device(_per_row(u, rows), rows.device, torch.float64))[:, None] * cumulative[:, -1:]
    # NaN rows reach no id: the last is taken, and the sampler fails them by their log-probability
    ids = torch.searchsorted(cumulative, reach).clamp_(max=rows.size(-1) - 1)
    return ids.view(probs.shape[:-1])


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
