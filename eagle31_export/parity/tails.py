"""Exact tails and a family-wise correction for sampling parity's counts (parity/sampling.py).

- `two_sided_p`: a count of events, each with its own probability p_j given the rounds before it,
  against the Poisson-binomial law of those p_j, computed exactly (no normal approximation: at
  p = 0.995 one miss in 10 rounds has P = 0.049, where a z-score says -4.3). Two-sided: twice the
  smaller tail, at most 1.
- `exceedance_p`: a count of events whose probabilities are only bounded above (b_j), against those
  bounds: exp(lambda X - sum log(1 + b_j (e^lambda - 1))) is a supermartingale of mean at most 1 for
  any FIXED lambda, so P(X >= x) <= min over lambda of exp(-lambda x + sum log(1 + b_j (e^lambda - 1)))
  holds for each lambda alone; the minimum is taken over the fixed grid LAMBDAS and paid for by a
  union bound (times len(LAMBDAS)), so the bound holds however the data fall.
- `holm`: Holm's step-down correction, so that the whole family of tests fails a correct engine at
  most `alpha` of the time.
"""

from __future__ import annotations

import math

import numpy as np

# 1/64 .. 16 in steps of 2^(1/4): wide enough for a tiny bound crossed once (lambda near log(1 / b))
LAMBDAS = tuple(2 ** (k / 4) / 64 for k in range(41))
NEGLIGIBLE = 1e-300  # probability mass below this is dropped from the ends of the Poisson-binomial law


def poisson_binomial(ps) -> tuple[int, np.ndarray]:
    """(offset, pmf): P(count = offset + k) = pmf[k] for independent Bernoulli(p_j), exactly (a
    dynamic programme in float64; the negligible ends are trimmed as it goes)."""
    offset, pmf = 0, np.ones(1)
    for p in ps:
        grown = np.empty(len(pmf) + 1)
        grown[:-1] = pmf * (1 - p)
        grown[-1] = 0.0
        grown[1:] += pmf * p
        kept = np.nonzero(grown > NEGLIGIBLE)[0]
        if len(kept) == 0:  # cannot happen with probabilities in [0, 1]; stay defined
            return offset, grown
        offset += int(kept[0])
        pmf = grown[kept[0]: kept[-1] + 1]
    return offset, pmf


def tails(observed: int, ps) -> tuple[float, float]:
    """(P(count <= observed), P(count >= observed)) under the Poisson-binomial law of `ps`."""
    offset, pmf = poisson_binomial(ps)
    k = observed - offset
    below = float(pmf[: max(k + 1, 0)].sum()) if k >= 0 else 0.0
    above = float(pmf[max(k, 0):].sum()) if k < len(pmf) else 0.0
    return min(below, 1.0), min(above, 1.0)


def two_sided_p(observed: int, ps) -> float:
    """The exact two-sided p-value of `observed` events against Bernoulli(p_j): twice the smaller tail."""
    below, above = tails(observed, ps)
    return min(1.0, 2 * min(below, above))


def exceedance_p(observed: int, bounds) -> float:
    """A bound on P(count >= observed) where event j happens with probability at most bounds[j] given
    those before it: the Chernoff bound's minimum over the fixed grid LAMBDAS, times its size."""
    if observed <= 0:
        return 1.0
    b = np.clip(np.asarray(list(bounds), dtype=float), 0.0, 1.0)
    if observed > len(b):
        return 0.0
    best = min(-lam * observed + float(np.log1p(b * math.expm1(lam)).sum()) for lam in LAMBDAS)
    return min(1.0, len(LAMBDAS) * math.exp(best))


def holm(p_values: list[float], alpha: float) -> list[bool]:
    """Which hypotheses Holm's step-down procedure rejects at family-wise rate `alpha`: the k-th
    smallest p-value (from 0) against alpha / (m - k), stopping at the first that is not below."""
    m, rejected = len(p_values), [False] * len(p_values)
    for k, i in enumerate(sorted(range(m), key=lambda i: p_values[i])):
        if p_values[i] > alpha / (m - k):
            break
        rejected[i] = True
    return rejected
