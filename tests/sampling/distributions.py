"""The exact distributions sampling must follow, written out in float64 independently of the implementation
(the documented steps 4-7: temperature, top-k, softmax, top-p), Pearson's chi-square test that sampled
counts are drawn from them, and the id a seed's uniform number picks by inverse transform sampling."""

from __future__ import annotations

import math

import torch

from model.sampler import new_generator

LOGITS = [0.3, 2.1, -1.0, 1.4, 0.9, -0.2, 1.8, -2.5, 0.0, 1.1, -0.7, 0.5]

# chi-square critical values at p = 0.001 by degrees of freedom (from any chi-square table), used when scipy
# is not installed; a correct sampler fails this check once in a thousand seeds, and the seeds are fixed
CHI2_CRITICAL_P001 = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515, 6: 22.458, 7: 24.322, 8: 26.124,
                      9: 27.877, 10: 29.588, 11: 31.264}


def chi2_critical(df: int) -> float:
    """The chi-square statistic with `df` degrees of freedom exceeded with probability 0.001 (scipy's, else the
    table's)."""
    try:
        from scipy.stats import chi2

        return float(chi2.isf(0.001, df))
    except ImportError:
        return CHI2_CRITICAL_P001[df]


def softmax(z: list[float]) -> list[float]:
    m = max(v for v in z if v != -math.inf)
    e = [0.0 if v == -math.inf else math.exp(v - m) for v in z]
    return [x / sum(e) for x in e]


def expected(temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0) -> list[float]:
    """The documented steps 4-7 written out in float64, independent of the implementation."""
    z = [v / temperature for v in LOGITS]
    if top_k:
        kth = sorted(z, reverse=True)[top_k - 1]
        z = [v if v >= kth else -math.inf for v in z]
    probs = softmax(z)
    keep, mass = [], 0.0
    for i in sorted(range(len(z)), key=lambda i: -probs[i]):
        if mass >= top_p:
            break
        keep.append(i)
        mass += probs[i]
    return softmax([z[i] if i in keep else -math.inf for i in range(len(z))])


def chi_square_ok(counts: list[int], probs: list[float]) -> tuple[bool, str]:
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
    critical = chi2_critical(df)
    return stat < critical, f"chi2={stat:.2f} df={df} critical={critical:.2f} counts={counts}"


def same_distribution_ok(a: list[int], b: list[int]) -> tuple[bool, str]:
    """Pearson's two-sample test (homogeneity) at p = 0.001 that counts `a` and `b` over the same cells come from one
    distribution; cells where either side expects fewer than 5 are pooled into one."""
    na, nb = sum(a), sum(b)
    cells, pooled = [], [0, 0]
    for x, y in zip(a, b):
        if not x + y:
            continue
        if min(na, nb) * (x + y) / (na + nb) < 5:
            pooled = [pooled[0] + x, pooled[1] + y]
        else:
            cells.append((x, y))
    if sum(pooled):
        cells.append((pooled[0], pooled[1]))
    stat = 0.0
    for x, y in cells:
        total = x + y
        for observed, n in ((x, na), (y, nb)):
            e = n * total / (na + nb)
            stat += (observed - e) ** 2 / e
    df = len(cells) - 1
    critical = chi2_critical(df)
    return stat < critical, f"chi2={stat:.2f} df={df} critical={critical:.2f} a={a} b={b}"


def inverse_cdf(probs: torch.Tensor, seed: int) -> int:
    """The id the generator of `seed` draws from `probs` by inverse transform sampling, in plain Python: the first
    whose running sum (float64) reaches (1 - u) of the total, u that generator's first float64 uniform."""
    u = float(torch.rand((), dtype=torch.float64, generator=new_generator(seed)))
    total, running = sum(probs.double().tolist()), 0.0
    for i, p in enumerate(probs.double().tolist()):
        running += p
        if running >= (1 - u) * total:
            return i
    raise AssertionError("no id reached")
