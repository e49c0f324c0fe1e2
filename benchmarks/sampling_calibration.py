"""Sampling parity's statistics, calibrated: how often (b) fails a correct engine (false alarms) and
how often it fails and names each broken sampler (detection), side by side with binomial 95 % intervals
(Wilson), over simulated engines (tests/parity/sampler_simulation.py: only the engine's outcomes are
simulated; every run goes through parity.sampling.check_sampled, as compare_sampled calls it). Then,
with --tiny, the tiny pair's own runs (our loop under greedy-drafts, a correct engine): the variance
per round that (b)'s tau test uses, and how many prompts it needs to see a change of 0.1 in tau.

    .venv/bin/python benchmarks/sampling_calibration.py                 # about 3 minutes on 2 cores
    .venv/bin/python benchmarks/sampling_calibration.py --tiny          # + the tiny pair, a few more
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "parity"))
from sampler_simulation import (  # noqa: E402
    binomial_interval, describe_p, names_sampler, null_cases, simulate_run, suite_cases,
)

from eagle31_export.parity.sampling import ALPHA, CORRECTION, TAU_CHANGE, Z_80_POWER, Z_95  # noqa: E402

SAMPLERS = ("p squared", "draft not masked", "uniform p", "one-hot p", "garbage temperature")
Z_95_POWER = statistics.NormalDist().inv_cdf(0.95)


def _rate(k: int, n: int) -> str:
    low, high = binomial_interval(k, n)
    return f"{k:>5}/{n:<5} {k / n:7.4f} [{low:.4f}, {high:.4f}]"


def false_alarms(runs: int, seed: int) -> None:
    cases = null_cases()
    print(f"## A correct engine (the rule's own sampler): runs failing (b), alpha {ALPHA:g}, {CORRECTION}")
    print(f"{'case':38} {'mean p1':>7} {'p(1-p)':>6} {'rounds':>6} | {'failed/runs':>11} {'rate':>7} {'95 %':>17}")
    total, failed = 0, 0
    per_case = max(runs // len(cases), 1)
    for c in cases:
        mean_p, var_p, rounds = describe_p(c, 5, seed + 999_999)
        k = sum(bool(simulate_run(c, "correct", seed + i).failures()) for i in range(per_case))
        total, failed = total + per_case, failed + k
        print(f"{c.name:38} {mean_p:7.3f} {var_p:6.3f} {rounds:6.0f} | {_rate(k, per_case)}")
    print(f"{'all cases':38} {'':7} {'':6} {'':6} | {_rate(failed, total)}")


def detection(runs: int, seed: int) -> None:
    cases = suite_cases(((8, 32), (8, 48), (4, 32)))
    print("\n## Broken samplers: runs failing (b) and naming the engine's sampling, tiny pair's p")
    print(f"{'case':24} " + " | ".join(f"{s:^32}" for s in ("correct (false alarms)", *SAMPLERS)))
    for c in cases:
        row = []
        for sampler in ("correct", *SAMPLERS):
            checks = [simulate_run(c, sampler, seed + i) for i in range(runs)]
            k = sum((bool(x.failures()) if sampler == "correct" else names_sampler(x)) for x in checks)
            row.append(_rate(k, runs))
        print(f"{c.name:24} " + " | ".join(row), flush=True)


def tiny_pair(max_new_tokens: int, prompts: int) -> None:
    """Our loop over the tiny pair under greedy-drafts (a correct engine), replayed and checked as parity
    does; the tau test's variance per round, and prompts for a 0.1 change in tau."""
    from eagle31_export.demo.pair import DRAFTERS, TARGET, EmbeddedPair
    from eagle31_export.parity.numerics import TIE_ERRORS
    from eagle31_export.parity.sampling import check_sampled
    from eagle31_export.reference.speculate import Sampling
    from eagle31_export.runtime.registry import PairSource, load_speculator

    pair = EmbeddedPair.open(ROOT / "examples" / "tiny" / "models")
    held_out = pair.held_out_prompts(48)[:prompts]
    print(f"\n## The tiny pair, our loop under greedy-drafts: {prompts} held-out prompts x {max_new_tokens} tokens, "
          "depth 3, seeds 0..")
    print("prompts for a change of 0.1 in tau: rounds = ((z_test + z_power) / 0.1)^2 x variance per round, "
          "prompts = rounds / rounds per prompt")
    for name in ("EAGLE 3.1", "EAGLE-3"):
        speculator = load_speculator("reference", PairSource.of(pair.folder / DRAFTERS[name], pair.folder / TARGET))
        for temperature in (0.7, 1.0):
            sampling = Sampling(temperature, rule="greedy-drafts")
            replays = []
            for i, prompt in enumerate(held_out):
                run = speculator.run(prompt, max_new_tokens, 3, sampling, i)
                replays.append(speculator.replay_sampled(prompt, run, sampling))
            check = check_sampled(replays, 3, None, TIE_ERRORS)  # the law's figures: no tie is read here
            per_round = check.variance / check.rounds
            m = len(check.law_tests)
            z_verdict = statistics.NormalDist().inv_cdf(1 - ALPHA / (2 * m))
            positions = ", ".join(f"{law.position}: {law.accepted}/{law.reached} vs {law.expected:.1f}"
                                  for law in check.positions)
            print(f"{name:9} T {temperature}: {check.rounds} rounds, accepted/reached vs expected per position "
                  f"{positions}; variance per round {per_round:.4f}; PASS={not check.failures()}")
            for label, z_test, z_power in (("95 % two-sided, 80 % power", Z_95, Z_80_POWER),
                                           (f"the verdict's tau test (alpha {ALPHA:g} / {m} tests, two-sided), "
                                            "95 % power", z_verdict, Z_95_POWER)):
                rounds = ((z_test + z_power) / TAU_CHANGE) ** 2 * per_round
                need = check.prompts_to_see(TAU_CHANGE, z_test, z_power)
                print(f"    {label}: (({z_test:.3f} + {z_power:.3f}) / {TAU_CHANGE})^2 x {per_round:.4f} = "
                      f"{rounds:.0f} rounds / {check.rounds / len(held_out):.1f} per prompt = {need} prompts")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--null-runs", type=int, default=4000, help="correct-engine runs, spread over the cases")
    parser.add_argument("--runs", type=int, default=300, help="runs per sampler and run length")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--tiny", action="store_true", help="also the tiny pair's variance and prompts needed")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--prompts", type=int, default=8)
    args = parser.parse_args()
    start = time.perf_counter()
    false_alarms(args.null_runs, args.seed)
    detection(args.runs, args.seed + 10 ** 6)
    if args.tiny:
        tiny_pair(args.max_new_tokens, args.prompts)
    print(f"\n{time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
