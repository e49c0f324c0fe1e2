"""Simulated engines under the greedy-drafts rule, fed to sampling parity's real entry point.

Only the engine's outcomes are simulated: per draft position a target distribution p (softmax of
random logits over VOCAB tokens, at the case's temperature) and a drafter whose argmax is the draft;
an engine drafts it (or, at a numerical tie, the drafter's runner-up half the time), verifies it with
its sampler, and commits tokens until max_new_tokens. What the reference would say of each round
(its drafts, the drafter's top-2 margin, p of each draft along the run's own sequence, the largest p
of another token) becomes a `reference.replay.SampledRound`, exactly as `replay_sampled` builds them,
and `parity.sampling.check_sampled` judges the run as `parity.compare.compare_sampled` does; where the
check asks for the greedy run, that run is simulated too, from the same engine's drafter: a faithful
drafter drafts the reference's argmax (the runner-up half the time at a tie), one that is off
(`drafter_off`) also drafts the runner-up at other positions, in the sampled run and the greedy one
alike, so the greedy check finds it (what `compare._greedy_drafts` returns for such an engine) and the
failure must name the drafter, not the sampler.

The target's p depends on the rounds before: after an accepted draft the next position's logits are
sharper (`after_accept`), as text a drafter predicts tends to be predictable, so the statistics are
checked where p is not fixed in advance.

Samplers: the rule's own (`correct`), and the broken ones parity must catch: accepting with p squared,
a recovery that does not mask the draft, p uniform (a huge temperature), p one-hot (a tiny one), and a
garbage temperature per token (vLLM's CPU build as shipped, vllm#55005: each token's temperature is
whatever memory held, here a quarter each the right one, 1e4, 1e-4 and NaN; NaN probabilities never
accept and the recovery's only finite score is the masked draft's, so it emits the draft).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from eagle31_export.parity.numerics import TIE_ERRORS
from eagle31_export.parity.sampling import ALPHA, GreedyDrafts, SamplingCheck, check_sampled
from eagle31_export.reference.replay import SampledRound

VOCAB = 64
DEPTH = 3
ERROR = 1e-5  # every draft step's measured error; margins that are no tie lie 1e5 errors apart
TIE_MARGIN = 0.0  # a tie: the best two equal, which a faithful engine flips half the time (the budget's model)
GARBAGE_TEMPERATURES = (None, 1e4, 1e-4, math.nan)  # None: the run's own temperature


@dataclass(frozen=True)
class Case:
    """A family of simulated runs: the run length, and how the target's p and the drafter behave."""

    name: str
    prompts: int
    max_new_tokens: int
    sharpness: float  # scale of the target's logits: larger puts more mass on fewer tokens
    drafter_noise: float  # the drafter's logits are the target's plus noise of this scale
    tie_share: float = 0.0  # positions whose drafter top-2 margin is a tie
    temperature: float = 1.0
    after_accept: float = 1.3  # the next position's sharpness after an accepted draft, relative
    drafter_off: float = 0.0  # how often the engine's drafter drafts the runner-up where it is no tie (a bug)


# the tiny pair's mean p(d) at draft position 1 (benchmarks/sampling_calibration.py --tiny, 8 held-out prompts x
# 32 tokens, expected / reached there): 0.26-0.30 at T 0.7, 0.15-0.17 at T 1.0; TINY_07 and TINY_10 give about
# that (the benchmark prints each case's mean p and p (1 - p))
TINY_07 = dict(sharpness=1.8, drafter_noise=1.0, temperature=0.7)
TINY_10 = dict(sharpness=1.6, drafter_noise=1.0, temperature=1.0)
HIGH_P = dict(sharpness=6.0, drafter_noise=0.5, temperature=0.7)
NEAR_ONE = dict(sharpness=14.0, drafter_noise=0.0, temperature=0.7, after_accept=1.0)


def suite_cases(lengths=((8, 32), (8, 48))) -> list[Case]:
    """The run lengths (prompts x max new tokens) of the suite's tests of broken samplers: 8 x 32 (the
    vLLM engine tests), 8 x 48 (p squared, tests/test_sampling_parity.py), at the tiny pair's p; 4 x 32
    is the unmasking test's there."""
    return [Case(f"tiny T {p['temperature']}, {n} x {t}", n, t, **p) for n, t in lengths for p in (TINY_07, TINY_10)]


def null_cases() -> list[Case]:
    """Varied p, tie shares and lengths, for a correct engine."""
    out = []
    for label, p in (("tiny T 0.7", TINY_07), ("tiny T 1.0", TINY_10), ("high p", HIGH_P), ("p near 1", NEAR_ONE)):
        for ties in (0.0, 0.3):
            for n, t in ((4, 32), (8, 32), (8, 48), (16, 96)):
                out.append(Case(f"{label}, ties {ties:.0%}, {n} x {t}", n, t, tie_share=ties, **p))
    return out


def _softmax(logits: np.ndarray) -> np.ndarray:
    e = np.exp(logits - logits.max())
    return e / e.sum()


def _sample(p: np.ndarray, rng: np.random.Generator, masked: int | None = None) -> int:
    """A token from p (with `masked` removed and the rest renormalised) by its inverse CDF."""
    w = p.copy()
    if masked is not None:
        w[masked] = 0.0
    cum = np.cumsum(w)
    return int(min(np.searchsorted(cum, rng.random() * cum[-1], side="right"), len(p) - 1))


def _verify(sampler: str, p: np.ndarray, logits: np.ndarray, temperature: float, draft: int,
            rng: np.random.Generator) -> int | None:
    """None: the draft accepted; else the token the engine emits at the rejection."""
    if sampler == "garbage temperature":
        t = GARBAGE_TEMPERATURES[int(rng.integers(len(GARBAGE_TEMPERATURES)))]
        if t is not None and math.isnan(t):
            return draft  # NaN probabilities: never accepted, and the masked draft is the only finite score
        p = p if t is None else _softmax(logits / t)
    elif sampler == "uniform p":
        p = np.full_like(p, 1 / len(p))
    elif sampler == "one-hot p":
        p = np.eye(len(p))[int(np.argmax(p))]
    accept = p[draft] ** 2 if sampler == "p squared" else p[draft]
    if rng.random() < accept:
        return None
    if sampler == "draft not masked":
        return _sample(p, rng)
    if p[draft] >= 1.0:  # nothing left once the draft is masked (one-hot on the draft): never reached
        return draft
    return _sample(p, rng, masked=draft)


def simulate_prompt(case: Case, sampler: str, rng: np.random.Generator) -> list[SampledRound]:
    """One prompt's rounds as the reference's replay would give them."""
    rounds, made, start = [], 0, 0
    sharp = case.sharpness
    while made < case.max_new_tokens:
        drafts, margins, p_drafts, rivals, committed, accepted = [], [], [], [], [], 0
        on_path = True  # the run's sequence still follows the reference's drafts
        ended = False
        for i in range(DEPTH):
            tie = rng.random() < case.tie_share
            margins.append(TIE_MARGIN if tie else 1.0)
            if ended:  # past the rejection: the reference's draft is never compared
                drafts.append(int(rng.integers(VOCAB)))
                p_drafts.append(None)
                rivals.append(None)
                continue
            noise = rng.standard_normal((2, VOCAB))
            logits = sharp * noise[0]
            drafter = logits + case.drafter_noise * noise[1]
            first = int(np.argmax(drafter))
            drafter[first] = -np.inf
            second = int(np.argmax(drafter))
            drafts.append(first)
            p = _softmax(logits / case.temperature)
            others = p.copy()
            others[first] = 0.0
            p_drafts.append(float(p[first]) if on_path else None)
            rivals.append(float(others.max()) if on_path else None)
            off = rng.random() < (0.5 if tie else case.drafter_off)
            theirs = second if off else first
            emitted = _verify(sampler, p, logits, case.temperature, theirs, rng)
            if emitted is None:
                committed.append(theirs)
                accepted += 1
                on_path = on_path and theirs == first
                sharp *= case.after_accept
            else:
                committed.append(emitted)
                ended = True
        if not ended:  # every draft accepted: the bonus token
            committed.append(_sample(_softmax(sharp * rng.standard_normal(VOCAB) / case.temperature), rng))
        sharp = case.sharpness
        kept = committed[: case.max_new_tokens - made]  # max_new_tokens cuts the last round
        # p of draft i is known where the run's sequence holds the tokens before it (replay_sampled)
        for i in range(DEPTH):
            if i > accepted or i > len(kept) or kept[:i] != drafts[:i]:
                p_drafts[i], rivals[i] = None, None
        rounds.append(SampledRound(len(rounds), start, accepted, kept, drafts, margins, p_drafts, rivals))
        start += len(committed)
        made += len(committed)
    return rounds


def simulate_run(case: Case, sampler: str, seed: int, alpha: float = ALPHA) -> SamplingCheck:
    """One simulated run judged by `check_sampled`, with the greedy run where the check asks for it."""
    rng = np.random.default_rng(seed)
    replays = [simulate_prompt(case, sampler, rng) for _ in range(case.prompts)]
    errors = [[[ERROR] * len(r.margins) for r in rounds] for rounds in replays]
    check = check_sampled(replays, DEPTH, errors, TIE_ERRORS, alpha)
    if check.wants_greedy:
        check.greedy = simulate_greedy(case, rng, check.rounds)
    return check


def simulate_greedy(case: Case, rng: np.random.Generator, rounds: int) -> GreedyDrafts:
    """The same engine run greedy over the prompts and judged round by round: its drafter drafts the
    reference's argmax, the runner-up half the time at a tie (a tie, listed) and `drafter_off` of the
    time elsewhere (a difference beyond a tie, the drafter's); a round ends at its first difference.
    Its target is the reference's: its tokens agree."""
    ties, untied = 0, []
    for r in range(rounds):
        for i in range(DEPTH):
            tie = rng.random() < case.tie_share
            if rng.random() < (0.5 if tie else case.drafter_off):
                if tie:
                    ties += 1
                else:
                    untied.append(f"round {r}, draft position {i + 1}: the engine drafted the reference's choice 2")
                break
    return GreedyDrafts(case.prompts, rounds, ties, untied)


def names_sampler(check: SamplingCheck) -> bool:
    """The run fails and the failure names the engine's sampling."""
    return bool(check.failures()) and check.at_fault == "sampler"


def binomial_interval(k: int, n: int, z: float = 1.959964) -> tuple[float, float]:
    """Wilson's 95 % interval for k events in n runs."""
    if n == 0:
        return 0.0, 1.0
    phat, z2 = k / n, z * z
    centre = (phat + z2 / (2 * n)) / (1 + z2 / n)
    half = z * math.sqrt(phat * (1 - phat) / n + z2 / (4 * n * n)) / (1 + z2 / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def describe_p(case: Case, runs: int = 20, seed: int = 0) -> tuple[float, float, float]:
    """(mean p(d) at position 1, mean p (1 - p) there, rounds per run) of a correct engine in `case`."""
    ps, rounds = [], 0
    for k in range(runs):
        check = simulate_run(case, "correct", seed + k)
        ps += check.positions[0].p_drafts
        rounds += check.rounds
    return float(np.mean(ps)), float(np.mean([p * (1 - p) for p in ps])), rounds / runs
