"""Sampling parity under the greedy-drafts rule (vLLM's): (a) the drafter exactly, along the runtime's own
output, (b) acceptance against the target's probabilities. Our runtimes run that rule in their own loop:
ONNX Runtime passes both at T = 0.7 and 1.0; a sampler broken here (accept with p squared) fails (b) and is
named as the sampler; each drafter sabotage fails (a) with its symptom. The rule's pieces (top-k / top-p
cuts, the point-mass rejection step) are checked against hand-computed values."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from eagle31_export.demo.pair import DRAFTERS, TARGET, EmbeddedPair
from eagle31_export.errors import UserError
from eagle31_export.export.onnx_export import export_onnx
from eagle31_export.formats.drafter.checkpoint import read_drafter, write_drafter
from eagle31_export.parity.compare import run_parity
from eagle31_export.parity.sampling import ENGINE_EMITS, ENGINE_FEWER, ENGINE_MORE, GreedyDrafts, check_sampled
from eagle31_export.parity.symptoms import LATER_POSITIONS, POSITION_1
from eagle31_export.reference import speculate as loop
from eagle31_export.reference.replay import SampledRound
from eagle31_export.reference.speculate import Sampling, _Sampler
from eagle31_export.runtime.registry import PairSource, load_speculator

import sys

sys.path.insert(0, str(Path(__file__).resolve().parent / "parity"))
from sabotage import drop_fc_norm, pre_norm_feedback, shift_aux_ids, shift_d2t  # noqa: E402
from eagle31_export.parity.numerics import TIE_ERRORS  # noqa: E402

ERROR = 1e-4 / TIE_ERRORS  # the measured error of every simulated draft step: ties within 1e-4

def sampled_check(replays, error: float = ERROR):
    """check_sampled at depth 3 with every draft step's measured error `error`: a tie is a top-2 margin
    within TIE_ERRORS x error (1e-4 by default)."""
    return check_sampled(replays, 3, [[[error] * len(r.margins) for r in rounds] for rounds in replays], TIE_ERRORS)

PAIR = EmbeddedPair.open(Path(__file__).resolve().parents[1] / "examples" / "tiny" / "models")
MODELS = PAIR.folder
EAGLE31, EAGLE3 = MODELS / DRAFTERS["EAGLE 3.1"], MODELS / DRAFTERS["EAGLE-3"]
PROMPTS = PAIR.held_out_prompts(48)[:8]


def test_top_k_and_top_p_cut_as_vllm_does():
    logits = torch.tensor([0.0, 1.0, 2.0, 3.0])
    e = [math.exp(v) for v in (0.0, 1.0, 2.0, 3.0)]
    top2 = Sampling(1.0, top_k=2).probs(logits)
    assert top2.tolist() == pytest.approx([0, 0, e[2] / (e[2] + e[3]), e[3] / (e[2] + e[3])])
    # ascending cumulative mass: 0.032, 0.087, 0.237 (<= 1 - 0.7 = 0.3 is cut), 0.643
    total = sum(e)
    assert [sum(e[: i + 1]) / total for i in range(4)] == pytest.approx([0.0321, 0.1192, 0.3561, 1.0], abs=1e-3)
    kept = Sampling(1.0, top_p=0.7).probs(logits)
    assert kept.tolist() == pytest.approx([0, 0, e[2] / (e[2] + e[3]), e[3] / (e[2] + e[3])])
    assert Sampling(1.0, top_p=0.01).probs(logits).tolist() == pytest.approx([0, 0, 0, 1])  # the top token stays
    assert Sampling(0.5).probs(logits).tolist() == pytest.approx([math.exp(2 * v) / sum(math.exp(2 * w) for w in
                                                                  (0, 1, 2, 3)) for v in (0, 1, 2, 3)])
    with pytest.raises(UserError, match="unknown sampling rule"):
        Sampling(1.0, rule="typical")


def test_greedy_drafts_accept_with_p_and_recover_without_the_draft():
    """The rule's verify step: draft d accepted with probability p(d); a rejection never emits d."""
    logits = torch.log(torch.tensor([[0.6, 0.3, 0.1]]))
    accepted, emitted = 0, []
    for seed in range(2000):
        sampler = _Sampler(Sampling(1.0, rule="greedy-drafts"), seed)
        q = torch.zeros(3, dtype=torch.float64)
        q[1] = 1.0
        n, token = sampler.verify(logits.repeat(2, 1), [1], [q])
        accepted += n
        if not n:
            emitted.append(token)
    assert accepted / 2000 == pytest.approx(0.3, abs=0.035)  # p(d) = 0.3
    assert 1 not in emitted and emitted.count(0) / len(emitted) == pytest.approx(0.6 / 0.7, abs=0.04)


def _round(index, accepted, committed, drafts, p, rival=0.5, margins=(1.0, 1.0, 1.0)):
    return SampledRound(index, 10 + 4 * index, accepted, committed, drafts, list(margins), p, [rival] * len(p))


def test_check_tells_the_drafter_from_the_sampler():
    # an accepted token that is not the reference's draft: the drafter, by position
    bad = sampled_check([[_round(0, 2, [5, 9, 3], [5, 6, 7], [0.5, 0.5, 0.5])]])
    assert not bad.drafts_exact and bad.at_fault == "drafter" and LATER_POSITIONS in bad.failures()[0]
    # the same within the drafter's top-2 margin: a tie, listed, never a failure
    tie = sampled_check([[_round(0, 2, [5, 9, 3], [5, 6, 7], [0.5, 0.5, 0.5], margins=(1, 1e-6, 1))]])
    assert tie.failures() == [] and len(tie.prompts[0].ties) == 1
    # rejections emitting the reference's draft where the target gave it 1 % (bound 0.02 each): the sampler
    rounds = [_round(i, 0, [4], [4, 6, 7], [0.01, None, None]) for i in range(3)]
    emits = sampled_check([rounds])
    assert emits.at_fault == "sampler" and ENGINE_EMITS in emits.failures()[0]
    # once, at a likely draft: a drafter drafting otherwise explains it
    once = sampled_check([[_round(0, 0, [4], [4, 6, 7], [0.4, None, None], rival=0.3)]])
    assert once.drafter_open and once.at_fault == "drafter" and POSITION_1 in once.failures()[0]
    # ... unless the runtime run greedy drafts as the reference: then its sampler did not mask the draft
    once.greedy = GreedyDrafts(prompts=1, rounds=12, ties=0, untied=[])
    assert once.at_fault == "sampler" and len(once.failures()) == 1 and ENGINE_EMITS in once.failures()[0]
    assert "12 rounds are the reference's" in once.failures()[0] and POSITION_1 not in once.failures()[0]
    # ... and a greedy run that differs names the drafter with its symptom
    once.greedy = GreedyDrafts(1, 12, 0, [f"prompt 0, round 3, draft position 1: reference logit gap 2 ({POSITION_1})"])
    assert once.at_fault == "drafter" and "differ from the reference's in 1 places" in once.failures()[0]
    # the reference's draft accepted or emitted far more often than p(d) allows (20 of 20 rounds at p 0.3:
    # 6 expected, sd 2.05) while each rejection's emit stays within its bound (0.3 / 0.4): the sampler
    often = sampled_check([[_round(i, 0, [4], [4, 6, 7], [0.3, None, None], rival=0.6) for i in range(20)]])
    law = often.positions[0]
    assert law.drafted_or_emitted == 20 and law.emits_tail > 1e-3 and law.z_either == pytest.approx(14 / 4.2 ** 0.5)
    assert often.at_fault == "sampler" and ENGINE_MORE in often.failures()[0], often.failures()


@pytest.fixture(scope="module")
def sides(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sampling")
    reference = load_speculator("reference", PairSource.of(EAGLE31, MODELS / TARGET))
    onnx = load_speculator("onnxruntime", PairSource.of(EAGLE31, MODELS / TARGET,
                                                        export_onnx(EAGLE31, tmp / "onnx", MODELS / TARGET)))
    return reference, onnx


def _sampled(reference, runtime, temperature, prompts=PROMPTS, max_new_tokens=48, **kw):
    report = run_parity(reference, runtime, prompts, 3, max_new_tokens, temperature, 0, True,
                        sampling_rule="greedy-drafts", per_depth_positions=0, **kw)
    assert report.sampled is not None and report.sampling.rule == "greedy-drafts" and report.mode == "sampled-replay"
    return report


@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_onnxruntime_under_the_engine_rule_passes_both_checks(sides, temperature):
    report = _sampled(*sides, temperature)
    check = report.sampled
    assert report.verdict == "PASS", (report.failures, report.inconclusive)
    assert check.drafts_exact and check.accepted_checked > 20 and check.at_fault is None
    assert all(law.reached >= 10 and abs(law.z) <= 3 for law in check.positions), check.to_json()["positions"]
    observed, expected, half = check.tau
    assert abs(observed - expected) <= half * 3 / 1.96


def test_a_sampler_accepting_with_p_squared_fails_b_and_is_named(sides, monkeypatch):
    """(b) fails; the greedy run made for it finds the target's tokens the reference target's, which the
    failure says beside every cause it leaves (sampler, sampling parameters, target's probabilities)."""
    greedy = _Sampler.verify

    def verify(self, target_logits, drafts, q):
        if self.temperature == 0:
            return greedy(self, target_logits, drafts, q)
        for i, d in enumerate(drafts):
            p = self.probs(target_logits[i])
            if float(torch.rand((), generator=self.gen, dtype=torch.float64)) < float(p[d]) ** 2:
                continue
            masked = p.clone()
            masked[d] = 0
            return i, int(torch.multinomial(masked / masked.sum(), 1, generator=self.gen))
        return len(drafts), self.pick(target_logits[len(drafts)])

    monkeypatch.setattr(_Sampler, "verify", verify)
    report = _sampled(*sides, 0.7)
    assert report.verdict == "FAIL" and report.sampled.drafts_exact and report.sampled.at_fault == "sampler"
    assert report.failures and all(ENGINE_FEWER in f for f in report.failures), report.failures
    assert report.sampled.greedy is not None and not report.sampled.greedy.target_tokens
    assert all("its target's tokens are the reference target's" in f for f in report.failures), report.failures


def test_a_sampler_emitting_its_drafts_is_named_once_greedy_clears_the_drafter(sides, monkeypatch):
    """A rejection that resamples without masking its draft emits the reference's draft: the drafter is
    then open, ONNX Runtime runs greedy over the same prompts, drafts as the reference, and the verdict
    names the sampler."""
    greedy = _Sampler.verify

    def verify(self, target_logits, drafts, q):
        if self.temperature == 0:
            return greedy(self, target_logits, drafts, q)
        for i, d in enumerate(drafts):
            p = self.probs(target_logits[i])
            if float(torch.rand((), generator=self.gen, dtype=torch.float64)) < float(p[d]):
                continue
            kept = p.clone()  # the draft is not masked out
            return i, int(torch.multinomial(kept / kept.sum(), 1, generator=self.gen))
        return len(drafts), self.pick(target_logits[len(drafts)])

    monkeypatch.setattr(_Sampler, "verify", verify)
    report = _sampled(*sides, 1.0, PROMPTS[:4], 32)
    check = report.sampled
    assert check.emitted_drafts and check.greedy is not None and check.greedy.exact, check.to_json()["greedy"]
    assert check.greedy.rounds > 20 and report.verdict == "FAIL" and check.at_fault == "sampler", report.failures
    assert all(ENGINE_EMITS in f or ENGINE_MORE in f for f in report.failures), report.failures


@pytest.mark.parametrize("bug, make, symptom", [
    ("norm_output", pre_norm_feedback, LATER_POSITIONS), ("taps", lambda c: shift_aux_ids(c, 8), POSITION_1),
    ("fc_norm", drop_fc_norm, POSITION_1), ("d2t", shift_d2t, POSITION_1)])
@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_each_drafter_sabotage_fails_a_with_its_symptom(sides, tmp_path, bug, make, symptom, temperature):
    """Our loop over the sabotaged drafter, the engine's rule: (a) finds accepted tokens that are not the
    reference's drafts, and names the drafter."""
    broken = write_drafter(make(read_drafter(EAGLE31)), tmp_path / bug, "specforge")
    runtime = load_speculator("reference", PairSource.of(broken, MODELS / TARGET))
    report = _sampled(sides[0], runtime, temperature, PROMPTS[:4], 32)
    assert report.verdict == "FAIL" and report.sampled.at_fault == "drafter", report.failures
    if symptom == LATER_POSITIONS:  # the first draft step is intact: nothing differs at position 1
        assert all(LATER_POSITIONS in f for f in report.failures), report.failures
    else:  # later drafts follow the first step's inputs: they may differ too, but position 1 does
        assert any(POSITION_1 in f for f in report.failures), report.failures


def test_eagle3_under_the_engine_rule_passes(tmp_path):
    reference = load_speculator("reference", PairSource.of(EAGLE3, MODELS / TARGET))
    report = _sampled(reference, load_speculator("reference", PairSource.of(EAGLE3, MODELS / TARGET)), 1.0,
                      top_p=0.9, top_k=20)
    assert report.verdict == "PASS", report.failures
    assert report.sampling.top_p == 0.9 and report.sampling.top_k == 20


def test_rules_our_loop_does_not_know_and_cuts_without_sampling_are_refused(cli):
    code, out, err = cli("parity", "--drafter", EAGLE31, "--target", MODELS / TARGET, "--runtime", "reference",
                         "--top-p", "0.9")
    assert code == 2 and "give --temperature above 0" in err and len(err.strip().splitlines()) == 1
    code, out, err = cli("parity", "--drafter", EAGLE31, "--target", MODELS / TARGET, "--runtime", "reference",
                         "--temperature", "0.7", "--sampling-rule", "typical")
    assert code == 2 and "unknown sampling rule" in err and len(err.strip().splitlines()) == 1
