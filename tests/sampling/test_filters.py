"""The filters on hand-written tensors: top-k and top-p (ties, the smallest set reaching p, at least one
token), extreme valid parameters, the repetition penalty, masking padded ids, reported log-probabilities."""

from __future__ import annotations

import math

import pytest
import torch

from model import sampler as sampler_module
from model.sampler import (
    Sampler,
    SampleRow,
    adjust,
    choose_token,
    min_p_filter,
    new_generator,
    top_k_filter,
    top_p_filter,
    usable_logits,
)
from model.sampling_params import SamplingParams
from tests.sampling.distributions import LOGITS, softmax

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


@pytest.mark.parametrize("name", ["top_k", "top_p", "min_p"])
def test_a_parameter_per_row_filters_each_row_as_its_own_parameter_does(name: str) -> None:
    """The batched form (2-D logits, a parameter per row, off for some rows) is each row filtered alone."""
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(2)) * 2
    logits[1, 3:9] = 1.5  # ties
    apply, values = {"top_k": (top_k_filter, [0, 3, 1, 50, 7]), "top_p": (top_p_filter, [1.0, 0.3, 0.0, 0.9, 0.6]),
                     "min_p": (min_p_filter, [0.0, 0.5, 1.0, 0.01, 0.2])}[name]
    together = apply(logits, values)
    assert together.tolist() == [apply(logits[i], v).tolist() for i, v in enumerate(values)]
    off = [0, 3] if name == "top_k" else [0]  # k 0 or the width, p 1, min_p 0: left alone; the rest filtered
    assert (together == NEG).any(dim=-1).tolist() == [i not in off for i in range(5)]


def test_top_p_ranks_tied_ids_by_id() -> None:
    """Equally likely ids across the boundary: the lower ids are kept (a stable sort's order, which the CPU kernel
    follows too), the same ids every time."""
    kept = lambda p: [i for i, v in enumerate(top_p_filter(torch.zeros(10), p).tolist()) if v != NEG]
    assert kept(0.35) == [0, 1, 2, 3]
    assert kept(0.05) == [0]
    logits = torch.tensor([0.0, 2.0, 1.0, 2.0, 1.0, 1.0])  # 2, 2 then three tied 1s
    probs = torch.softmax(logits, -1)
    p = float(probs[1] * 2 + probs[2] * 1.5)  # reached after the second of the tied ids
    assert [i for i, v in enumerate(top_p_filter(logits, p).tolist()) if v != NEG] == [1, 2, 3, 4]


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

    def penalised(history: list[int], penalty: float) -> list[float]:
        return adjust(logits, SampleRow(SamplingParams(repetition_penalty=penalty), history=history), None).tolist()

    # positive seen logits are divided, negative ones multiplied; ids 2 and 4 are unseen; 0 stays 0
    assert penalised([0, 1, 1, 3, 5], 2.0) == [1.0, -2.0, 0.5, -1.0, 3.0, 0.0]
    assert torch.equal(logits, before)  # the input is not modified
    assert penalised([0, 1, 1, 3, 5], 1.0) == before.tolist()
    assert penalised([], 2.0) == before.tolist()
    # a penalty below 1 rewards repetition instead
    assert penalised([0, 3], 0.5) == [4.0, -1.0, 0.5, -0.25, 3.0, 0.0]


def edited_rows(width: int) -> tuple[torch.Tensor, list[SampleRow]]:
    """Five rows of logits (`width` ids, the last EOS) and rows asking for every one of steps 2-6, in mixes."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(5, width, generator=gen) * 3
    allowed = torch.rand(width, generator=gen) > 0.3
    rows = [SampleRow(SamplingParams(logit_bias={3: 2.5, 7: -100.0, 55: 1.0}, repetition_penalty=1.7, min_tokens=5,
                                     max_new_tokens=9), history=[1, 3, 3, 8, 60], output=[3, 8]),
            SampleRow(SamplingParams(presence_penalty=0.6, frequency_penalty=0.25), history=[2, 2, 4, 2],
                      output=[2, 2, 4, 2, 70], allowed=allowed),
            SampleRow(SamplingParams()),
            SampleRow(SamplingParams(repetition_penalty=0.8, presence_penalty=-0.4), history=[5, 6, 6], output=[6, 6]),
            SampleRow(SamplingParams(logit_bias={0: -3.0}, min_tokens=1, max_new_tokens=2), output=[])]
    return logits, rows


def test_steps_2_to_6_on_a_batch_equal_each_row_alone() -> None:
    """The sampler applies logit bias, min_tokens, the repetition, presence and frequency penalties and the
    constraints to a step's rows together, each step once: every row's logits come out as that row's alone (worked
    out here in plain Python, in float32 as torch rounds), whatever the other rows ask for."""
    width, eos = 40, 39
    logits, rows = edited_rows(width)
    f32 = lambda x: float(torch.tensor(x, dtype=torch.float32))  # noqa: E731

    def alone(row: SampleRow, values: list[float]) -> list[float]:
        p, out = row.params, list(values)
        for t, b in p.logit_bias:
            if t < width:
                out[t] = f32(out[t] + f32(b))
        if len(row.output) < p.min_tokens:
            out[eos] = NEG
        if p.repetition_penalty not in (None, 1.0):
            for t in {t for t in row.history if t < width}:
                x = out[t]
                out[t] = f32(x / f32(p.repetition_penalty)) if x > 0 else f32(x * f32(p.repetition_penalty))
        if p.presence_penalty or p.frequency_penalty:
            for t in {t for t in row.output if t < width}:
                count = row.output.count(t)
                out[t] = f32(f32(out[t] - f32(p.presence_penalty)) - f32(f32(p.frequency_penalty) * count))
        if row.allowed is not None:
            out = [x if ok else NEG for x, ok in zip(out, row.allowed.tolist())]
        return out

    together = logits.clone()
    sampler_module.penalise(together, [sampler_module.row_edits(r, eos, width) for r in rows], eos)
    sampler_module._constrain(together, rows)
    for j, row in enumerate(rows):
        assert together[j].tolist() == alone(row, logits[j].tolist()), j
        assert adjust(logits[j], row, eos).tolist() == together[j].tolist(), j


def test_repetition_penalty_changes_the_greedy_choice_only_with_a_context() -> None:
    logits = torch.tensor([2.0, 1.5, 0.0])
    params = SamplingParams(repetition_penalty=2.0)
    assert choose_token(logits, params, n_vocab=3) == 0  # no context: nothing to penalise
    assert choose_token(logits, params, n_vocab=3, context=torch.tensor([0])) == 1  # 2.0 / 2 < 1.5


def test_usable_logits_hides_padded_ids_even_when_they_are_largest() -> None:
    logits = torch.tensor([0.5, 1.0, -0.25, 0.25, 9.0, 8.0, 7.5])  # ids 4..6 pad the vocabulary of 4
    usable = usable_logits(logits, 4)
    assert usable.tolist() == [0.5, 1.0, -0.25, 0.25]
    assert usable.data_ptr() == logits.data_ptr()  # a view: nothing copied
    assert usable_logits(logits, 7) is logits  # nothing to leave out
    assert choose_token(logits, SamplingParams(), n_vocab=4) == 1
    gen = new_generator(3)
    for params in (SamplingParams(temperature=5.0), SamplingParams(temperature=100.0, top_k=7, top_p=1.0)):
        drawn = {choose_token(logits, params, n_vocab=4, generator=gen) for _ in range(500)}
        assert drawn == {0, 1, 2, 3}
    out = Sampler(4)(logits[None], [SampleRow(SamplingParams(top_n_tokens=4))])
    assert out.tokens == [1] and [i for i, _ in out.top[0]] == [1, 0, 3, 2]
    assert out.logprobs[0] == pytest.approx(math.log(softmax([0.5, 1.0, -0.25, 0.25])[1]), abs=1e-6)


def test_reported_logprobs_ignore_temperature_filters_and_penalty() -> None:
    logits = torch.tensor(LOGITS)
    want = [math.log(p) for p in softmax(LOGITS)]
    params = SamplingParams(temperature=0.3, top_k=4, repetition_penalty=3.0, top_n_tokens=3, seed=5)
    rows = [SampleRow(params, new_generator(5), history=[1, 6]), SampleRow(SamplingParams())]
    out = Sampler(len(LOGITS))(torch.stack([logits, logits]), rows)
    assert out.tokens[0] in (1, 3, 6, 9) and out.tokens[1] == 1  # top-k 4 keeps ids 1, 6, 3, 9
    assert out.logprobs == pytest.approx([want[out.tokens[0]], want[1]], abs=1e-6)
    assert [i for i, _ in out.top[0]] == [1, 6, 3]
    assert [v for _, v in out.top[0]] == pytest.approx([want[1], want[6], want[3]], abs=1e-6)
    assert out.top[1] == []  # no top_n_tokens asked: no alternatives
