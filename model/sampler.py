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
from collections.abc import Callable, Sequence
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
    temperatures, top_ks, top_ps, min_ps = _filters(_per_row(params, rows), rows.dtype)
    # shifted by the maximum first (softmax does that anyway), so that dividing by a tiny temperature takes
    # logits towards -inf, never to +inf (inf - inf would make the softmax NaN)
    shifted = rows - rows.amax(dim=-1, keepdim=True)
    if any(t != 1.0 for t in temperatures):
        shifted = shifted / to_device([[t] for t in temperatures], rows.device, rows.dtype)
    shifted = top_k_filter(shifted, top_ks)
    shifted = top_p_filter(shifted, top_ps)
    shifted = min_p_filter(shifted, min_ps)
    return torch.softmax(shifted, dim=-1).view_as(logits)


def _filters(params: Sequence[SamplingParams],
             dtype: torch.dtype) -> tuple[list[float], list[int], list[float], list[float]]:
    """Steps 8-11's parameters per row, unset ones as the value that leaves a row alone: temperatures (1; one below
    `dtype`'s smallest normal number would round to 0 in the division and is taken as that number), top-k (0),
    top-p (1), min-p (0)."""
    tiny = torch.finfo(dtype).tiny
    return ([max(p.temperature if p.temperature is not None else 1.0, tiny) for p in params],
            [p.top_k or 0 for p in params], [p.top_p if p.top_p is not None else 1.0 for p in params],
            [p.min_p or 0.0 for p in params])


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


@dataclass
class Choice:
    """A sampler pass's chosen tokens (`tokens`, on the device), their log-probabilities and each row's top-n
    alternatives on their way to the host in one copy (`Sampler.choose`); `result()` waits for them."""

    tokens: torch.Tensor  # (rows,), on the logits' device
    rows: Sequence[SampleRow]
    errors: dict[int, Exception]
    tops: list[tuple[list[int], int]]  # (which rows, n) per distinct top-n (usually none, or one)
    values: torch.Tensor  # what the host reads: the tokens, their log-probabilities, then the tops (float64)
    copied: torch.cuda.Event | None  # where the values went to pinned host memory asynchronously: its end

    @classmethod
    def of(cls, masked: torch.Tensor, lse: torch.Tensor, rows: Sequence[SampleRow], chosen: torch.Tensor,
           errors: dict[int, Exception]) -> Choice:
        """The chosen tokens (`chosen`, on the device) with their log-probabilities and each row's top-n
        alternatives, gathered into one tensor and, from a GPU, copied to pinned host memory without waiting: the
        pass's one copy to the host, which a forward launched after it does not delay."""
        n = len(rows)
        parts = [chosen.double(), (masked.gather(1, chosen[:, None])[:, 0] - lse).double()]
        tops = []
        for k in sorted({r.params.top_n_tokens for r in rows} - {0}):
            which = [i for i, r in enumerate(rows) if r.params.top_n_tokens == k]
            index = slice(None) if len(which) == n else to_device(which, masked.device)
            values, ids = torch.topk(masked[index], k)
            parts += [(values - lse[index, None]).double().reshape(-1), ids.double().reshape(-1)]
            tops.append((which, k))
        values, copied = torch.cat(parts), None
        if values.device.type == "cuda":
            values = values.to("cpu", non_blocking=True)  # pinned memory, from the caching host allocator
            copied = torch.cuda.Event()
            copied.record()
        return cls(chosen, rows, errors, tops, values, copied)

    def result(self) -> SamplerOutput:
        """The pass's tokens, log-probabilities and alternatives on the host (a wait for the device where they come
        from one). A sampled row whose chosen token's log-probability is NaN or infinite drew from logits holding
        NaN or infinity, which are no distribution: it fails, the others do not (as `torch.multinomial` refused
        them). A greedy row still takes its argmax, reported with that log-probability (null over HTTP)."""
        if self.copied is not None:
            self.copied.synchronize()
        rows, errors, n = self.rows, self.errors, len(self.rows)
        host = self.values.tolist()
        tokens = [-1 if i in errors else int(t) for i, t in enumerate(host[:n])]
        out = SamplerOutput(tokens, host[n: 2 * n], [[] for _ in rows], errors)
        for i, logprob in enumerate(out.logprobs):
            if i not in errors and not rows[i].params.is_greedy and not -math.inf <= logprob < math.inf:
                errors[i] = FloatingPointError("cannot sample: the model's logits for this row hold NaN or infinity")
                tokens[i] = -1
        at = 2 * n
        for which, k in self.tops:
            values, ids = host[at: at + len(which) * k], host[at + len(which) * k: at + 2 * len(which) * k]
            at += 2 * len(which) * k
            for j, i in enumerate(which):
                out.top[i] = [(int(t), v) for t, v in zip(ids[j * k: (j + 1) * k], values[j * k: (j + 1) * k])]
        return out


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
        return self.choose(logits, rows).result()

    def choose(self, logits: torch.Tensor, rows: Sequence[SampleRow]) -> Choice:
        """`__call__` in two halves: every row's token chosen (`Choice.tokens`, on the device) and on its way to the
        host with its log-probability and alternatives; `Choice.result()` waits for them. Between the two the
        engine may launch the next step's forward on those tokens (model/engine/scheduler.py: running ahead)."""
        masked = usable_logits(logits.float(), self.n_vocab)  # step 1, once for the batch
        # each row's argmax and log-sum-exp in one pass (a log-probability is a logit minus the latter)
        argmax, lse = row_argmax_logsumexp(masked)
        chosen, errors = self._choose(masked, rows, argmax)
        return Choice.of(masked, lse, rows, chosen, errors)

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
        return Choice.of(masked[:used], lse[:used], rows[:used], chosen, errors).result()

    def _verify_one(self, logits: torch.Tensor, row: SampleRow, argmax: int) -> int:
        """One position of `verify`: the token `__call__` would choose there."""
        adjusted = adjust(logits, row, self.eos_id)
        if row.params.is_greedy:
            return argmax if adjusted is logits else int(adjusted.argmax())
        return int(sample_row(adjusted, row))

    def _choose(self, masked: torch.Tensor, rows: Sequence[SampleRow],
                argmax: torch.Tensor) -> tuple[torch.Tensor, dict[int, Exception]]:
        """Every row's token, on the device (nothing here waits for it): the argmax for greedy rows, after adjusting
        the rows that need it; a draw for sampled rows, all filtered together and each drawn from its own generator.
        A row whose adjustment raised keeps the argmax, its error in the dict."""
        errors: dict[int, Exception] = {}
        edits: dict[int, Edits] = {}  # the rows steps 2-5 change: how
        greedy: list[int] = []  # greedy rows steps 2-6 change
        sampled: list[int] = []
        for i, row in enumerate(rows):
            if row.params.is_greedy and not _adjusts(row, self.eos_id):
                continue
            try:
                if _penalises(row, self.eos_id):
                    edits[i] = row_edits(row, self.eos_id, masked.size(-1))
            except Exception as e:  # this row's own failure: it alone fails
                errors[i] = e
                continue
            (greedy if row.params.is_greedy else sampled).append(i)
        picks = []  # (which rows, their tokens)
        for which in (greedy, sampled):
            if not which:
                continue
            if len(which) == len(rows) and not edits and all(row.allowed is None for row in rows):
                logits = masked  # every row sampled as it is: their logits, not a copy
            else:  # the rows' own copy, which steps 2-6 change in place, each step once for all of them
                logits = torch.stack([masked[i] for i in which])  # (an index into the padded view copies slower)
                penalise(logits, [edits.get(i) for i in which], self.eos_id)
                _constrain(logits, [rows[i] for i in which])
            tokens = logits.argmax(dim=-1) if which is greedy else sample(
                logits, [rows[i].params for i in which], [rows[i].generator for i in which])
            picks.append((which, tokens))
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


@dataclass
class Edits:
    """What steps 2-5 do to one row's logits, as sparse edits (ids below the row's width: a prompt may hold a padded
    id, and logit_bias may name any)."""

    bias: list[tuple[int, float]]  # step 2: (id, added)
    ban_eos: bool  # step 3
    seen: list[int]  # step 4: each id of the history once
    penalty: float
    counts: dict[int, int]  # step 5: id -> times generated
    presence: float
    frequency: float


def row_edits(row: SampleRow, eos_id: int | None, width: int) -> Edits:
    """Steps 2-5 for `row` over `width` logits, as `Edits` (host work: ids and numbers)."""
    p = row.params
    repeat = p.repetition_penalty not in (None, 1.0)
    penalised = bool(p.presence_penalty or p.frequency_penalty)
    counts: dict[int, int] = {}
    for t in row.output if penalised else ():
        if t < width:
            counts[t] = counts.get(t, 0) + 1
    return Edits(bias=[(t, b) for t, b in p.logit_bias if t < width],
                 ban_eos=eos_id is not None and eos_id < width and len(row.output) < p.min_tokens,
                 seen=list({t for t in row.history if t < width}) if repeat else [],
                 penalty=p.repetition_penalty or 1.0, counts=counts,
                 presence=p.presence_penalty or 0.0, frequency=p.frequency_penalty or 0.0)


def penalise(logits: torch.Tensor, edits: Sequence[Edits | None], eos_id: int | None) -> None:
    """Steps 2-5 on rows of logits (a copy the caller owns), in place: `edits[j]` for row j (None: none), each step
    one indexed operation for every row it applies to (a row at a time was about ten small ops each: 3.5 ms of a
    sampler pass over 32 penalised rows of GPT-2's vocabulary on one core of an AMD EPYC, and as many launches on a
    GPU). Step 4 keeps logits finite: a tiny penalty (which favours repetition) divides a positive logit towards the
    largest float."""
    device = logits.device
    some = [(j, e) for j, e in enumerate(edits) if e is not None]

    def flat(part: Callable[[Edits], Sequence], *per_row: Callable[[Edits], float]) -> list[torch.Tensor]:
        """Every row's `part` in one tensor of ids (and of values, where a part holds pairs), the rows' indices
        beside them, and each `per_row` number repeated along its row's ids: built from flat lists, on the host."""
        parts = [part(e) for _, e in some]
        lengths = torch.tensor([len(x) for x in parts])
        items = [x for xs in parts for x in xs]
        pairs = bool(items) and isinstance(items[0], tuple)
        ids = torch.tensor([x[0] for x in items] if pairs else items, dtype=torch.long)
        out = [torch.repeat_interleave(torch.tensor([j for j, _ in some]), lengths), ids]
        if pairs:
            out.append(torch.tensor([x[1] for x in items], dtype=logits.dtype))
        for number in per_row:
            out.append(torch.repeat_interleave(torch.tensor([number(e) for _, e in some], dtype=logits.dtype), lengths))
        return [t.to(device, non_blocking=True) for t in out]

    if any(e.bias for _, e in some):  # step 2
        rows, ids, bias = flat(lambda e: e.bias)
        logits.index_put_((rows, ids), bias, accumulate=True)
    banned = [j for j, e in some if e.ban_eos]
    if banned:  # step 3
        logits[to_device(banned, device), eos_id] = float("-inf")
    if any(e.seen for _, e in some):  # step 4
        rows, ids, penalty = flat(lambda e: e.seen, lambda e: e.penalty)
        picked = logits[rows, ids]
        biggest = torch.finfo(logits.dtype).max
        logits[rows, ids] = torch.where(picked > 0, picked / penalty, picked * penalty).clamp(-biggest, biggest)
    if any(e.counts for _, e in some):  # step 5
        rows, ids, count, presence, frequency = flat(lambda e: list(e.counts.items()), lambda e: e.presence,
                                                     lambda e: e.frequency)
        logits[rows, ids] = logits[rows, ids] - presence - frequency * count


def adjust(logits: torch.Tensor, row: SampleRow, eos_id: int | None) -> torch.Tensor:
    """Steps 2-6 for one row's usable logits (the same tensor when none applies), as `Sampler` applies them to a
    step's rows together."""
    if not _adjusts(row, eos_id):
        return logits
    rows = logits[None].clone()
    if _penalises(row, eos_id):
        penalise(rows, [row_edits(row, eos_id, logits.size(-1))], eos_id)
    _constrain(rows, [row])
    return rows[0]


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
    ids = ops.sample_rows(logits, *_filters(params, logits.dtype), u)
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
