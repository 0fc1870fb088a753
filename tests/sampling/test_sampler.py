"""Sampling: parameter validation, the greedy rule, exact distributions of every filter, seeds."""

from __future__ import annotations

import math

import pytest
import torch

from model.sampler import (
    Sampler,
    SampleRow,
    adjust,
    apply_repetition_penalty,
    choose_token,
    mask_unusable,
    new_generator,
    sampling_distribution,
    top_k_filter,
    top_p_filter,
)
from model.sampling_params import MAX_SEED, SamplingParams, ValidationError

# --- validation ----------------------------------------------------------------------------------------------

BAD_VALUES = [
    # (kwargs, field, substrings the message must contain: the allowed range and the value)
    ({"max_new_tokens": 0}, "max_new_tokens", ["[1, 1000000]", "got 0"]),
    ({"max_new_tokens": -5}, "max_new_tokens", ["[1, 1000000]", "got -5"]),
    ({"max_new_tokens": 1_000_001}, "max_new_tokens", ["[1, 1000000]", "got 1000001"]),
    ({"max_new_tokens": 2.0}, "max_new_tokens", ["[1, 1000000]", "got 2.0"]),
    ({"max_new_tokens": True}, "max_new_tokens", ["[1, 1000000]", "got True"]),
    ({"temperature": -1.0}, "temperature", ["[0.0, 100.0]", "got -1.0"]),
    ({"temperature": float("nan")}, "temperature", ["[0.0, 100.0]", "got nan"]),
    ({"temperature": float("inf")}, "temperature", ["[0.0, 100.0]", "got inf"]),
    ({"temperature": 101}, "temperature", ["[0.0, 100.0]", "got 101"]),
    ({"temperature": True}, "temperature", ["[0.0, 100.0]", "got True"]),
    ({"temperature": "0.5"}, "temperature", ["[0.0, 100.0]", "got '0.5'"]),
    ({"top_k": -1}, "top_k", ["[0, 1000000]", "got -1"]),
    ({"top_k": False}, "top_k", ["[0, 1000000]", "got False"]),
    ({"top_p": 0.0}, "top_p", ["(0.0, 1.0]", "got 0.0"]),
    ({"top_p": 1.5}, "top_p", ["(0.0, 1.0]", "got 1.5"]),
    ({"top_p": float("nan")}, "top_p", ["(0.0, 1.0]", "got nan"]),
    ({"repetition_penalty": 0.0}, "repetition_penalty", ["(0.0, 100.0]", "got 0.0"]),
    ({"repetition_penalty": -1.2}, "repetition_penalty", ["(0.0, 100.0]", "got -1.2"]),
    ({"seed": -1}, "seed", [f"[0, {MAX_SEED}]", "got -1"]),
    ({"seed": MAX_SEED + 1}, "seed", [f"[0, {MAX_SEED}]", f"got {MAX_SEED + 1}"]),
    ({"seed": True}, "seed", [f"[0, {MAX_SEED}]", "got True"]),
    ({"top_n_tokens": 21}, "top_n_tokens", ["[0, 20]", "got 21"]),
    ({"top_n_tokens": -1}, "top_n_tokens", ["[0, 20]", "got -1"]),
    ({"do_sample": 1}, "do_sample", ["true or false", "got 1"]),
    ({"greedy": "yes"}, "greedy", ["true or false", "got 'yes'"]),
    ({"stop_at_eos": None}, "stop_at_eos", ["true or false", "got None"]),
    ({"stop": ("ok", "")}, "stop", ["non-empty", "empty string"]),
    ({"stop": tuple(f"s{i}" for i in range(17))}, "stop", ["at most 16", "got 17"]),
    ({"stop": ("ok", 3)}, "stop", ["list of strings", "3"]),
    ({"stop": "abc"}, "stop", ["list of strings", "'abc'"]),
]


@pytest.mark.parametrize(("kwargs", "field", "parts"), BAD_VALUES, ids=[f"{b[1]}={b[0]}" for b in BAD_VALUES])
def test_bad_values_name_the_field_range_and_value(kwargs: dict, field: str, parts: list[str]) -> None:
    with pytest.raises(ValidationError) as e:
        SamplingParams(**kwargs)
    assert isinstance(e.value, ValueError)
    assert e.value.field == field
    assert str(e.value).startswith(f"{field}: ")
    for part in parts:
        assert part in e.value.message, f"{part!r} missing from {e.value.message!r}"


def test_boundary_values_are_accepted() -> None:
    SamplingParams(max_new_tokens=1, temperature=0.0, top_k=0, top_p=1.0, repetition_penalty=100.0, seed=0)
    SamplingParams(max_new_tokens=1_000_000, temperature=100.0, top_p=1e-9, seed=MAX_SEED, top_n_tokens=20)
    SamplingParams(stop=tuple(f"s{i}" for i in range(16)), temperature=1)  # an int temperature is a number


# --- the greedy rule (TGI's) -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "greedy"),
    [
        ({}, True),  # nothing set
        ({"temperature": 0.0}, True),
        ({"temperature": 0.0, "do_sample": True}, True),  # temperature 0 is greedy whatever else is set
        ({"greedy": True, "do_sample": True}, True),  # greedy wins over do_sample
        ({"greedy": True, "temperature": 0.7, "top_k": 5}, True),
        ({"do_sample": True}, False),
        ({"temperature": 0.7}, False),
        ({"temperature": 1.0}, True),  # the neutral value asks for nothing
        ({"top_k": 5}, False),
        ({"top_p": 0.9}, False),
        ({"top_p": 1.0}, True),
        ({"top_k": 0}, True),
        ({"seed": 3}, True),  # a seed alone does not turn sampling on
        ({"repetition_penalty": 1.5}, True),  # nor does a repetition penalty
    ],
)
def test_is_greedy(kwargs: dict, greedy: bool) -> None:
    assert SamplingParams(**kwargs).is_greedy is greedy


def test_greedy_picks_the_argmax_even_with_sampling_controls_set() -> None:
    logits = torch.tensor([0.1, 3.0, 2.9, -1.0])
    params = SamplingParams(greedy=True, temperature=50.0, top_k=3)
    gen = new_generator(0)
    assert {choose_token(logits, params, n_vocab=4, generator=gen) for _ in range(200)} == {1}
    # temperature 0 is an argmax, never a division by zero
    assert choose_token(logits, SamplingParams(temperature=0.0), n_vocab=4) == 1


# --- exact distributions ---------------------------------------------------------------------------------------

LOGITS = [0.3, 2.1, -1.0, 1.4, 0.9, -0.2, 1.8, -2.5, 0.0, 1.1, -0.7, 0.5]

# chi-square critical values at p = 0.001 by degrees of freedom (from any chi-square table), used when scipy
# is not installed; a correct sampler fails this check once in a thousand seeds, and the seeds are fixed
CHI2_CRITICAL_P001 = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515, 6: 22.458, 7: 24.322, 8: 26.124,
                      9: 27.877, 10: 29.588, 11: 31.264}


def _softmax(z: list[float]) -> list[float]:
    m = max(v for v in z if v != -math.inf)
    e = [0.0 if v == -math.inf else math.exp(v - m) for v in z]
    return [x / sum(e) for x in e]


def _expected(temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0) -> list[float]:
    """The documented steps 4-7 written out in float64, independent of the implementation."""
    z = [v / temperature for v in LOGITS]
    if top_k:
        kth = sorted(z, reverse=True)[top_k - 1]
        z = [v if v >= kth else -math.inf for v in z]
    probs = _softmax(z)
    keep, mass = [], 0.0
    for i in sorted(range(len(z)), key=lambda i: -probs[i]):
        if mass >= top_p:
            break
        keep.append(i)
        mass += probs[i]
    return _softmax([z[i] if i in keep else -math.inf for i in range(len(z))])


def _chi_square_ok(counts: list[int], probs: list[float]) -> tuple[bool, str]:
    """Pearson's test at p = 0.001; cells expected to hold fewer than 5 draws are pooled into one."""
    n = sum(counts)
    cells, pooled_obs, pooled_exp = [], 0, 0.0
    for c, p in zip(counts, probs):
        if p == 0:
            continue
        if n * p < 5:
            pooled_obs, pooled_exp = pooled_obs + c, pooled_exp + n * p
        else:
            cells.append((c, n * p))
    if pooled_exp:
        cells.append((pooled_obs, pooled_exp))
    stat = sum((o - e) ** 2 / e for o, e in cells)
    df = len(cells) - 1
    try:
        from scipy.stats import chi2

        critical = float(chi2.isf(0.001, df))
    except ImportError:
        critical = CHI2_CRITICAL_P001[df]
    return stat < critical, f"chi2={stat:.2f} df={df} critical={critical:.2f} counts={counts}"


CASES = {
    "temperature": (dict(temperature=0.7), dict(temperature=0.7)),
    "top_k": (dict(top_k=4, do_sample=True), dict(top_k=4)),
    "top_p": (dict(top_p=0.8), dict(top_p=0.8)),
    # top_p 0.85 (not 0.9) so that it drops a token of the five top-k keeps at this temperature
    "all_three": (dict(top_k=5, top_p=0.85, temperature=1.3), dict(top_k=5, top_p=0.85, temperature=1.3)),
}


@pytest.mark.parametrize("case", CASES)
def test_sampled_tokens_follow_the_exact_distribution(case: str) -> None:
    kwargs, expect_kwargs = CASES[case]
    params = SamplingParams(**kwargs)
    assert not params.is_greedy
    want = _expected(**expect_kwargs)
    logits = torch.tensor(LOGITS)
    support = {i for i, p in enumerate(want) if p > 0}
    if case != "temperature":
        assert 3 <= len(support) < len(LOGITS)  # the filter really removes tokens, and not all but one

    probs = sampling_distribution(logits, params)
    assert probs.tolist() == pytest.approx(want, abs=1e-6)

    # the bulk: 20,000 draws from that distribution
    bulk = torch.multinomial(probs, 20_000, replacement=True, generator=new_generator(11))
    counts = torch.bincount(bulk, minlength=len(LOGITS)).tolist()
    ok, detail = _chi_square_ok(counts, want)
    assert ok, detail

    # and choose_token itself, one draw at a time with one generator
    gen = new_generator(12)
    drawn = [choose_token(logits, params, n_vocab=len(LOGITS), generator=gen) for _ in range(2_000)]
    assert set(drawn) <= support, f"tokens outside the kept set: {set(drawn) - support}"
    ok, detail = _chi_square_ok([drawn.count(i) for i in range(len(LOGITS))], want)
    assert ok, detail


def test_a_wrong_distribution_fails_the_chi_square_check() -> None:
    """The check above can fail: draws at temperature 1 are rejected against temperature 0.7."""
    probs = torch.tensor(_expected(temperature=1.0))
    draws = torch.multinomial(probs, 20_000, replacement=True, generator=new_generator(11))
    ok, _ = _chi_square_ok(torch.bincount(draws, minlength=len(LOGITS)).tolist(), _expected(temperature=0.7))
    assert not ok


# --- the filters on hand-written tensors -----------------------------------------------------------------------

NEG = float("-inf")


def test_top_k_keeps_ties_at_the_kth_value() -> None:
    logits = torch.tensor([1.0, 3.0, 2.0, 3.0, 0.5, 2.0])
    assert top_k_filter(logits, 1).tolist() == [NEG, 3.0, NEG, 3.0, NEG, NEG]
    assert top_k_filter(logits, 3).tolist() == [NEG, 3.0, 2.0, 3.0, NEG, 2.0]
    assert top_k_filter(logits, 0).tolist() == logits.tolist()  # off
    assert top_k_filter(logits, 6).tolist() == logits.tolist()
    assert top_k_filter(logits, 100).tolist() == logits.tolist()


def test_top_k_ties_are_all_sampled() -> None:
    logits = torch.tensor([0.0, 2.0, 2.0, 2.0, 1.0])
    gen = new_generator(5)
    drawn = {choose_token(logits, SamplingParams(top_k=1), n_vocab=5, generator=gen) for _ in range(300)}
    assert drawn == {1, 2, 3}


def test_top_p_keeps_the_smallest_set_reaching_p() -> None:
    probs = torch.tensor([0.1, 0.4, 0.3, 0.2])
    logits = probs.log()
    kept = lambda p: [i for i, v in enumerate(top_p_filter(logits, p).tolist()) if v != NEG]
    assert kept(0.39) == [1]
    assert kept(0.41) == [1, 2]
    assert kept(0.69) == [1, 2]
    assert kept(0.71) == [1, 2, 3]
    assert kept(0.89) == [1, 2, 3]
    assert kept(0.91) == [0, 1, 2, 3]
    assert kept(1.0) == [0, 1, 2, 3]
    # the kept logits keep their values
    assert top_p_filter(logits, 0.7)[1:3].tolist() == logits[1:3].tolist()


def test_top_p_always_keeps_at_least_one_token() -> None:
    for logits in (torch.tensor([0.0, 5.0, 1.0]), torch.zeros(4), torch.tensor([-30.0, -31.0])):
        out = top_p_filter(logits, 1e-9)
        assert (out != NEG).sum().item() >= 1
        assert out.argmax().item() == logits.argmax().item()
        gen = new_generator(0)
        params = SamplingParams(top_p=1e-9)
        assert {choose_token(logits, params, n_vocab=logits.numel(), generator=gen) for _ in range(50)} == {
            int(logits.argmax())
        }


EXTREME = [
    # valid but extreme values that once made the softmax NaN (multinomial then raised): the limit is taken
    ({"temperature": 5e-324}, {1}),  # rounds to 0 in float32
    ({"temperature": 1e-40}, {1}),  # (l - max) / T overflowed to inf before the shift by the maximum
    ({"top_p": 5e-324}, {1}),  # compared as 0 in float32, which dropped every token
    ({"repetition_penalty": 5e-324}, {0, 1}),  # positive logits of the context divided into inf: clamped, a tie
    ({"repetition_penalty": 1e-40, "temperature": 1e-40, "top_k": 2}, {0, 1}),
]


@pytest.mark.parametrize(("kwargs", "tokens"), EXTREME, ids=[str(k) for k, _ in EXTREME])
def test_extreme_valid_parameters_sample_their_limit(kwargs: dict, tokens: set[int]) -> None:
    logits = torch.tensor([2.0, 3.0, -1.0, 0.5])
    context = torch.tensor([0, 1, 2])
    gen = new_generator(0)
    params = SamplingParams(do_sample=True, **kwargs)
    drawn = {choose_token(logits, params, n_vocab=4, context=context, generator=gen) for _ in range(100)}
    assert drawn == tokens


def test_repetition_penalty_exact_values() -> None:
    logits = torch.tensor([2.0, -1.0, 0.5, -0.5, 3.0, 0.0])
    before = logits.clone()
    context = torch.tensor([0, 1, 1, 3, 5])
    out = apply_repetition_penalty(logits, context, 2.0)
    # positive seen logits are divided, negative ones multiplied; ids 2 and 4 are unseen; 0 stays 0
    assert out.tolist() == [1.0, -2.0, 0.5, -1.0, 3.0, 0.0]
    assert torch.equal(logits, before)  # the input is not modified
    assert apply_repetition_penalty(logits, context, 1.0).tolist() == before.tolist()
    assert apply_repetition_penalty(logits, torch.tensor([], dtype=torch.long), 2.0).tolist() == before.tolist()
    # a penalty below 1 rewards repetition instead
    assert apply_repetition_penalty(logits, torch.tensor([0, 3]), 0.5).tolist() == [4.0, -1.0, 0.5, -0.25, 3.0, 0.0]


def test_repetition_penalty_changes_the_greedy_choice_only_with_a_context() -> None:
    logits = torch.tensor([2.0, 1.5, 0.0])
    params = SamplingParams(repetition_penalty=2.0)
    assert choose_token(logits, params, n_vocab=3) == 0  # no context: nothing to penalise
    assert choose_token(logits, params, n_vocab=3, context=torch.tensor([0])) == 1  # 2.0 / 2 < 1.5


def test_mask_unusable_hides_padded_ids_even_when_they_are_largest() -> None:
    logits = torch.tensor([0.5, 1.0, -0.25, 0.25, 9.0, 8.0, 7.5])  # ids 4..6 pad the vocabulary of 4
    masked = mask_unusable(logits, 4)
    assert masked.tolist() == [0.5, 1.0, -0.25, 0.25, NEG, NEG, NEG]
    assert logits[4].item() == 9.0  # the input is untouched
    assert mask_unusable(logits, 7) is logits  # nothing to mask
    assert choose_token(logits, SamplingParams(), n_vocab=4) == 1
    gen = new_generator(3)
    for params in (SamplingParams(temperature=5.0), SamplingParams(temperature=100.0, top_k=7, top_p=1.0)):
        drawn = {choose_token(logits, params, n_vocab=4, generator=gen) for _ in range(500)}
        assert drawn == {0, 1, 2, 3}
    out = Sampler(4)(logits[None], [SampleRow(SamplingParams(top_n_tokens=4))])
    assert out.tokens == [1] and [i for i, _ in out.top[0]] == [1, 0, 3, 2]
    assert out.logprobs[0] == pytest.approx(math.log(_softmax([0.5, 1.0, -0.25, 0.25])[1]), abs=1e-6)


def test_reported_logprobs_ignore_temperature_filters_and_penalty() -> None:
    logits = torch.tensor(LOGITS)
    want = [math.log(p) for p in _softmax(LOGITS)]
    params = SamplingParams(temperature=0.3, top_k=4, repetition_penalty=3.0, top_n_tokens=3, seed=5)
    rows = [SampleRow(params, new_generator(5), history=[1, 6]), SampleRow(SamplingParams())]
    out = Sampler(len(LOGITS))(torch.stack([logits, logits]), rows)
    assert out.tokens[0] in (1, 3, 6, 9) and out.tokens[1] == 1  # top-k 4 keeps ids 1, 6, 3, 9
    assert out.logprobs == pytest.approx([want[out.tokens[0]], want[1]], abs=1e-6)
    assert [i for i, _ in out.top[0]] == [1, 6, 3]
    assert [v for _, v in out.top[0]] == pytest.approx([want[1], want[6], want[3]], abs=1e-6)
    assert out.top[1] == []  # no top_n_tokens asked: no alternatives


# --- seeds -----------------------------------------------------------------------------------------------------


def _draws(seed: int, n: int = 64) -> list[int]:
    params = SamplingParams(temperature=1.5, seed=seed)
    gen = new_generator(seed)
    return [choose_token(torch.tensor(LOGITS), params, n_vocab=len(LOGITS), generator=gen) for _ in range(n)]


def test_same_seed_same_draws_different_seed_different_draws() -> None:
    assert _draws(7) == _draws(7)
    assert _draws(MAX_SEED) == _draws(MAX_SEED)
    runs = {tuple(_draws(seed)) for seed in range(8)}
    assert len(runs) == 8


def test_with_seed_keeps_everything_else() -> None:
    params = SamplingParams(temperature=0.5, top_k=3, stop=("x",))
    seeded = params.with_seed(42)
    assert seeded.seed == 42 and params.seed is None
    assert (seeded.temperature, seeded.top_k, seeded.stop) == (0.5, 3, ("x",))


# --- OpenAI's controls: logit bias, min_tokens, presence/frequency penalties, min-p -------------------------------


def test_min_p_keeps_tokens_at_least_p_times_the_most_likely_exactly() -> None:
    logits = torch.tensor(LOGITS)
    probs = _softmax([v / 0.9 for v in LOGITS])
    keep = [p >= 0.3 * max(probs) for p in probs]
    assert 2 <= sum(keep) < len(LOGITS)  # the filter removes some tokens, not all but one
    want = _softmax([v / 0.9 if k else -math.inf for v, k in zip(LOGITS, keep)])
    params = SamplingParams(temperature=0.9, min_p=0.3)
    assert not params.is_greedy and SamplingParams(min_p=0.3).is_greedy is False
    assert sampling_distribution(logits, params).tolist() == pytest.approx(want, abs=1e-6)
    gen = new_generator(21)
    drawn = [choose_token(logits, params, n_vocab=len(LOGITS), generator=gen) for _ in range(2_000)]
    ok, detail = _chi_square_ok([drawn.count(i) for i in range(len(LOGITS))], want)
    assert ok, detail


def test_logit_bias_is_added_before_greedy_and_sampling() -> None:
    logits = torch.tensor(LOGITS)
    assert choose_token(logits, SamplingParams(), n_vocab=len(LOGITS)) == 1
    assert choose_token(logits, SamplingParams(logit_bias={7: 4.7}), n_vocab=len(LOGITS)) == 7  # -2.5 + 4.7 > 2.1
    assert choose_token(logits, SamplingParams(logit_bias={1: -100}), n_vocab=len(LOGITS)) == 6  # banned: next best
    params = SamplingParams(temperature=1.0, do_sample=True, logit_bias={0: 2.0, 1: -1.5})
    biased = list(LOGITS)
    biased[0] += 2.0
    biased[1] -= 1.5
    gen = new_generator(22)
    drawn = [choose_token(logits, params, n_vocab=len(LOGITS), generator=gen) for _ in range(2_000)]
    ok, detail = _chi_square_ok([drawn.count(i) for i in range(len(LOGITS))], _softmax(biased))
    assert ok, detail
    # a bias on an id past the logits (a padded vocabulary's end) changes nothing
    assert choose_token(logits, SamplingParams(logit_bias={99: 100}), n_vocab=len(LOGITS)) == 1


def test_presence_and_frequency_penalties_exact_values() -> None:
    """OpenAI's formula over the generated ids only: logit - presence * [count > 0] - frequency * count."""
    logits = torch.tensor(LOGITS)
    output = [1, 1, 1, 6, 3]
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    row = SampleRow(params, history=[0, 0, 0], output=output)  # the prompt's ids (0) are not penalised
    got = adjust(logits, row, eos_id=None)
    want = [v - (0.5 + 0.25 * output.count(i) if i in output else 0.0) for i, v in enumerate(LOGITS)]
    assert got.tolist() == pytest.approx(want, abs=1e-6)
    # 1: 2.1 - 1.25 = 0.85, 6: 1.8 - 0.75 = 1.05, 3: 1.4 - 0.75 = 0.65: the unpenalised 9 (1.1) wins
    assert choose_token(logits, params, n_vocab=len(LOGITS), output=output) == 9
    encourage = SamplingParams(presence_penalty=-2.0)  # negative values encourage repetition
    assert choose_token(logits, encourage, n_vocab=len(LOGITS), output=[7]) == 1  # -2.5 + 2 still small
    assert choose_token(logits, encourage, n_vocab=len(LOGITS), output=[9]) == 9  # 1.1 + 2 > 2.1


def test_min_tokens_keeps_eos_out_until_reached() -> None:
    logits = torch.tensor(LOGITS)  # EOS (id 1) is the argmax
    params = SamplingParams(min_tokens=3, max_new_tokens=5)
    assert [choose_token(logits, params, n_vocab=len(LOGITS), output=[0] * n, eos_id=1) for n in range(5)] == [
        6, 6, 6, 1, 1]
    gen = new_generator(23)
    sampled = SamplingParams(min_tokens=2, max_new_tokens=4, temperature=5.0)
    assert 1 not in {choose_token(logits, sampled, n_vocab=len(LOGITS), output=[0], eos_id=1, generator=gen)
                     for _ in range(300)}


def test_new_controls_are_validated() -> None:
    for kwargs, field, part in [({"presence_penalty": 2.5}, "presence_penalty", "[-2.0, 2.0]"),
                                ({"frequency_penalty": -3}, "frequency_penalty", "[-2.0, 2.0]"),
                                ({"min_p": 1.5}, "min_p", "[0.0, 1.0]"),
                                ({"min_tokens": 21}, "min_tokens", "[0, 20]"),
                                ({"logit_bias": {5: 101}}, "logit_bias", "[-100.0, 100.0]"),
                                ({"logit_bias": {-1: 1}}, "logit_bias", "got -1")]:
        with pytest.raises(ValidationError) as e:
            SamplingParams(**kwargs)
        assert e.value.field == field and part in e.value.message
