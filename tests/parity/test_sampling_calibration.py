"""Sampling parity's statistics, calibrated by simulation (tests/parity/sampler_simulation.py): a
correct engine's rule fails no more often than the family-wise alpha allows, and every broken sampler
we know is detected and named at the run lengths the suite's sampling tests use. The runs go through
`check_sampled`, the entry point `compare_sampled` calls; only the engine's outcomes are simulated.
benchmarks/sampling_calibration.py runs the same with more runs and prints the rates."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

from eagle31_export.parity.sampling import ALPHA, ENGINE_EMITS, ENGINE_FEWER, ENGINE_MORE, check_sampled
from eagle31_export.parity.tails import exceedance_p, holm, tails, two_sided_p
from eagle31_export.reference.replay import SampledRound

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sampler_simulation import (  # noqa: E402
    Case, TINY_07, TINY_10, names_sampler, null_cases, simulate_run, suite_cases,
)
from eagle31_export.parity.numerics import TIE_ERRORS  # noqa: E402

ERROR = 1e-4 / TIE_ERRORS  # the measured error of every simulated draft step: ties within 1e-4

def sampled_check(replays, error: float = ERROR):
    """check_sampled at depth 3 with every draft step's measured error `error`: a tie is a top-2 margin
    within TIE_ERRORS x error (1e-4 by default)."""
    return check_sampled(replays, 3, [[[error] * len(r.margins) for r in rounds] for rounds in replays], TIE_ERRORS)

BROKEN = ("p squared", "draft not masked", "uniform p", "one-hot p", "garbage temperature")


def _binomial_upper(n: int, p: float, beyond: float = 1e-3) -> int:
    """The least c with P(Binomial(n, p) > c) <= beyond: what chance allows a calibrated rate."""
    c, term = 0, (1 - p) ** n
    cumulative = term
    while 1 - cumulative > beyond:
        term *= (n - c) / (c + 1) * p / (1 - p)
        c += 1
        cumulative += term
    return c


def test_exact_tails_where_the_normal_approximation_fails():
    # p = 0.995, one rejection in 10 rounds: z = -4.3, but a correct sampler does it 4.9 % of the time
    below, above = tails(9, [0.995] * 10)
    assert below == pytest.approx(1 - 0.995 ** 10) and above == pytest.approx(0.995 ** 10 + 10 * 0.005 * 0.995 ** 9)
    assert two_sided_p(9, [0.995] * 10) == pytest.approx(2 * (1 - 0.995 ** 10))
    # hand-computed Poisson-binomial: p = (0.2, 0.5): P(0) = 0.4, P(1) = 0.5, P(2) = 0.1
    assert tails(1, [0.2, 0.5]) == pytest.approx((0.9, 0.6)) and tails(2, [0.2, 0.5]) == pytest.approx((1.0, 0.1))
    # three events each at most 2 % likely: P <= 0.02^3 x the grid's size, and never above the truth's bound
    assert 0.02 ** 3 <= exceedance_p(3, [0.02] * 3) <= 0.02 ** 3 * 41 * 1.01
    assert exceedance_p(0, [0.5]) == 1.0 and exceedance_p(2, [0.5]) == 0.0
    # Holm: 1e-4 <= 1e-3 / 3, 5e-4 <= 1e-3 / 2, 0.3 > 1e-3 stops
    assert holm([5e-4, 0.3, 1e-4], 1e-3) == [True, False, True]
    assert holm([6e-4, 6e-4], 1e-3) == [False, False]


def _rejected_at_one(index: int) -> SampledRound:
    return SampledRound(index, 10 + 2 * index, 0, [5], [4, 6, 7], [1.0, 1.0, 1.0], [0.999, None, None],
                        [0.001, None, None])


def test_a_position_reached_too_rarely_is_inconclusive_not_failed():
    """At p = 0.999 a rejection in each of 5 rounds is far outside the law, but 5 rounds are below
    MIN_REACHED: no failure, and the PASS says it is inconclusive there."""
    check = sampled_check([[_rejected_at_one(i) for i in range(5)]])
    assert check.failures() == [] and check.inconclusive_reasons() and "position 1: 5" in \
        check.inconclusive_reasons()[0]
    # only the emits test runs (none of the 5 rejections emitted the draft); no count is tested
    assert [(t.kind, t.rejected) for t in check.law_tests] == [("emits", False)]
    # the same 5 rounds among 10 that accepted: the count is tested (P(5 or fewer of 10) at 0.999 ~ 2.5e-13)
    accepted = [SampledRound(5 + i, 30 + 2 * i, 1, [4, 6], [4, 6, 7], [1.0] * 3, [0.999, 0.5, None],
                             [0.001, 0.3, None]) for i in range(5)]
    check = sampled_check([[_rejected_at_one(i) for i in range(5)] + accepted])
    assert check.sampler_wrong and ENGINE_FEWER in check.failures()[0]


def test_ties_are_decided_before_the_outcome():
    """A tie position counts in (b) whatever it committed: with its draft committed or not, the rounds
    reaching it are the same, and it is counted as a tie either way."""
    tie = (1.0, 1e-6, 1.0)
    hit = SampledRound(0, 10, 2, [4, 6, 9], [4, 6, 7], list(tie), [0.5, 0.5, 0.5], [0.2, 0.2, 0.2])
    flipped = SampledRound(0, 10, 2, [4, 3, 9], [4, 6, 7], list(tie), [0.5, 0.5, None], [0.2, 0.2, None])
    a, b = sampled_check([[hit]]), sampled_check([[flipped]])
    assert [law.reached for law in a.positions[:2]] == [law.reached for law in b.positions[:2]] == [1, 1]
    assert a.positions[1].ties == b.positions[1].ties == 1
    assert a.failures() == b.failures() == [] and len(b.prompts[0].ties) == 1


def test_a_correct_engine_fails_at_most_alpha():
    """1000 simulated runs of the rule's own sampler over varied p (the tiny pair's, high, near 1), tie
    shares (0, 30 %, where the engine drafts the runner-up half the time) and lengths (4 x 32 .. 16 x 96
    prompts x tokens): failures within what chance allows at the family-wise ALPHA."""
    cases = null_cases()
    runs = 1000
    failed = [(cases[k % len(cases)].name, check.failures()) for k in range(runs)
              if (check := simulate_run(cases[k % len(cases)], "correct", k)).failures()]
    allowed = _binomial_upper(runs, ALPHA)
    print(f"correct engine: {len(failed)} of {runs} runs failed (alpha {ALPHA:g}, chance allows {allowed})")
    assert len(failed) <= allowed, failed


@pytest.mark.parametrize("sampler", BROKEN)
def test_each_broken_sampler_is_detected_and_named(sampler):
    """At the suite's run lengths for broken samplers (8 x 32 as the vLLM engine tests, 8 x 48 as ours) and
    the tiny pair's p: at least 99 % of runs fail, naming the engine's sampling, never the drafter."""
    cases = suite_cases()
    runs = 120
    checks = [simulate_run(cases[k % len(cases)], sampler, 10_000 + k) for k in range(runs)]
    named = sum(names_sampler(check) for check in checks)
    print(f"{sampler}: {named} of {runs} runs failed naming the sampler")
    assert named >= math.ceil(0.99 * runs), [c.failures() for c in checks if not names_sampler(c)][:3]
    assert all(any(side in f for side in (ENGINE_FEWER, ENGINE_MORE, ENGINE_EMITS)) for c in checks
               for f in c.failures())


def test_an_unmasking_sampler_is_named_at_its_suite_length():
    """4 x 32, the length of tests/test_sampling_parity.py's unmasking check: a rejection that emits the
    draft, with the greedy run clearing the drafter, names the sampler."""
    cases = suite_cases(((4, 32),))
    checks = [simulate_run(cases[k % len(cases)], "draft not masked", 20_000 + k) for k in range(100)]
    assert sum(names_sampler(check) for check in checks) >= 99


def test_a_failing_b_names_every_cause_and_what_greedy_found():
    check = simulate_run(Case("tiny T 0.7, 8 x 32", 8, 32, **TINY_07), "p squared", 7)
    assert check.failures() and check.greedy is not None
    for said in check.failures():
        assert "rejection sampler" in said and "sampling parameters" in said and "target's probabilities" in said
        assert "its target's tokens are the reference target's" in said
    check.greedy.target_tokens = ["prompt 0, token 3: reference logit gap 2.1"]
    assert check.at_fault == "target" and check.failures()[0].startswith("the target: run greedy")
    check.greedy = None
    assert check.at_fault == "sampler" and all("were not checked" in f for f in check.failures())
    flat = simulate_run(Case("tiny T 1.0, 4 x 32", 4, 32, **TINY_10), "correct", 3)
    assert flat.failures() == [] and flat.at_fault is None


@pytest.mark.parametrize("sampler", ("correct", "p squared"))
def test_a_drafter_that_is_off_is_named_not_the_sampler(sampler):
    """The same simulation with the engine's drafter off (the runner-up drafted at 20 % of the positions
    that are no tie, in the sampled run and the greedy one): every run fails naming the drafter, so that
    a failure naming the sampler alone is never a drafter's bug (names_sampler above can fail)."""
    case = Case("tiny T 0.7, 8 x 32, drafter off", 8, 32, drafter_off=0.2, **TINY_07)
    checks = [simulate_run(case, sampler, 30_000 + k) for k in range(40)]
    assert all(check.failures() and "drafter" in check.at_fault for check in checks), \
        [(c.at_fault, c.failures()[:1]) for c in checks if not c.failures() or "drafter" not in c.at_fault][:3]
    assert not any(names_sampler(check) for check in checks)
