"""The CPU kernels' draw (csrc/sampling.cpp, `ops.sample_rows`) against the sampler's torch path
(`sampling_distribution` then the inverse cumulative distribution, every row sorted for top-p): at every uniform
number both take the same id, except where that number falls within float rounding of the boundary between two ids;
and no id the torch path gives probability 0 is ever drawn. For every kernel variant this CPU runs."""

from __future__ import annotations

import math

import pytest
import torch

from model.kernels import build, ops
from model.sampler import sampling_distribution
from model.sampling_params import SamplingParams

NEG = float("-inf")
PARAMS = {  # temperature, top-k, top-p, min-p
    "temperature 1": dict(),
    "temperature 0.7, top-k 50": dict(temperature=0.7, top_k=50),
    "top-p 0.9": dict(top_p=0.9),
    "top-p 0.5, temperature 1.3, min-p 0.05": dict(top_p=0.5, temperature=1.3, min_p=0.05),
    "top-k 40, top-p 0.95, min-p 0.02, temperature 0.8": dict(top_k=40, top_p=0.95, min_p=0.02, temperature=0.8),
    "top-k 1": dict(top_k=1),
    "top-p 0.999": dict(top_p=0.999),
    "temperature 1e-3": dict(temperature=1e-3),
}


def rows_of(width: int) -> torch.Tensor:
    """Peaked, Zipf-like, flat and very flat rows; one with ties and banned (-inf) ids; `width` ids each."""
    gen = torch.Generator().manual_seed(width)
    ranks = torch.randperm(width, generator=gen).double() + 1
    tied = (torch.randint(0, 6, (width,), generator=gen) * 0.5).float()
    tied[torch.randperm(width, generator=gen)[: width // 3]] = NEG
    return torch.stack([torch.randn(width, generator=gen) * 4, (-1.1 * ranks.log()).float(),
                        torch.randn(width, generator=gen), torch.randn(width, generator=gen) * 0.05, tied])


def kernel_draws(logits: torch.Tensor, params: SamplingParams, u: list[float]) -> list[int]:
    """The kernel's id for each number of `u`, all rows of `logits` at each."""
    n = logits.size(0)
    ids = [ops.sample_rows(logits, [params.temperature or 1.0] * n, [params.top_k or 0] * n,
                           [params.top_p or 1.0] * n, [params.min_p or 0.0] * n, [x] * n) for x in u]
    assert all(i is not None for i in ids)
    return torch.stack(ids, dim=1).tolist()  # (rows, len(u))


@pytest.mark.parametrize("width", [1000, 50257])
@pytest.mark.parametrize("case", PARAMS)
def test_the_kernel_draws_the_torch_paths_id(kernel_variant: build.Variant, width: int, case: str) -> None:
    padded = torch.cat([rows_of(width), torch.full((5, 47), 9.0)], dim=1)
    logits = padded[:, :width]  # rows apart by more than their width (a padded vocabulary's usable ids), a view
    params = SamplingParams(do_sample=True, **PARAMS[case])
    u = [i / 97 for i in range(97)] + torch.rand(60, dtype=torch.float64,
                                                 generator=torch.Generator().manual_seed(1)).tolist()
    got = torch.tensor(kernel_draws(logits, params, u))  # (rows, len(u))
    probs = sampling_distribution(logits, params).double()
    assert (probs.gather(1, got) > 0).all()  # never an id the filters drop (nor a banned one)
    cumulative = probs.cumsum(-1)
    total = cumulative[:, -1:]
    reach = (1 - torch.tensor(u, dtype=torch.float64)) * total
    want = torch.searchsorted(cumulative, reach).clamp(max=width - 1)
    # where they differ, `reach` is within rounding of where one id's mass ends (the torch path's float32 sums)
    boundary = cumulative.gather(1, torch.minimum(got, want))
    differ = got != want
    assert ((boundary - reach).abs() < 1e-5 * total)[differ].all(), (got[differ], want[differ])
    assert differ.float().mean() < 0.05


def test_ties_at_the_top_p_boundary_go_by_id(kernel_variant: build.Variant) -> None:
    """Ten equally likely ids and top-p 0.35: the first four by id are kept (a stable sort's order), as the torch
    path keeps them; top-k 3 of five tied largest keeps all five; ids tied with the row's last (past its last whole
    vector of lanes) likewise."""
    u = [i / 200 for i in range(200)]
    flat = torch.zeros(2, 10)
    drawn = kernel_draws(flat, SamplingParams(do_sample=True, top_p=0.35), u)
    kept = (sampling_distribution(flat[0], SamplingParams(do_sample=True, top_p=0.35)) > 0).nonzero()[:, 0].tolist()
    assert set(drawn[0]) == set(kept) == {0, 1, 2, 3}
    logits = torch.tensor([[1.0, 5.0, 5.0, 2.0, 5.0, 5.0, 0.0, 5.0]])
    assert set(kernel_draws(logits, SamplingParams(do_sample=True, top_k=3), u)[0]) == {1, 2, 4, 5, 7}
    # a tie reaching past the last whole vector: the last id's weight is its tied neighbours' (not another exp's)
    s = -1.0379400253295898
    for width in (9, 17, 33, 50257):
        row = torch.full((1, width), s)
        row[0, 0] = 0.0
        p = (1 + 2.5 * math.exp(s)) / (1 + (width - 1) * math.exp(s))  # the largest and three of the tied ids
        params = SamplingParams(do_sample=True, top_p=p)
        assert set(kernel_draws(row, params, u)[0]) == {0, 1, 2, 3}, width
        assert (sampling_distribution(row[0], params) > 0).nonzero()[:, 0].tolist() == [0, 1, 2, 3]


def test_rows_with_no_distribution_get_the_last_id(kernel_variant: build.Variant) -> None:
    """A NaN anywhere, a +inf, or every id banned: the last id, which the sampler then fails by its log-probability
    (as the torch path's draw does); a row beside them draws as it does alone."""
    logits = torch.randn(4, 300, generator=torch.Generator().manual_seed(0))
    logits[0, 17] = float("nan")
    logits[1, 3] = float("inf")
    logits[2] = NEG
    for x in (0.0, 0.3, 0.99):
        ids = kernel_draws(logits, SamplingParams(do_sample=True, top_p=0.9), [x])
        alone = kernel_draws(logits[3:], SamplingParams(do_sample=True, top_p=0.9), [x])
        assert [row[0] for row in ids] == [299, 299, 299, alone[0][0]]


@pytest.mark.parametrize("width", [7, 65, 50257])
def test_fill_disallowed_is_masked_fill_on_the_rows_named(kernel_variant: build.Variant, width: int) -> None:
    """Structured output's masks in place: the rows named get -inf where their mask is false, every other value
    (and every other row) as it was; rows apart by more than their width (a padded vocabulary's usable ids)."""
    gen = torch.Generator().manual_seed(width)
    padded = torch.randn(6, width + 9, generator=gen)
    logits = padded[:, :width]
    allowed = torch.rand(3, width, generator=gen) > 0.5
    allowed[1] = False  # a row with nothing allowed: all -inf (the engine fails such a row before it samples)
    want = logits.clone()
    want[[4, 0, 2]] = want[[4, 0, 2]].masked_fill(~allowed, NEG)
    rest = padded[:, width:].clone()
    ops.fill_disallowed(logits, [4, 0, 2], allowed)
    assert torch.equal(logits, want) and torch.equal(padded[:, width:], rest)
