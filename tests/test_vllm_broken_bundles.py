"""Broken bundles on a real vLLM engine (its CPU build): what a buggy exporter writes (a valid manifest over broken
content), each served by the suite's shared servers (tests/vllm_servers.py), one server a bundle, and failed by
parity with its symptom, greedy in bf16 (with and without FP4 activations) and sampled in fp32. Their own module,
so that `make test`'s two workers run them beside tests/test_vllm_engine.py (which they share nothing with)."""

from __future__ import annotations

import pytest

from eagle31_export.parity.compare import LATER_POSITIONS, POSITION_1
from test_vllm_engine import (  # noqa: F401  (vllm, sources: fixtures)
    DRAFTER31, FIXED_SAMPLER, TARGET, TINY, parity_on, sampled_figures, served, sources, vllm,
)

pytestmark = pytest.mark.engine


# the precisions users serve: bf16 on the BF16 target, and bf16 on the ModelOpt NVFP4 target, whose activations
# vLLM quantizes to FP4 (the reference follows without --act-quant: its quantization config says so)
SERVED = {"bf16": TARGET, "bf16-fp4": TINY / "target-nvfp4"}


@pytest.mark.parametrize("precision", sorted(SERVED))
@pytest.mark.parametrize("bug, symptom", [("norm_output", LATER_POSITIONS), ("taps", POSITION_1),
                                          ("fc_norm", POSITION_1), ("d2t", POSITION_1)])
def test_broken_bundles_fail_on_vllm_with_their_symptom(vllm, vllm_servers, sources, bug, symptom, precision):
    """Each bundle is what a buggy exporter would write (a valid manifest over broken content);
    vLLM runs every one of them without a word, in bf16 and in bf16 with FP4 activations, and parity
    fails it with its symptom: differences beyond what the precision measurably explains at each
    decision (parity/numerics.py). (Under sampling: the next test.)"""
    target = SERVED[precision]
    # 16 tokens a prompt: each bug fails within its first rounds (as under sampling, below)
    report = parity_on(vllm, served(vllm_servers, sources[bug], target, "bf16"), DRAFTER31, target=target,
                       max_new_tokens=16)
    assert not report.passed and not report.exact and report.ties_judged
    assert report.thresholds.fp4_activations is (precision == "bf16-fp4")
    assert report.numerics["precision"] == ("bfloat16 + FP4 activations" if precision == "bf16-fp4" else "bfloat16")
    assert any(symptom in f for f in report.failures), report.failures
    untied = [r.symptom for r in report.rows if r.untied]
    if symptom == LATER_POSITIONS:  # the first draft step is intact: no round differs beyond a tie at position 1
        assert not any(POSITION_1 in s for s in untied), untied
        assert report.tau("runtime") < report.tau("reference")


@pytest.mark.parametrize("bug, symptom", [("norm_output", LATER_POSITIONS), ("taps", POSITION_1),
                                          ("fc_norm", POSITION_1), ("d2t", POSITION_1)])
def test_broken_bundles_fail_under_sampling_on_vllm_with_their_symptom(vllm, vllm_servers, sources, bug, symptom):
    """The same four bundles served by vLLM's CPU build with our plugin's sampler fix, sampled at T 0.7 in
    fp32: (a) finds accepted tokens that are not the reference drafter's drafts, blames the drafter and
    names the symptom, whatever (b) says."""
    report = parity_on(vllm, served(vllm_servers, sources[bug]), DRAFTER31, temperature=0.7,
                       sampling_rule="greedy-drafts", max_new_tokens=16)
    print(sampled_figures(f"{bug} T=0.7", report))
    check = report.sampled
    assert report.engine_sampler["state"] == FIXED_SAMPLER
    assert report.verdict == "FAIL" and not check.drafts_exact and check.at_fault == "drafter", report.failures
    if symptom == LATER_POSITIONS:  # the first draft step is intact: nothing differs at position 1
        assert all(LATER_POSITIONS in f for f in report.failures), report.failures
    else:  # later drafts follow the first step's inputs: they may differ too, but position 1 does
        assert any(POSITION_1 in f for f in report.failures), report.failures
