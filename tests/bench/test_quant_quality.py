"""bench.quant_quality's KL on the top tokens: checked against the formula written out token by token in plain
Python floats, and against the full-vocabulary KL it bounds from below."""

from __future__ import annotations

import math

import torch

from bench.quant_quality import TopTokens, bucketed_entropy, bucketed_kl, compare


def reference_kl(p: list[float], q: dict[int, float], ref_ids: list[int], q_floor: float) -> float:
    """KL over ref's listed tokens plus a rest bucket, written out: p[i] is ref's probability of ref_ids[i]."""
    qs = [q.get(t, q_floor) for t in ref_ids]
    kl = sum(pi * math.log(pi / qi) for pi, qi in zip(p, qs))
    p_rest, q_rest = 1 - sum(p), 1 - sum(qs)
    return kl + (p_rest * math.log(p_rest / q_rest) if p_rest > 0 else 0.0)


def distributions(seed: int, positions: int = 6, vocab: int = 50) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    a = (torch.randn(positions, vocab, generator=g, dtype=torch.float64) * 2).log_softmax(-1)
    b = (a + 0.3 * torch.randn(positions, vocab, generator=g, dtype=torch.float64)).log_softmax(-1)
    return a, b


def test_bucketed_kl_equals_the_formula_written_out() -> None:
    a, b = distributions(0)
    k, n = 5, 8
    ref, other = TopTokens.of(a, n), TopTokens.of(b, n)
    kl, misses = bucketed_kl(ref, other, k)
    expected_misses = 0
    for pos in range(a.shape[0]):
        ref_ids = ref.ids[pos, :k].tolist()
        listed = dict(zip(other.ids[pos].tolist(), other.logprobs[pos].exp().tolist()))
        expected_misses += sum(t not in listed for t in ref_ids)
        want = reference_kl(ref.logprobs[pos, :k].exp().tolist(), listed, ref_ids, min(listed.values()))
        assert math.isclose(kl[pos].item(), want, rel_tol=1e-9, abs_tol=1e-12)
    assert misses == expected_misses


def test_a_missing_token_takes_the_smallest_listed_probability() -> None:
    # ref lists tokens 0, 1; other lists 1, 2 (token 0 is missing: its probability is taken as other's smallest, 0.2)
    ref = TopTokens(torch.tensor([[0, 1]]), torch.tensor([[0.5, 0.3]], dtype=torch.float64).log())
    other = TopTokens(torch.tensor([[1, 2]]), torch.tensor([[0.6, 0.2]], dtype=torch.float64).log())
    kl, misses = bucketed_kl(ref, other, 2)
    want = 0.5 * math.log(0.5 / 0.2) + 0.3 * math.log(0.3 / 0.6) + 0.2 * math.log(0.2 / 0.2)
    assert misses == 1
    assert math.isclose(kl.item(), want, rel_tol=1e-12)


def test_bucketed_kl_is_a_lower_bound_of_the_full_kl_and_zero_on_itself() -> None:
    a, b = distributions(1, vocab=200)
    full = (a.exp() * (a - b)).sum(-1)
    # every token listed on the other side (n = vocab): the bucketing alone, which can only lower the KL
    for k in (1, 10, 100, 200):
        kl, misses = bucketed_kl(TopTokens.of(a, k), TopTokens.of(b, 200), k)
        assert misses == 0
        assert (kl <= full + 1e-12).all()
    kl, _ = bucketed_kl(TopTokens.of(a, 200), TopTokens.of(b, 200), 200)
    torch.testing.assert_close(kl, full)  # nothing left in the bucket: the full KL
    same, _ = bucketed_kl(TopTokens.of(a, 20), TopTokens.of(a, 40), 20)
    torch.testing.assert_close(same, torch.zeros_like(same), atol=1e-12, rtol=0)


def test_bucketed_entropy_and_top1() -> None:
    a, b = distributions(2, vocab=30)
    full = -(a.exp() * a).sum(-1)
    torch.testing.assert_close(bucketed_entropy(TopTokens.of(a, 30), 30), full)
    assert (bucketed_entropy(TopTokens.of(a, 30), 5) <= full + 1e-12).all()
    ref, other = TopTokens.of(a, 10), TopTokens.of(b, 10)
    agree = (a.argmax(-1) == b.argmax(-1)).double().mean().item()
    assert compare(ref, other, 5)["top1"] == agree
