"""Sampling parity at C > 1: greedy requests batched with sampled ones must decode greedily, exactly.

An engine samples a whole batch at once: each request's temperature, top-k and top-p are expanded to
its tokens, and a greedy request's argmax is taken on the same logits tensor (vLLM:
`v1/sample/rejection_sampler.py: apply_sampling_constraints`, then `rejection_sample`). Where that
expansion is wrong (vLLM's CPU build as shipped, vllm#55005), the greedy requests of a mixed batch
follow other requests' sampling parameters, which a batch of greedy requests alone never shows. So
at each level C > 1 every prompt is sent with C requests in flight, even-numbered prompts greedy and
odd-numbered ones sampled, and each greedy request is replayed against the reference drafter and
target: every round as the reference's, numerical ties aside, judged by the one tie rule (parity/ties.py:
`judge`, against the error the runtime's precision measurably makes at each decision; TIE_ERRORS and the
tie budget's constants and where they come from: parity/numerics.py). A level whose greedy requests
show more ties than that precision explains fails as the engine's sampling of mixed batches too.
Differences past max_new_tokens are listed apart, not judged, never counted as ties.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from eagle31_export.parity.numerics import BUDGET_ALPHA, TieBudget
from eagle31_export.parity.ties import Judged
from eagle31_export.progress import Phases
from eagle31_export.reference.speculate import Sampling, SpecResult
from eagle31_export.runtime.registry import Speculator

MIXED_BATCHES = ("the engine's sampling of mixed batches: a greedy request batched with sampled ones did not decode "
                 "greedily (its argmax follows sampling parameters that are not its own)")


@dataclass
class MixedBatchRow:
    """One level C of mixed batches: which prompts went greedy, and what their replay found."""

    concurrency: int
    greedy_prompts: list[int]
    sampled_prompts: list[int]
    exact_prompts: list[int] = field(default_factory=list)  # greedy, every round the reference's (ties aside)
    ties: list[str] = field(default_factory=list)
    untied: list[str] = field(default_factory=list)  # the first difference beyond a tie of each differing prompt
    past_cut: list[str] = field(default_factory=list)  # differences past max_new_tokens: not judged, not ties
    tie_budget: dict | None = None  # the greedy requests' ties against what the precision explains
    largest_batch: int | None = None  # the most requests the engine ran together (its figures; None: not told)
    client_in_flight: int | None = None  # the most requests the client itself had in flight at once (None: not told)


def mixed_samplings(count: int, sampling: Sampling) -> list:
    """What each request of a mixed run samples by: even-numbered greedy, odd-numbered `sampling`."""
    return [0.0 if i % 2 == 0 else sampling for i in range(count)]


def check_mixed_batches(runtime: Speculator, prompts: list[list[int]], depth: int, max_new_tokens: int,
                        sampling: Sampling, seed: int, levels: tuple[int, ...],
                        judged: Callable[[int, SpecResult], Judged | None],
                        progress=None) -> tuple[list[MixedBatchRow], list[str]]:
    """Rows for each level C > 1 (phase `mixed_batches`, one unit a level) and the failures. `judged`:
    (prompt index, a greedy run of it) -> the run against the reference replayed along it (parity/ties.py)."""
    rows, failures, extra = [], [], [c for c in levels if c > 1]
    phases = Phases.of(progress)
    samplings = mixed_samplings(len(prompts), sampling)
    greedy = [i for i, s in enumerate(samplings) if s == 0.0]
    with phases.phase("mixed_batches", total=len(extra)):
        for n, c in enumerate(extra):
            run = runtime.run_concurrently(prompts, max_new_tokens, depth, c, samplings, seed)
            row = MixedBatchRow(c, greedy, [i for i in range(len(prompts)) if i not in greedy],
                                largest_batch=run.batching.largest if run.batching is not None else None,
                                client_in_flight=run.batching.in_flight if run.batching is not None else None)
            budget = TieBudget()
            for i in greedy:
                found = judged(i, run.results[i])
                if found is None:
                    row.untied.append(f"prompt {i}: its rounds cannot be aligned with the reference's")
                    continue
                budget.add(found.budget)
                row.ties += [f"prompt {i}: {d.describe()}" for d in found.ties]
                row.past_cut += [f"prompt {i}: {d.describe()}" for d in found.past_cut]
                if found.untied:
                    row.untied.append(f"prompt {i}: {found.untied[0].describe()}")
                else:
                    row.exact_prompts.append(i)
            row.tie_budget = budget.to_json()
            if row.untied:
                failures.append(f"concurrency {c}, greedy requests among sampled ones: {len(row.untied)} of "
                                f"{len(greedy)} differ from the reference beyond numerical ties (first: "
                                f"{row.untied[0]}): {MIXED_BATCHES}")
            elif budget.exceeded:
                failures.append(f"concurrency {c}, greedy requests among sampled ones: {budget.observed} numerical "
                                f"ties, more differences than the runtime's precision explains ({budget.expected:.2g} "
                                f"expected over {budget.decisions} decisions, at most {budget.allowed} at p = "
                                f"{BUDGET_ALPHA:g}): {MIXED_BATCHES}")
            rows.append(row)
            phases("mixed_batches", n + 1, len(extra))
    return rows, failures
