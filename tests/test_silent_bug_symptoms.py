"""The verdict's words for the silent bugs no draft-position rule names (docs/silent-bugs.md): a runtime that
accepts more than the reference (its verification or its metrics; two-sided everywhere, greedy and sampled),
and differences that wait for the context to grow (positions, rope, a sliding window). On constructed
runtime results: no engine here accepts more than its target allows (TensorRT-LLM's NaN logits are a GPU
path), and the window's engine measurement is tests/test_vllm_silent_bugs.py."""

from __future__ import annotations

import torch

from eagle31_export.parity.compare import (
    ACCEPTS_MORE, ACCEPTS_MORE_UNSEEN, CONTEXT_DEPENDENT, LATER_POSITIONS, POSITION_1, ParityReport, PromptRow,
    Thresholds, _failures, compare_prompt,
)
from eagle31_export.parity.numerics import Measured
from eagle31_export.parity.symptoms import CONTEXT_P, context_dependence
from eagle31_export.reference.speculate import SpecResult, Top

VOCAB, DEPTH = 16, 3


def top(best: int, gap: float = 5.0) -> Top:
    """Candidates with `best` first and every other token `gap` below it (far beyond any tie)."""
    logits = torch.full((VOCAB,), -gap)
    logits[best] = 0.0
    return Top.of(logits)


def reference(tokens: list[int], drafts: list[list[int]], accepted: list[int]) -> SpecResult:
    """A replay result: the target's greedy `tokens`, the drafter's `drafts` with their candidates."""
    return SpecResult(tokens=tokens, drafts=drafts, accepted_per_step=accepted, depth=DEPTH,
                      token_tops=[top(t) for t in tokens], draft_tops=[[top(d) for d in r] for r in drafts])


def measured(ref: SpecResult, error: float = 1e-6) -> Measured:
    return Measured("test", [error] * len(ref.token_tops), [[error] * len(r) for r in ref.draft_tops])


def report_of(rows: list[PromptRow], exact: bool = True, temperature: float = 0.0) -> ParityReport:
    report = ParityReport("runtime", DEPTH, temperature, exact, Thresholds(), "replay")
    report.rows = rows
    report.failures = _failures(report)
    return report


# ---------------------------------------------------------------- accepts more than the reference

DRAFTS = [[5, 6, 7], [8, 9, 10]]


def test_counts_above_the_reference_fail_naming_verification_or_metrics():
    """The same tokens and the same drafts, but the runtime reports one more accepted draft in round 0
    (an engine that counts the bonus token, or verifies wrongly): a failure of its own, not a drafter's."""
    ref = reference([1, 5, 2, 8, 3], DRAFTS, [1, 0])  # round 0 accepts draft 5 only; round 1 none
    run = SpecResult(tokens=[1, 5, 2, 8, 3], drafts=DRAFTS, accepted_per_step=[2, 0], depth=DEPTH)
    row = compare_prompt(0, [0, 0, 0], ref, run, None, 1e-3, drafts_reported=True)
    assert row.symptom.endswith(ACCEPTS_MORE) and "of the same drafts where the reference accepts 1" in row.symptom
    assert POSITION_1 not in row.symptom and LATER_POSITIONS not in row.symptom
    report = report_of([row])
    assert report.verdict == "FAIL" and ACCEPTS_MORE in report.failures[0], report.failures
    # a runtime that reports no drafts: the same counts, said with what they cannot exclude
    unseen = compare_prompt(0, [0, 0, 0], ref, run, None, 1e-3, drafts_reported=False)
    assert unseen.symptom.endswith(ACCEPTS_MORE_UNSEEN)


def test_accepting_every_draft_fails_as_verification_not_as_the_target():
    """NaN logits' "accept every draft" (TensorRT-LLM PR #5146): every round accepts all 3 drafts and commits
    them, where the target's greedy tokens reject them. Judged as ties are (fp32, measured), the tokens
    differ far beyond any tie, and the symptom names the verification, not the target's weights."""
    drafts = [[5, 6, 7], [8, 9, 10]]
    run = SpecResult(tokens=[1, 5, 6, 7, 2, 8, 9, 10, 3], drafts=drafts, accepted_per_step=[3, 3], depth=DEPTH)
    # the reference target along the runtime's tokens: its greedy token is 4 wherever a draft was committed
    ref = reference([1, 5, 4, 4, 2, 4, 4, 4, 3], drafts, [1, 0])
    row = compare_prompt(0, [0], ref, run, None, 1e-3, drafts_reported=True, measured=measured(ref))
    assert row.untied and row.symptom.endswith(ACCEPTS_MORE), row.symptom
    assert "target weights" not in row.symptom
    report = report_of([row])
    assert report.verdict == "FAIL" and ACCEPTS_MORE in report.failures[0]


def test_more_and_fewer_or_other_drafts_are_not_called_the_verification():
    """Acceptance above the reference's names the verification only where it is one-sided over rounds
    compared on the same drafts: a runtime that accepts more in one round and fewer in another, or more
    of drafts of its own (a drafter that differs and drafts better), keeps the position symptom."""
    ref = reference([1, 5, 2, 8, 3], DRAFTS, [1, 1])
    both = SpecResult(tokens=[1, 5, 2, 8, 3], drafts=DRAFTS, accepted_per_step=[2, 0], depth=DEPTH)
    assert ACCEPTS_MORE not in (compare_prompt(0, [0], ref, both, None, 1e-3, drafts_reported=True).symptom or "")
    ref = reference([1, 5, 6, 8, 3], [[5, 11, 7], [8, 9, 10]], [1, 0])
    better = SpecResult(tokens=[1, 5, 6, 8, 3], drafts=[[5, 6, 7], [8, 9, 10]], accepted_per_step=[2, 0], depth=DEPTH)
    symptom = compare_prompt(0, [0], ref, better, None, 1e-3, drafts_reported=True).symptom
    assert ACCEPTS_MORE not in symptom and LATER_POSITIONS in symptom, symptom


def rates_row(index: int, reference_rates: list[float], runtime_rates: list[float], rounds: int = 400) -> PromptRow:
    return PromptRow(index, 8, True, False, True, None, 1 + sum(reference_rates), 1 + sum(runtime_rates), None,
                     reference_rates, runtime_rates, rounds, rounds)


def test_sampled_and_half_precision_acceptance_is_two_sided():
    """Above the reference fails as surely as below, each saying which way: sampled per-position rates
    (the rejection rule's two-proportion bound) and half precision's tau rule."""
    above = report_of([rates_row(0, [0.5, 0.3, 0.2], [0.7, 0.3, 0.2])], temperature=1.0)
    below = report_of([rates_row(0, [0.5, 0.3, 0.2], [0.3, 0.3, 0.2])], temperature=1.0)
    assert above.verdict == below.verdict == "FAIL"
    assert ACCEPTS_MORE in above.failures[0] and ACCEPTS_MORE not in below.failures[0]
    assert "acceptance 0.700 vs reference 0.500" in above.failures[0]
    tau_above = report_of([rates_row(0, [0.5, 0.3, 0.2], [0.7, 0.5, 0.4])], exact=False)
    tau_below = report_of([rates_row(0, [0.5, 0.3, 0.2], [0.3, 0.1, 0.0])], exact=False)
    assert tau_above.failures == [f"tau 2.600 vs reference 2.000: beyond 2%; the runtime {ACCEPTS_MORE}"]
    assert tau_below.failures == ["tau 1.400 vs reference 2.000: beyond 2%"]


# ---------------------------------------------------------------- differences that wait for the context

def test_context_dependence_is_a_permutation_test_of_the_earliest_difference():
    short = [(c, False) for c in range(5, 45)]  # 40 rounds under 45 tokens, all agreeing
    late = [(c, c % 3 == 0) for c in range(45, 61)]  # 16 rounds from 45 on, 6 of them differing
    found = context_dependence(short + late)
    assert found is not None and found["from"] == 45 and found["agree_before"] == 40
    assert (found["differ_after"], found["after"]) == (6, 16) and found["p"] < CONTEXT_P
    # the same differences spread over every context: nothing to say
    spread = [(c, c % 9 == 0) for c in range(5, 61)]
    assert context_dependence(spread) is None
    # one difference, however late, is no pattern
    assert context_dependence(short + [(70, True)]) is None
    assert context_dependence(short) is None


def rounds_result(prompt_len: int, differing: set[int], rounds: int = 8) -> tuple[SpecResult, SpecResult]:
    """A replay whose runtime accepts nothing (each round commits one token) and whose drafts differ at
    position 2 in the rounds `differing`."""
    drafts = [[5, 6, 7] for _ in range(rounds)]
    theirs = [[5, 9, 7] if r in differing else [5, 6, 7] for r in range(rounds)]
    tokens = [1] * (rounds + 1)
    ref = reference(tokens, drafts, [0] * rounds)
    run = SpecResult(tokens=tokens, drafts=theirs, accepted_per_step=[0] * rounds, depth=DEPTH)
    return ref, run


def test_differences_only_past_a_context_name_positions_not_the_fed_back_state():
    """Short prompts agree in every round, long prompts differ only at later draft positions: the per-prompt
    rule alone would blame the fed-back state (norm_output); across prompts the differences wait for the
    context (a sliding window, rope, max_position_embeddings), and the verdict says so first."""
    rows = []
    for i, length in enumerate((4, 4, 8, 4, 8, 4)):
        ref, run = rounds_result(length, set())
        rows.append(compare_prompt(i, [0] * length, ref, run, None, 1e-3, drafts_reported=True))
    for i, length in enumerate((60, 64), start=len(rows)):
        ref, run = rounds_result(length, {1, 3, 6})
        rows.append(compare_prompt(i, [0] * length, ref, run, None, 1e-3, drafts_reported=True))
    assert LATER_POSITIONS in rows[-1].symptom  # what one prompt alone shows
    report = report_of(rows)
    assert report.verdict == "FAIL" and report.context_dependence["from"] == 62
    assert report.failures[0].startswith("every round drafted at a context under 62 tokens agrees (49 rounds)")
    assert report.failures[0].endswith(CONTEXT_DEPENDENT)
    assert all(CONTEXT_DEPENDENT in f and LATER_POSITIONS not in f for f in report.failures[1:]), report.failures
    # the same differences in the short prompts as well: the fed-back state it stays
    rows = []
    for i, length in enumerate((4, 4, 8, 60, 64)):
        ref, run = rounds_result(length, {1, 3, 6})
        rows.append(compare_prompt(i, [0] * length, ref, run, None, 1e-3, drafts_reported=True))
    report = report_of(rows)
    assert report.context_dependence is None and all(LATER_POSITIONS in f for f in report.failures)
