"""Acceptance at every depth from one greedy text (parity/chains.py) against the speculation loop run
once a depth: the same accepted drafts in every round, on the tiny trained pair's held-out prompts for
both drafters, and on a long prompt that goes in several prefill pieces."""

from __future__ import annotations

from pathlib import Path

import pytest

from eagle31_export.demo.pair import DRAFTERS, TARGET, EmbeddedPair
from eagle31_export.parity.chains import acceptance_by_depth, greedy_text, rounds_at_depth
from eagle31_export.reference.speculate import PREFILL_CHUNK
from eagle31_export.runtime.registry import PairSource, load_speculator

PAIR = EmbeddedPair.open(Path(__file__).resolve().parents[1] / "examples" / "tiny" / "models")
DEPTHS = (1, 2, 3, 5)
NEW_TOKENS = 24


@pytest.mark.parametrize("label", sorted(DRAFTERS))
def test_rounds_from_one_text_are_the_loops_rounds_at_every_depth(label):
    speculator = load_speculator("reference", PairSource.of(PAIR.drafter(label), PAIR.folder / TARGET))
    pair = speculator.pair
    prompts = PAIR.held_out_prompts(48)[:4]
    long_prompt = [t for p in PAIR.held_out_prompts(160)[:4] for t in p][:PREFILL_CHUNK + 100]
    accepted_somewhere = 0
    for prompt in prompts + [long_prompt]:
        text = greedy_text(pair.target, prompt, NEW_TOKENS + max(DEPTHS) + 1)
        by_depth = acceptance_by_depth(pair.drafter.drafter, text, DEPTHS, NEW_TOKENS)
        for depth in DEPTHS:
            loop = speculator.run(prompt, NEW_TOKENS, depth)
            assert text.ids[len(prompt):len(prompt) + NEW_TOKENS] == loop.tokens
            assert by_depth[depth].accepted_per_step == loop.accepted_per_step, (label, depth)
            accepted_somewhere += sum(loop.accepted_per_step)
    assert accepted_somewhere > 20  # the comparison covered rounds that accepted drafts


def test_rounds_at_depth_follow_the_loops_arithmetic():
    # anchors' chain lengths: a round at anchor a accepts min(depth, L[a]) and moves by accepted + 1
    lengths = [3, 0, 0, 0, 2, 0, 0, 5, 1, 0, 0, 0]
    assert rounds_at_depth(lengths, 2, 8) == [2, 0, 2]  # anchors 0, 3, 4; tokens 1 + 3 + 1 + 3 = 8
    assert rounds_at_depth(lengths, 3, 8) == [3, 2]  # anchors 0, 4
    assert rounds_at_depth(lengths, 3, 9) == [3, 2, 3]  # anchor 7: the last round counted whole
    assert rounds_at_depth([0] * 10, 4, 6) == [0] * 5  # nothing accepted: one token a round after the prefill
    with pytest.raises(ValueError, match="need more"):
        rounds_at_depth([0, 0], 1, 6)
