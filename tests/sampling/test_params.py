"""Sampling parameters: validation that names the field, the range and the value; the greedy rule (TGI's); and
seeds, which reproduce draws and survive `with_seed`."""

from __future__ import annotations

import pytest
import torch

from model.sampler import choose_token, new_generator
from model.sampling_params import MAX_SEED, SamplingParams, ValidationError
from tests.sampling.distributions import LOGITS

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
