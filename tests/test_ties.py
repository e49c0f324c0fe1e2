"""Numerical ties told from bugs (parity/ties.py): a runtime that picks the other of two logits within
1e-7 is a tie, counted and listed; one that picks a token 0.5 below the best fails with its symptom."""

import torch

from eagle31_export.parity.compare import ParityReport, Thresholds, _failures, compare_prompt
from eagle31_export.parity.ties import divergences
from eagle31_export.reference.replay import _token_gaps
from eagle31_export.reference.speculate import SpecResult

VOCAB = 8


def logits_with(best: int, runner_up: int, gap: float, positions: int) -> torch.Tensor:
    """[positions, VOCAB] logits whose best token is `best`, `runner_up` `gap` below it."""
    logits = torch.zeros(positions, VOCAB, dtype=torch.float32)
    logits[:, best] = 0.25  # where float32 still resolves 1e-7 (its spacing there is 3e-8)
    logits[:, runner_up] = 0.25 - gap
    return logits


def results(gap: float) -> tuple[SpecResult, SpecResult]:
    """The reference (greedy token 1 everywhere) and a run that committed token 2 at position 2."""
    logits = logits_with(1, 2, gap, 4)
    greedy = [int(t) for t in logits.argmax(-1)]
    committed = [1, 1, 2, 1]
    ref = SpecResult(tokens=greedy, drafts=[[1, 1], [1, 1]], accepted_per_step=[1, 0], depth=2,
                     token_gaps=_token_gaps(logits, greedy, committed), draft_margins=[[3.0, 3.0], [3.0, 3.0]])
    run = SpecResult(tokens=committed, drafts=[[1, 1], [1, 1]], accepted_per_step=[1, 0], depth=2)
    return ref, run


def test_logits_within_1e_7_are_a_tie_and_half_a_logit_is_a_break():
    tolerance = Thresholds().tie_gap(exact=True)
    tie = divergences(*results(1e-7), tolerance)
    broken = divergences(*results(0.5), tolerance)
    assert [(d.kind, d.index, d.tie) for d in tie] == [("token", 2, True)]
    assert [(d.kind, d.index, d.tie) for d in broken] == [("token", 2, False)]
    assert 0 < tie[0].gap < 1e-6 and abs(broken[0].gap - 0.5) < 1e-6


def test_a_report_counts_the_tie_and_fails_the_break_with_the_target_symptom():
    thresholds = Thresholds()
    report = ParityReport("runtime", 2, 0.0, True, thresholds, "replay")
    for i, gap in enumerate((1e-7, 0.5)):
        ref, run = results(gap)
        report.rows.append(compare_prompt(i, [0], ref, run, None, thresholds.logits_atol,
                                          tie_gap=thresholds.tie_gap(True)))
    assert report.ties_judged and report.tie_count == 1
    assert report.rows[0].ties and not report.rows[0].untied and report.rows[0].symptom is None
    failures = _failures(report)
    assert len(failures) == 1 and failures[0].startswith("prompt 1: token 2")
    assert "the target's own token 2 differs" in failures[0]


def test_a_round_decided_by_a_near_tie_of_the_drafter_is_a_tie():
    """Same tokens, one round accepted one draft fewer: judged at the reference drafter's top-2 margin."""
    ref = SpecResult(tokens=[1, 1, 1, 1], drafts=[[1, 1], [1, 1]], accepted_per_step=[1, 0], depth=2,
                     token_gaps=[0.0] * 4, draft_margins=[[5e-8, 3.0], [3.0, 3.0]])
    run = SpecResult(tokens=[1, 1, 1, 1], drafts=[[2, 1], [1, 1]], accepted_per_step=[0, 0], depth=2)
    found = divergences(ref, run, 1e-4)
    assert [(d.kind, d.index, d.draft_position, d.tie) for d in found] == [("round", 0, 1, True)]
    ref.draft_margins[0][0] = 0.5
    assert [d.tie for d in divergences(ref, run, 1e-4)] == [False]


def test_under_load_a_tie_is_counted_and_a_break_fails_as_batching():
    """At C = 4 one prompt commits the other of two logits 1e-7 apart, another a token 0.5 below the best:
    the level counts one tie, fails once, and blames the batched step for the break only."""
    from eagle31_export.parity.concurrency import BATCHING, LoadRuns, compare_levels
    from eagle31_export.runtime.contract import ConcurrentRun

    tie_ref, tie_run = results(1e-7)
    break_ref, break_run = results(0.5)
    base = [SpecResult(tokens=list(r.tokens), drafts=r.drafts, accepted_per_step=r.accepted_per_step, depth=2)
            for r in (tie_ref, break_ref)]  # at C = 1 both prompts gave the reference's own tokens
    replayed = {0: tie_ref, 1: break_ref}  # the reference along each run's own sequence, with its logit gaps

    def judge(index, run):
        return divergences(replayed[index], run, Thresholds().tie_gap(exact=True))

    load = LoadRuns({4: ConcurrentRun([tie_run, break_run])}, {4: 1.0})
    rows, failures = compare_levels(base, 1.0, base, load, 2, True, 0.02, judge)
    level = rows[1]
    assert level.tied_prompts == [0] and level.differing_prompts == [1]
    assert len(level.ties) == 1 and level.ties[0].startswith("prompt 0: token 2")
    assert len(failures) == 1 and "prompt 1: token 2" in failures[0] and BATCHING in failures[0]
    rows, failures = compare_levels(base, 1.0, base, load, 2, True, 0.02)  # without the judge: both fail as before
    assert rows[1].differing_prompts == [0, 1] and len(failures) == 1 and "2 of 2 prompts" in failures[0]
