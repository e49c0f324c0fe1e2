"""Ties measured at the runtime's precision, on our own runtime in bf16 (the reference pair's loop over
the tiny trained pair): at a small-margin step (the reference's best two within the error bf16
measurably makes there), a runtime that drafts the runner-up passes as a tie; the same runtime drafting
the reference's 3rd choice there fails, naming it (parity/ties.py): a known draft is judged by its own
logit, not by the top-2 margin."""

import math
from pathlib import Path

import pytest
import torch

from eagle31_export.demo.pair import DRAFTERS, TARGET, EmbeddedPair
from eagle31_export.parity.compare import run_parity_in_turn
from eagle31_export.parity.numerics import TIE_ERRORS
from eagle31_export.parity.numerics import measurer_for
from eagle31_export.reference import speculate
from eagle31_export.runtime.registry import LoadOptions, PairSource, load_speculator

PAIR = EmbeddedPair.open(Path(__file__).resolve().parents[2] / "examples" / "tiny" / "models")
EAGLE31 = PAIR.folder / DRAFTERS["EAGLE 3.1"]
SOURCE = PairSource.of(EAGLE31, PAIR.folder / TARGET)
DEPTH, TOKENS = 3, 24


class DraftsToken:
    """Our bf16 runtime, drafting `token` at one draft step of one prompt (the n-th draft its loop makes
    there) and its argmax everywhere else: a drafter bug at one decision."""

    def __init__(self, runtime, prompt: list[int], call: int, token: int):
        self.runtime, self.prompt, self.call, self.token = runtime, prompt, call, token

    def __getattr__(self, name):
        return getattr(self.runtime, name)

    def run(self, prompt_ids, *args, **kwargs):
        if list(prompt_ids) != self.prompt:
            return self.runtime.run(prompt_ids, *args, **kwargs)
        draft, calls = speculate._Sampler.draft, []

        def ranked(sampler, logits, drafter, vocab):
            calls.append(1)
            if len(calls) - 1 != self.call:
                return draft(sampler, logits, drafter, vocab)
            return self.token, None
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(speculate._Sampler, "draft", ranked)
            return self.runtime.run(prompt_ids, *args, **kwargs)


def bf16_runtime():
    return load_speculator("reference", SOURCE, LoadOptions(dtype=torch.bfloat16))


@pytest.fixture(scope="module")
def close_step():
    """(prompt, draft call, 3rd candidate's gap / error): the step along a faithful bf16 run where the
    reference's runner-up is nearest its best, in units of the error bf16 makes there, among the steps
    whose 3rd candidate lies beyond 1.5 TIE_ERRORS of them."""
    reference, runtime = load_speculator("reference", SOURCE), bf16_runtime()
    measurer = measurer_for(reference, False, torch.bfloat16, False)
    best = (math.inf, None, None)
    for prompt in PAIR.held_out_prompts(48)[:6]:
        run = runtime.run(prompt, TOKENS, DEPTH)
        ref, measured = measurer.replay(reference, prompt, run)
        for r, (tops, errors) in enumerate(zip(ref.draft_tops, measured.draft_errors)):
            if ref.drafts[r] != run.drafts[r]:
                break  # past a difference the two loops draft along other chains
            for j, (top, e) in enumerate(zip(tops, errors)):
                second, third = ((top.values[0] - top.values[i]) / e for i in (1, 2))
                if second < best[0] and third > 1.5 * TIE_ERRORS:
                    best = (second, prompt, r * DEPTH + j, top.ids, third)
    assert best[0] < TIE_ERRORS / 2, best  # the tiny drafter's best two often lie this close: such a step exists
    return best[1:]


@pytest.mark.parametrize("rank", [2, 3])
def test_a_draft_must_be_the_reference_best_or_its_close_runner_up(close_step, rank):
    prompt, call, candidates, ratio = close_step
    report = run_parity_in_turn(lambda: DraftsToken(bf16_runtime(), prompt, call, candidates[rank - 1]),
                                lambda: load_speculator("reference", SOURCE), [prompt], DEPTH, TOKENS,
                                per_depth_positions=0)
    assert report.ties_judged and not report.exact and report.numerics["precision"] == "bfloat16"
    position = f"round {call // DEPTH}, draft position {call % DEPTH + 1}:"
    if rank == 2:  # within the measured error of the best: a numerical tie, listed
        assert report.passed, report.failures
        assert any(t.startswith(position) for t in report.rows[0].ties), report.rows[0].ties
        assert 0 < report.numerics["largest_tie"] <= TIE_ERRORS, report.numerics  # the tie above, in units of its error
        # a PASS in bf16 says what bf16 cannot tell (docs/runtimes.md, "Measured power"); no FP4 blind spot here
        assert any("fc scaled by 1.05" in n for n in report.not_excluded), report.not_excluded
        assert "does not exclude" in report.compared and "input_scale" not in report.compared
    else:  # the old rule (top-2 margin) called this a tie; the 3rd choice lies `ratio` errors below the best
        assert not report.passed
        assert any(position in f and "the runtime chose the reference's choice 3" in f for f in report.failures), \
            (ratio, report.failures)
